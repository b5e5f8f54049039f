"""model: the closed-form TP latency model of the tensor-parallel study [2]
(README.md#references). Roofline compute term, all-reduce and host fits, host forms
scored held-out, the a-priori memory regime, falsification, verdicts with bootstrap
evidence, what-if answers; calibration microbenchmarks and the
`hostsweep-model` command.

The fit stage is one pure function, `study_fit.fit_study(cells, terms, options)`, whose
`FitReport.to_dict()` is the fit.json other stages read. Pure except cli.py,
fit_command.py (MLflow via record, imported lazily), calibrate.py and allreduce_bench.py
(torch, Ray at the edges, imported lazily). May import config, measure and record; never
report or stages.
"""
