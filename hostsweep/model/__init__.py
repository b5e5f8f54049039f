"""model: the closed-form TP latency model of the tensor-parallel study [2]
(README.md#references). Roofline compute term, all-reduce and host fits, H(N) from
TP-1 cells, host forms scored held-out, the a-priori memory regime, falsification,
verdicts with bootstrap evidence, what-if answers, synthetic cells.

The fit stage is one pure function, `study_fit.fit_study(cells, terms, options)`, whose
`FitReport.to_dict()` is the fit.json other stages read. Pure, every module: no Ray,
MLflow, vLLM or torch (the microbenchmarks, the fit logged to MLflow and the
`hostsweep-model` command are in the calibrate package). May import config and measure;
never run, record, calibrate, report or stages.
"""
