"""record: where results are kept. MLflow runs of sweeps and cells (tracking), fitted
models and calibrations (registry), comparison reports (reports), and where a number came
from (provenance).

The only package that imports mlflow. May import config, measure, engines and run.
"""
