"""hostsweep: Ray-distributed sweeps of LLM decode latency across GPU kinds.

The pure core (grid, measure, shapes, fit, compare) imports no Ray, MLflow or vLLM.
"""
__version__ = "0.1.0"
