"""Fitted models and calibrations in MLflow: a TP latency model as a pyfunc run in the
`models` experiment, calibration microbenchmarks as runs of `calibration`.

The pyfunc is handed its predict function rather than importing the model package, so
this package keeps to the import order (record before model); MLflow pickles the
function by reference, so loading the model back needs hostsweep installed.
"""
from __future__ import annotations

import logging
import math
import re
import warnings
from typing import Any, Callable, Mapping

import mlflow
import mlflow.pyfunc
import pandas as pd
from mlflow.entities import Metric, Param

from hostsweep.record.views import CALIBRATION_DESCRIPTION, MODELS_DESCRIPTION
from hostsweep.record.tracking import SweepTracker

# (spec, rows of model/sku/tp/batch/ctx) -> the rows with a step_ms column
PredictRows = Callable[[Mapping[str, Any], pd.DataFrame], pd.DataFrame]


class TPLatencyPyfunc(mlflow.pyfunc.PythonModel):
    """The fitted TP latency model as an MLflow pyfunc: rows of (model, sku, tp, batch,
    ctx) in, step_ms out. The spec is plain data (see hostsweep.model.tpmodel)."""

    def __init__(self, spec: dict, predict_rows: PredictRows) -> None:
        self.spec = spec
        self.predict_rows = predict_rows

    def predict(self, context, model_input: pd.DataFrame, params=None) -> pd.DataFrame:
        return self.predict_rows(self.spec, model_input)[["step_ms"]]


def mlflow_key(name: str) -> str:
    """`name` as a key MLflow accepts (letters, digits and _ - . /): each run of anything else
    becomes one underscore, so a term named for a reader ("allreduce (standalone, beside)")
    still logs: 'allreduce (standalone, beside)_source.cpu' -> 'allreduce_standalone_beside_source.cpu'."""
    return re.sub(r"_+", "_", re.sub(r"[^\w.\-/]+", "_", name)).strip("_") or "unnamed"


def log_model_fit(tracking_uri: str, experiment: str, run_name: str, params: dict[str, object],
                  metrics: dict[str, float], tables: dict[str, pd.DataFrame], spec: dict,
                  predict_rows: PredictRows, input_columns: tuple[str, ...],
                  texts: Mapping[str, str] | None = None) -> str:
    """One run in the models experiment: params, metrics, tables (CSV), text artifacts
    (e.g. fit.json, by file name) and the pyfunc model."""
    from mlflow.models import infer_signature

    tracker_experiment = SweepTracker(tracking_uri, experiment, MODELS_DESCRIPTION).experiment_id
    mlflow.set_tracking_uri(tracking_uri)
    example = pd.DataFrame([{"model": next(iter(spec["shapes"])), "sku": next(iter(spec["skus"])),
                             "tp": 2, "batch": 1, "ctx": 512}])[list(input_columns)]
    with warnings.catch_warnings():  # the hint is about our one-row example's int columns, not the user's data
        warnings.filterwarnings("ignore", message="Hint: Inferred schema contains integer", category=UserWarning)
        signature = infer_signature(example, predict_rows(spec, example)[["step_ms"]])
    with mlflow.start_run(experiment_id=tracker_experiment, run_name=run_name) as run:
        mlflow.log_params({mlflow_key(k): str(v)[:500] for k, v in params.items()})
        mlflow.log_metrics({k: v for k, v in metrics.items() if math.isfinite(v)})
        for name, table in tables.items():
            mlflow.log_text(table.to_csv(index=False), f"{name}.csv")
        for name, text in (texts or {}).items():
            mlflow.log_text(text, name)
        # MLflow warns on every Python-object pyfunc that cloudpickle runs code on load: true of
        # any pickle, and the model is our own; the warning is all its logger says here.
        pyfunc_log = logging.getLogger("mlflow.pyfunc")
        level, pyfunc_log.level = pyfunc_log.level, logging.ERROR
        try:
            mlflow.pyfunc.log_model(name="model", python_model=TPLatencyPyfunc(spec, predict_rows), signature=signature,
                                    input_example=example, pip_requirements=["hostsweep", "pandas", "numpy"])
        finally:
            pyfunc_log.setLevel(level)
        return run.info.run_id


def load_model_spec(tracking_uri: str, model_uri: str) -> dict:
    """The spec of a logged TP latency model (runs:/<id>/model, or any pyfunc URI)."""
    mlflow.set_tracking_uri(tracking_uri)
    return mlflow.pyfunc.load_model(model_uri).unwrap_python_model().spec


def log_calibration(tracking_uri: str, kind: str, sku: str, params: dict[str, object],
                    metrics: dict[str, float], table: pd.DataFrame, experiment: str = "calibration") -> str:
    """One calibration microbenchmark (allreduce, roofs, host) as a run: params, the
    fitted values as metrics, and the raw measurements as a table artifact."""
    tracker = SweepTracker(tracking_uri, experiment, CALIBRATION_DESCRIPTION)
    run = tracker.client.create_run(tracker.experiment_id, run_name=f"{kind}/{sku}",
                                    tags={"calibration_kind": kind, "sku": sku})
    run_id = run.info.run_id
    tracker.client.log_batch(
        run_id, params=[Param(k, str(v)[:500]) for k, v in params.items()],
        metrics=[Metric(k, float(v), 0, 0) for k, v in metrics.items() if math.isfinite(float(v))])
    tracker.client.log_text(run_id, table.to_csv(index=False), f"{kind}.csv")
    tracker.client.set_terminated(run_id, "FINISHED")
    return run_id
