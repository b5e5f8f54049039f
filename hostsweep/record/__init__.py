"""record: where results are kept. MLflow runs of sweeps and cells (tracking), a measured
cell's way to the journal, cells.csv and MLflow (recorder), fitted models and calibrations
(registry), comparison reports (reports), where a number came from (provenance), the
cells the fit and compare stages read back (selection), and the checks of the world a
sweep passes before Ray starts (preflight: the run directory, the store, the cluster).

The only package that imports mlflow. May import config, measure, engines and run.
"""
