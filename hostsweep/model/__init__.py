"""model: the closed-form TP latency model of seed 002. Roofline compute term, all-reduce
and host fits, host forms scored held-out, the a-priori memory regime, falsification,
what-if answers; calibration microbenchmarks and the `hostsweep-model` command.

Pure except cli.py, calibrate.py and allreduce_bench.py (torch, Ray, MLflow at the edges,
imported lazily). May import config, measure and record; never report or stages.
"""
