"""An MLflow store holding a sweep's cell runs written from a table (no engine, no Ray):
what the fit and compare stages read, for tests of those stages alone."""
from __future__ import annotations

import math

import pandas as pd
from mlflow.entities import Metric, Param

from hostsweep.record.tracking import SweepTracker

PARAMS = ("sku", "model", "mode", "tp", "batch", "ctx", "T", "dtype")
METRICS = ("step_ms", "step_ci_low_ms", "step_ci_high_ms", "host_ms", "device_ms", "host_frac")


def write_sweep(uri: str, experiment: str, cells: pd.DataFrame) -> tuple[str, list[str]]:
    """One parent run and a FINISHED child per row (columns PARAMS and METRICS); returns
    the parent's run id and the children's."""
    tracker = SweepTracker(uri, experiment)  # artifacts beside the store, as a sweep's
    client, experiment_id = tracker.client, tracker.experiment_id
    parent = client.create_run(experiment_id, run_name=f"{experiment} sweep").info.run_id
    children = []
    for i, row in enumerate(cells.to_dict(orient="records")):
        params = {"mode": "eager", "dtype": "bfloat16", "T": 33, **{k: row[k] for k in PARAMS if k in row}}
        run = client.create_run(experiment_id, run_name=f"cell-{i}",
                                tags={"mlflow.parentRunId": parent, "cell_key": f"{row['sku']}/{row['tp']}/{i}"})
        client.log_batch(run.info.run_id, params=[Param(k, str(v)) for k, v in params.items()],
                         metrics=[Metric(k, float(row[k]), 0, 0) for k in METRICS
                                  if k in row and math.isfinite(float(row[k]))])
        client.set_terminated(run.info.run_id, "FINISHED")
        children.append(run.info.run_id)
    client.set_terminated(parent, "FINISHED")
    return parent, children
