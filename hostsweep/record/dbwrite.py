"""A cell's MLflow run written into a database store in one transaction.

Through MLflow's API a cell is four calls (create_run, log_batch, the artifacts,
set_terminated), and MLflow's SQL store makes each its own session and commit: a
log_batch alone opens one for params, metrics and tags, each reading the run again. On
sqlite every commit is an fsync. This writes the same rows with MLflow's own table models
(mlflow.store.tracking.dbmodels, their tables' columns) in one transaction, the run already
in its final status: the run, its tags (mlflow.runName included, as create_run adds it),
params, metrics and latest metrics, after MLflow's own validation of the batch
(mlflow.utils.validation). A run is
never seen half logged: it is there, FINISHED (or FAILED, KILLED), or it is not. write_many
writes the runs of several cells in one transaction (on sqlite, one fsync for them all).

Only for the stores MLflow's client opens as a SqlAlchemyStore (sqlite, PostgreSQL, MySQL
URIs); a server's clients go through its REST API. Anything unexpected when the writer is
made (another store class, models missing) leaves the tracker on MLflow's API
(cellruns.py); a write that fails is retried by the uploader like any refused call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from mlflow.entities import Metric, Param, RunTag
from sqlalchemy import insert, select
from mlflow.store.tracking.dbmodels.models import SqlLatestMetric, SqlMetric, SqlParam, SqlRun, SqlTag
from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
from mlflow.utils.mlflow_tags import MLFLOW_RUN_NAME, MLFLOW_USER
from mlflow.utils.uri import append_to_uri_path
from mlflow.utils.validation import _validate_batch_log_data, _validate_batch_log_limits, _validate_param_keys_unique

ARTIFACTS_FOLDER = SqlAlchemyStore.ARTIFACTS_FOLDER_NAME


@dataclass
class RunWriter:
    store: SqlAlchemyStore
    experiment_id: str
    artifact_location: str

    @classmethod
    def of(cls, client: Any, experiment_id: str) -> "RunWriter":
        """The writer for `client`'s store; raises when it is not a SqlAlchemyStore."""
        store = client._tracking_client.store  # noqa: SLF001 - the store MLflow opened for this URI
        if not isinstance(store, SqlAlchemyStore):
            raise TypeError(f"{type(store).__name__} is not MLflow's SQL store")
        return cls(store, experiment_id, client.get_experiment(experiment_id).artifact_location)

    def artifact_uri(self, run_id: str) -> str:
        """Where run `run_id`'s artifacts go (what create_run would give it)."""
        return append_to_uri_path(self.artifact_location, run_id, ARTIFACTS_FOLDER)

    def write(self, run_id: str, name: str, start_ms: int, end_ms: int, status: str, tags: Sequence[RunTag],
              params: Sequence[Param], metrics: Sequence[Metric]) -> None:
        """Run `run_id` with everything, in `status`, in one transaction; nothing if it exists."""
        self.write_many([dict(run_id=run_id, name=name, start_ms=start_ms, end_ms=end_ms, status=status, tags=tags,
                              params=params, metrics=metrics)])

    def write_many(self, runs: Sequence[dict[str, Any]]) -> None:
        """Several runs (write's arguments each) in one transaction; those that exist already
        (written by an earlier try whose answer was lost) are left as they are."""
        rows: dict[type, list[dict[str, Any]]] = {SqlRun: [], SqlTag: [], SqlParam: [], SqlMetric: [],
                                                   SqlLatestMetric: []}
        for run in runs:
            self._rows(rows, **run)
        ids = [row["run_uuid"] for row in rows[SqlRun]]
        # plain INSERTs of MLflow's tables (its ORM's unit of work cost twice the commit here)
        with self.store.ManagedSessionMaker(read_only=False) as session:
            there = set(session.scalars(select(SqlRun.run_uuid).where(SqlRun.run_uuid.in_(ids))))
            for model, values in rows.items():
                values = [v for v in values if v["run_uuid"] not in there]
                if values:
                    session.execute(insert(model.__table__), values)

    def existing(self, run_ids: Sequence[str]) -> set[str]:
        """Which of these runs are in the store (a write whose answer was lost wrote them)."""
        with self.store.ManagedSessionMaker() as session:
            return set(session.scalars(select(SqlRun.run_uuid).where(SqlRun.run_uuid.in_(list(run_ids)))))

    def _rows(self, rows: dict[type, list[dict[str, Any]]], run_id: str, name: str, start_ms: int, end_ms: int,
              status: str, tags: Sequence[RunTag], params: Sequence[Param], metrics: Sequence[Metric]) -> None:
        tags = [t for t in tags if t.key != MLFLOW_RUN_NAME] + [RunTag(MLFLOW_RUN_NAME, name)]
        metrics, params, tags = _validate_batch_log_data(list(metrics), list(params), tags)
        _validate_batch_log_limits(metrics, params, tags)
        _validate_param_keys_unique(params)
        user = next((t.value for t in tags if t.key == MLFLOW_USER), "unknown")
        latest: dict[str, Metric] = {}
        for m in metrics:  # what MLflow keeps as a key's latest value: the largest (step, timestamp, value)
            if m.key not in latest or (m.step, m.timestamp, m.value) > (latest[m.key].step, latest[m.key].timestamp,
                                                                        latest[m.key].value):
                latest[m.key] = m
        rows[SqlRun].append(dict(run_uuid=run_id, name=name, artifact_uri=self.artifact_uri(run_id),
                                 experiment_id=self.experiment_id, source_type="UNKNOWN", source_name="",
                                 entry_point_name="", user_id=user, status=status, start_time=start_ms,
                                 end_time=end_ms, deleted_time=None, source_version="", lifecycle_stage="active"))
        rows[SqlTag] += [{"run_uuid": run_id, "key": t.key, "value": t.value} for t in tags]
        rows[SqlParam] += [{"run_uuid": run_id, "key": p.key, "value": p.value} for p in params]
        rows[SqlMetric] += [self._metric(run_id, m) for m in dict.fromkeys(metrics)]
        rows[SqlLatestMetric] += [self._metric(run_id, m) for m in latest.values()]

    def _metric(self, run_id: str, metric: Metric) -> dict[str, Any]:
        is_nan, value = self.store.sanitize_metric_value(metric.value)
        return {"run_uuid": run_id, "key": metric.key, "value": value, "timestamp": metric.timestamp,
                "step": metric.step, "is_nan": is_nan}
