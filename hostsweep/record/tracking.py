"""MLflow recording of sweeps: one experiment per study, a parent run per sweep, a child
per cell.

SweepTracker is the one object the stages record through. This module holds its
experiment and the sweep's parent run; the rest of it is in its bases, one job each:
experimentruns.py (runs read back, a page at a time), liveruns.py (claims between live
sweeps, stale runs reaped), cellruns.py (a cell's child run written).
It uses MlflowClient with explicit run ids, so results can be logged from the driver's
result loop in any order.

What the UI shows: experiments carry a description; a cell run's start and end are its
measurement's (MLflow cannot move a run's start, so the claim run made before measuring
is replaced by one created with the measurement's start time); runs are named for what
varies (`b4-ctx512` under `default: cpu/tiny-llama/eager/tp1`); every link carries
`?workflowType=machine_learning`, without which MLflow 3 opens a GenAI overview
(mlflow/mlflow#24498; nothing on the server side chooses the view).
"""
from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import pandas as pd
from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

from hostsweep.record.cellruns import CellRuns
from hostsweep.record.claims import HEARTBEAT_TAG, LIVE_HERE, OWNER_TAG, this_owner
from hostsweep.record.read.dbread import is_database
from hostsweep.record.liveruns import LiveRuns
from hostsweep.record.store import (
    SERVED_SCHEME, local_artifact_root, quiet_mlflow, served_artifacts, served_location,
)
from hostsweep.record.provenance import package_version
from hostsweep.record.views import KIND, KIND_TAG, NOTE_TAG, open_ui_line, runs_table_url, store_label, ui_base

# Each MLflow HTTP call fails within seconds instead of retrying for ~4 min (MLflow's
# defaults: 7 retries, backoff factor 2, 120 s timeout); the uploader does the waiting.
# MLflow's own "View run at <uri>" lines would print the URI, credentials and all.
CLIENT_ENV = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
}

def served_repository(artifact_uri: str, tracking_uri: Optional[str] = None, registry_uri: Optional[str] = None) -> Any:
    """MLflow's repository for a server-proxied artifact URI (mlflow-artifacts:/...), or,
    for a database tracking URI (the server's own store, which MLflow's repository cannot
    reach them through), the repository of the same place in the server's destination
    (store.serve_artifacts_from)."""
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository
    from mlflow.store.artifact.mlflow_artifacts_repo import MlflowArtifactsRepository

    if tracking_uri is not None and is_database(tracking_uri):
        return get_artifact_repository(served_location(artifact_uri), tracking_uri=tracking_uri)
    return MlflowArtifactsRepository(artifact_uri, tracking_uri=tracking_uri, registry_uri=registry_uri)


def _route_served_artifacts() -> None:
    # MLflow's registry of artifact schemes (the one its plugins' entry points fill):
    # every client of this process, the stages' too, finds mlflow-artifacts: through it.
    from mlflow.store.artifact.artifact_repository_registry import _artifact_repository_registry

    _artifact_repository_registry.register(SERVED_SCHEME, served_repository)


def bounded_requests() -> None:
    for key, value in CLIENT_ENV.items():
        os.environ.setdefault(key, value)


def prepare_store(tracking_uri: str) -> None:
    """Create the folder of a local sqlite store; MLflow does not."""
    root = local_artifact_root(tracking_uri)
    if root is not None:
        root.parent.mkdir(parents=True, exist_ok=True)


class SweepTracker(CellRuns, LiveRuns):
    """Records one sweep: the parent run, then a child run per cell as it arrives."""

    def __init__(self, tracking_uri: str, experiment: str, description: Optional[str] = None,
                 direct_writes: Optional[bool] = None) -> None:
        bounded_requests()
        _route_served_artifacts()
        if direct_writes is not None:
            self.direct_writes = direct_writes
        quiet_mlflow()
        prepare_store(tracking_uri)
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.client = MlflowClient(tracking_uri)
        self.artifact_location: Optional[str] = None  # the experiment's, where its runs' files go
        self.experiment_id = self._experiment_id(experiment, description)
        self.parent_run_id: Optional[str] = None
        self.varying: Optional[tuple[str, ...]] = None  # the axes cell run names show
        # journal entry -> the run a cell's measurement is being logged into (a retried
        # delivery reuses it instead of creating another), until `delivered`
        self.logged_into: dict[str, str] = {}
        self.claim_tags = 0  # claims.<n> tags this sweep has written on its parent run
        self._planned: dict[str, str] = {}  # journal entry -> the run id a direct write uses, until written
        self._repos: dict[str, str] = {}  # run id -> its artifact URI, while its cell is logged
        self._writer: Any = None  # a database store's writer (dbwrite.py), made at the first cell; False: none
        self._rows_read: dict[str, dict[str, object]] = {}  # run id -> row, where finished_index read every row

    def _experiment_id(self, name: str, description: Optional[str]) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            self.artifact_location = found.artifact_location
            if description and NOTE_TAG not in found.tags:  # experiments made before descriptions were
                self.client.set_experiment_tag(found.experiment_id, NOTE_TAG, description)
            return found.experiment_id
        root = local_artifact_root(self.tracking_uri)
        location = (root / name).as_uri() if root is not None else None
        if served_artifacts() and is_database(self.tracking_uri):
            location = f"{SERVED_SCHEME}:/{name}"  # laid out as the server would: its UI serves them
        self.artifact_location = location
        tags = {KIND_TAG: KIND, **({NOTE_TAG: description} if description else {})}
        return self.client.create_experiment(name, artifact_location=location, tags=tags)

    def check_artifacts(self) -> None:
        """ConfigError, before anything is written, where this experiment's files are behind
        a tracking server (mlflow-artifacts:) that a database tracking URI reaches only with
        the server's destination (tracking.artifacts); reading its runs needs none."""
        if is_database(self.tracking_uri) and self.artifact_location:
            served_location(self.artifact_location)

    def start_sweep(self, run_name: str, config_yaml: str, params: dict[str, object],
                    tags: dict[str, str], varying: Optional[Sequence[str]] = None) -> str:
        """The sweep's parent run; `varying`: the cell axes its cells' run names show."""
        self.varying = tuple(varying) if varying is not None else None
        tags = {**tags, HEARTBEAT_TAG: f"{time.time():.0f}", OWNER_TAG: this_owner()}
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags)
        self.parent_run_id = run.info.run_id
        LIVE_HERE.add(self.parent_run_id)
        self.client.log_batch(self.parent_run_id, params=[Param(k, str(v)) for k, v in params.items()])
        self.client.log_text(self.parent_run_id, config_yaml, "config.yaml")
        return self.parent_run_id

    def describe_sweep(self, markdown: str) -> None:
        """The parent run's description (Markdown, shown on its page in the UI)."""
        if self.parent_run_id is not None:
            self.client.set_tag(self.parent_run_id, NOTE_TAG, markdown)

    def log_sweep_files(self, files: Sequence[Path], figures: Sequence[Path] = ()) -> None:
        """Files of the run directory (cells.csv, summary.json) and its figures, as written
        (figures/<name>.png: uploaded, not drawn a second time), on the parent run."""
        if self.parent_run_id is None:
            return
        for path in files:
            self.client.log_artifact(self.parent_run_id, str(path))
        for path in figures:
            self.client.log_artifact(self.parent_run_id, str(path), "figures")

    def run_url(self, run_id: str, port: int = 5000) -> str:
        return runs_table_url(self.experiment_id, port, run_id, ui_base(self.tracking_uri, port))

    def log_study_summary(self, tables: dict[str, pd.DataFrame], metrics: dict[str, float]) -> None:
        """Study-level comparisons on the parent run: each table as study/<name>.csv, and
        the summary figures as metrics."""
        if self.parent_run_id is None:
            return
        for name, frame in tables.items():
            self.client.log_text(self.parent_run_id, frame.to_csv(index=False), f"study/{name}.csv")
        finite = [Metric(k, float(v), 0, 0) for k, v in metrics.items() if math.isfinite(float(v))]
        if finite:
            self.client.log_batch(self.parent_run_id, metrics=finite)

    def end(self) -> None:
        """This sweep measures no more (its runs may stay RUNNING if MLflow is down)."""
        LIVE_HERE.discard(self.parent_run_id or "")

    def finish_sweep(self, status: str, metrics: dict[str, float]) -> None:
        if self.parent_run_id is None:
            return
        self.client.log_batch(self.parent_run_id, metrics=[Metric(k, v, 0, 0) for k, v in metrics.items()])
        self.client.set_terminated(self.parent_run_id, status=status)

    @property
    def mlflow_version(self) -> str:
        """The MLflow this sweep records with (its client's)."""
        return package_version("mlflow")

    def store_label(self) -> str:
        """The store's URI as printed and written in summary.json (views.store_label)."""
        return store_label(self.tracking_uri)

    def open_ui_line(self, port: int = 5000) -> str:
        """The console's line on how to open the UI on this store (views.open_ui_line)."""
        return open_ui_line(self.tracking_uri, port)

    def runs_table_url(self, port: int = 5000) -> str:
        """The UI link that opens the runs table (3.x opens a GenAI overview otherwise)."""
        return runs_table_url(self.experiment_id, port, base=ui_base(self.tracking_uri, port))
