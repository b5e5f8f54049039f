"""calibrate: the TP model's work on the cluster and in MLflow. The calibration
microbenchmarks (achieved roofs, the all-reduce sweep; torch) run here or as Ray tasks
pinned to the SKU they describe; the fixed terms a fit holds (terms: each from the
calibration, the datasheet, or measured here and logged to MLflow); a fit written and
logged (fit_command.fit_and_log, the one fit path of `stage=fit|compare|all`); and the
`hostsweep-model` command (cli).

The model itself (model/) stays pure; this package is where it meets Ray, torch and
MLflow (through record), each imported lazily. May import config, measure, engines,
run, record and model; never report or stages.
"""
