"""hostsweep: Ray-distributed sweeps of LLM decode latency across GPU kinds.

Sub-packages follow the data: config → measure → engines → run → record → model →
report → stages; a module imports only from packages before its own in that list (a
test checks it). The pure core (config, measure, model's fit/compare, report) imports
no Ray, MLflow or vLLM.
"""
__version__ = "0.1.0"
