"""MLflow recording of sweeps: one experiment per study, a parent run per sweep, a child
per cell.

With registry.py (fitted models, calibrations), the only modules that import mlflow. It
uses MlflowClient with explicit run ids, so results can be logged from the driver's
result loop in any order.
"""
from __future__ import annotations

import logging
import math
import sys
import tempfile
from pathlib import Path
from typing import Optional

import mlflow
import pandas as pd
from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

from hostsweep.measure.results import CellResult, cell_metrics, logged_row, split_tags

log = logging.getLogger(__name__)


def local_artifact_root(tracking_uri: str) -> Optional[Path]:
    """Artifacts beside a local sqlite store (outputs/mlartifacts), None for servers."""
    prefix = "sqlite:///"
    if not tracking_uri.startswith(prefix):
        return None
    return Path(tracking_uri[len(prefix):]).resolve().parent / "mlartifacts"


def prepare_store(tracking_uri: str) -> None:
    """Create the folder of a local sqlite store; MLflow does not."""
    root = local_artifact_root(tracking_uri)
    if root is not None:
        root.parent.mkdir(parents=True, exist_ok=True)


def timings_table(result: CellResult) -> str:
    """The raw per-rep timings of a cell as CSV."""
    assert result.measurement is not None
    rows = [
        {"rep": r.rep, "t1_first": r.t1_first, "wall_1_ms": r.wall_1_s * 1e3,
         "wall_T_ms": r.wall_T_s * 1e3, "step_ms": r.step_s * 1e3}
        for r in result.measurement.reps
    ]
    return pd.DataFrame(rows).to_csv(index=False)


def top_ops_table(result: CellResult) -> str:
    """Ops/kernels by time per decode step, from the differenced profiled pair."""
    assert result.split is not None
    frame = pd.DataFrame(result.split.top_ops, columns=["op", "ms_per_step"])
    frame["share_of_device"] = frame["ms_per_step"] / result.split.device_ms
    return frame.to_csv(index=False)


def linearity_table(result: CellResult) -> str:
    assert result.linearity is not None
    lin = result.linearity
    frame = pd.DataFrame({"T": lin.tokens, "wall_ms": lin.wall_ms})
    if lin.kernel_ms:
        frame["kernel_ms"] = lin.kernel_ms
    return frame.to_csv(index=False)


class SweepTracker:
    """Records one sweep: the parent run, then a child run per cell as it arrives."""

    def __init__(self, tracking_uri: str, experiment: str) -> None:
        prepare_store(tracking_uri)
        self.tracking_uri = tracking_uri
        self.client = MlflowClient(tracking_uri)
        self.experiment_id = self._experiment_id(experiment)
        self.parent_run_id: Optional[str] = None

    def _experiment_id(self, name: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        root = local_artifact_root(self.tracking_uri)
        location = (root / name).as_uri() if root is not None else None
        return self.client.create_experiment(name, artifact_location=location)

    def finished_cells(self) -> dict[str, dict[str, object]]:
        """FINISHED cell runs of this experiment by cell key (what a resumed sweep skips),
        each as the cell-table row it had when measured (report.cell_row's columns)."""
        rows: dict[str, dict[str, object]] = {}
        page_token = None
        while True:
            page = self.client.search_runs([self.experiment_id], "attributes.status = 'FINISHED'",
                                           max_results=5000, page_token=page_token)
            for run in page:
                tags = run.data.tags
                if "cell_key" in tags:
                    rows[tags["cell_key"]] = logged_row(run.data.params, run.data.metrics, tags, run.info.run_id)
            page_token = page.token
            if not page_token:
                return rows

    def start_sweep(self, run_name: str, config_yaml: str, params: dict[str, object],
                    tags: dict[str, str]) -> str:
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags)
        self.parent_run_id = run.info.run_id
        self.client.log_batch(self.parent_run_id, params=[Param(k, str(v)) for k, v in params.items()])
        self.client.log_text(self.parent_run_id, config_yaml, "config.yaml")
        return self.parent_run_id

    def log_cell(self, result: CellResult, tags: dict[str, str]) -> str:
        """One child run for one cell, terminated with the cell's status."""
        all_tags = {
            "mlflow.parentRunId": self.parent_run_id or "",
            "cell_key": result.key,
            **result.host,
            **split_tags(result),
            **tags,
        }
        run = self.client.create_run(self.experiment_id, run_name=cell_run_name(result.params), tags=all_tags)
        run_id = run.info.run_id
        metrics = [Metric(k, v, 0, 0) for k, v in cell_metrics(result).items() if math.isfinite(v)]
        self.client.log_batch(run_id, metrics=metrics,
                              params=[Param(k, str(v)) for k, v in result.params.items()])
        if result.measurement is not None:
            self.client.log_text(run_id, timings_table(result), "raw_timings.csv")
        self._log_analysis(run_id, result)
        if result.error:
            self.client.set_tag(run_id, "failure_reason", result.error[:5000])
            self.client.log_text(run_id, result.error, "failure.txt")
        self.client.set_terminated(run_id, status=result.status)
        return run_id

    def _log_analysis(self, run_id: str, result: CellResult) -> None:
        if result.split is not None:
            self.client.log_text(run_id, top_ops_table(result), "top_ops.csv")
        if result.linearity is not None:
            self.client.log_text(run_id, linearity_table(result), "linearity.csv")
        if result.thread_states is not None:
            self.client.log_text(run_id, result.thread_states.to_csv(index=False), "thread_states.csv")
        if result.traces:
            with tempfile.TemporaryDirectory() as folder:
                for name, data in result.traces.items():
                    (Path(folder) / name).write_bytes(data)
                self.client.log_artifacts(run_id, folder, "traces")

    def finish_sweep(self, status: str, metrics: dict[str, float]) -> None:
        if self.parent_run_id is None:
            return
        self.client.log_batch(self.parent_run_id, metrics=[Metric(k, v, 0, 0) for k, v in metrics.items()])
        self.client.set_terminated(self.parent_run_id, status=status)

    def runs_table_url(self, port: int = 5000) -> str:
        """The UI link that opens the runs table (3.x opens a GenAI overview otherwise)."""
        return runs_table_url(self.experiment_id, port)


# Cell metrics read back as columns besides step_ms (absent ones come back as NaN).
CELL_METRICS = ("step_ci_low_ms", "step_ci_high_ms", "host_ms", "device_ms", "host_frac")


def read_cells(tracking_uri: str, experiments: list[str], parent_run_id: Optional[str] = None,
               filter_string: Optional[str] = None) -> pd.DataFrame:
    """Finished cell runs of the given sweep experiments as a measured-cell table (step_ms
    with its 95% CI, host/device split where the cell was split, every other metric the
    cells have, and each cell's run id, name, parent sweep run and start time). Only the
    children of `parent_run_id` when given; `filter_string` is an MLflow search filter."""
    mlflow.set_tracking_uri(tracking_uri)
    clauses = [f"tags.mlflow.parentRunId = '{parent_run_id}'"] if parent_run_id else []
    clauses += [filter_string] if filter_string else []
    runs = mlflow.search_runs(experiment_names=experiments, filter_string=" and ".join(clauses))
    if runs.empty or "tags.cell_key" not in runs:
        return pd.DataFrame()
    # cell runs carry a cell_key; a sweep's parent run has list-valued params (batch "[1, 4]")
    cells = runs[runs["tags.cell_key"].notna() & (runs["status"] == "FINISHED")]
    nan = pd.Series(float("nan"), index=cells.index)
    frame = pd.DataFrame({
        "sku": cells["params.sku"], "model": cells["params.model"],
        "mode": cells.get("params.mode", pd.Series("eager", index=cells.index)),
        "tp": cells["params.tp"].astype(int), "batch": cells["params.batch"].astype(int),
        "ctx": cells["params.ctx"].astype(int), "T": cells["params.T"].astype(int), "dtype": cells["params.dtype"],
        "step_ms": cells["metrics.step_ms"].astype(float),
        **{name: cells.get(f"metrics.{name}", nan).astype(float) for name in CELL_METRICS},
        "cell_key": cells["tags.cell_key"], "run_id": cells["run_id"],
        "run_name": cells.get("tags.mlflow.runName", nan),
        "parent_run_id": cells.get("tags.mlflow.parentRunId", nan),
        "start_time": cells["start_time"],
    })
    others = {c[len("metrics."):]: cells[c].astype(float) for c in cells if c.startswith("metrics.")
              and c[len("metrics."):] not in frame}
    return frame.assign(**others).reset_index(drop=True)


def experiment_ids(tracking_uri: str) -> dict[str, str]:
    """Every experiment of the store by name (what a selection error lists)."""
    return {e.name: e.experiment_id for e in MlflowClient(tracking_uri).search_experiments()}


def cell_run_name(params: dict[str, object]) -> str:
    """A cell run's name a person can read: b4-ctx512-eager-tp1, then the SKU and model
    (one sweep may span several of each)."""
    return f"b{params['batch']}-ctx{params['ctx']}-{params['mode']}-tp{params['tp']}-{params['sku']}-{params['model']}"


def runs_table_url(experiment_id: str, port: int = 5000, run_id: Optional[str] = None) -> str:
    """The UI link to an experiment's runs table (or one run): MLflow 3.x opens a GenAI
    overview unless the link asks for the machine-learning workflow."""
    where = f"runs/{run_id}" if run_id else "runs"
    return f"http://127.0.0.1:{port}/#/experiments/{experiment_id}/{where}?workflowType=machine_learning"


def ui_command(tracking_uri: str, port: int = 5000) -> str:
    """The stock MLflow UI on this store, bound to loopback (the interpreter that ran the
    stage has mlflow, whether or not its venv is activated)."""
    return f"{sys.executable} -m mlflow ui --backend-store-uri {tracking_uri} --host 127.0.0.1 --port {port}"
