"""Cell runs read back from MLflow as one measured-cell table: what the fit and compare
stages (and `hostsweep-model fit --experiment`) work from, never a sweep's private files."""
from __future__ import annotations

import logging
from typing import Optional

import mlflow
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from hostsweep.config.grid import CELL_PARAMS, INT_PARAMS, LEGACY_AXIS_VALUES
from hostsweep.config.redact import error_line
from hostsweep.measure.stability import recorded_flags
from hostsweep.record.read.dbread import is_database, stored_runs

log = logging.getLogger(__name__)


class FilterRefused(ValueError):
    """MLflow refused a search filter (the first line of its message)."""


CELL_METRICS = ("step_ci_low_ms", "step_ci_high_ms", "host_ms", "device_ms", "host_frac")


def read_cells(tracking_uri: str, experiments: list[str], parent_run_id: Optional[str] = None,
               filter_string: Optional[str] = None) -> pd.DataFrame:
    """Finished cell runs of the given sweep experiments as a measured-cell table (step_ms
    with its 95% CI, host/device split where the cell was split, every other metric the
    cells have, and each cell's run id, name, parent sweep run and start time). Only the
    children of `parent_run_id` when given; `filter_string` is an MLflow search filter.
    A cell measured again by a later sweep (same cell_key) counts once, its newest run:
    a fit must not weigh a re-measured cell twice."""
    runs = direct_runs(tracking_uri, experiments, parent_run_id) if not filter_string else None
    if runs is None:
        mlflow.set_tracking_uri(tracking_uri)
        clauses = [f"tags.mlflow.parentRunId = '{parent_run_id}'"] if parent_run_id else []
        clauses += [filter_string] if filter_string else []
        try:
            runs = mlflow.search_runs(experiment_names=experiments, filter_string=" and ".join(clauses))
        except MlflowException as exc:  # a malformed filter
            raise FilterRefused(error_line(exc)) from None
    if runs.empty or "tags.cell_key" not in runs:
        return pd.DataFrame()
    # cell runs carry a cell_key; a sweep's parent run has list-valued params (batch "[1, 4]")
    cells = runs[runs["tags.cell_key"].notna() & (runs["status"] == "FINISHED")]
    cells = cells.sort_values("start_time", ascending=False).drop_duplicates("tags.cell_key").sort_index()
    nan = pd.Series(float("nan"), index=cells.index)
    frame = pd.DataFrame({
        **cell_params(cells),
        "step_ms": cells["metrics.step_ms"].astype(float),
        **{name: cells.get(f"metrics.{name}", nan).astype(float) for name in CELL_METRICS},
        "cell_key": cells["tags.cell_key"], "run_id": cells["run_id"],
        "run_name": cells.get("tags.mlflow.runName", nan),
        "parent_run_id": cells.get("tags.mlflow.parentRunId", nan),
        "start_time": cells["start_time"],
        # the sweep's stability verdict ("true"/"false", reasons comma separated); runs
        # logged before it have neither tag, and count as stable (measure/unstable.py)
        **flag_columns(cells),
    })
    others = {c[len("metrics."):]: cells[c].astype(float) for c in cells if c.startswith("metrics.")
              and c[len("metrics."):] not in frame}
    # one concat, not one insert per metric: a frame built column by column is fragmented,
    # and every later assign on it warned (PerformanceWarning) into the user's console
    return pd.concat([frame, pd.DataFrame(others, index=frame.index)], axis=1).copy().reset_index(drop=True)


def flag_columns(runs: pd.DataFrame) -> dict[str, pd.Series]:
    """stable, unstable_reasons and group_annotations from the runs' tags, read as this
    version reads them (measure/stability.recorded_flags: machine-only flags of older runs
    move to the annotations)."""
    empty = pd.Series("", index=runs.index)
    triples = [recorded_flags(*values) for values in zip(
        *(runs.get(f"tags.{tag}", empty).fillna("") for tag in ("stable", "unstable_reasons", "group_annotations")))]
    return {name: pd.Series([t[k] for t in triples], index=runs.index, dtype=object)
            for k, name in enumerate(("stable", "unstable_reasons", "group_annotations"))}


def cell_params(runs: pd.DataFrame) -> dict[str, pd.Series]:
    """The runs' CELL_PARAMS (config/grid.py) as columns, integers typed; an axis a run
    logged before it existed takes the value it stood for then, another missing param is NaN."""
    params = {}
    for name in CELL_PARAMS:
        column = runs.get(f"params.{name}", pd.Series(float("nan"), index=runs.index))
        if name in LEGACY_AXIS_VALUES:
            column = column.fillna(LEGACY_AXIS_VALUES[name])
        params[name] = column.astype(int) if name in INT_PARAMS and column.notna().all() else column
    return params


def direct_runs(tracking_uri: str, experiments: list[str], parent_run_id: Optional[str]) -> Optional[pd.DataFrame]:
    """The FINISHED runs of these experiments as mlflow.search_runs's frame (the columns
    read_cells reads), read from a database store with plain SELECTs a page at a time
    (dbread.py: ten times faster than search_runs for thousands of runs); None for a
    server, an unknown experiment or any database error (read_cells then asks MLflow)."""
    if not is_database(tracking_uri):
        return None
    try:
        client = MlflowClient(tracking_uri)
        found = [client.get_experiment_by_name(name) for name in experiments]
        if any(e is None for e in found):
            return None
        rows = []
        for page in stored_runs(tracking_uri, [e.experiment_id for e in found]):
            for run in page:
                if parent_run_id and run.tags.get("mlflow.parentRunId") != parent_run_id:
                    continue
                rows.append({"run_id": run.run_id, "status": run.status, "start_time": run.start_time,
                             **{f"params.{k}": v for k, v in run.params.items()},
                             **{f"metrics.{k}": v for k, v in run.metrics.items()},
                             **{f"tags.{k}": v for k, v in run.tags.items()}})
    except Exception as exc:  # noqa: BLE001 - another schema, a driver missing: MLflow's search
        log.debug("reading runs from the database failed (%s); using MLflow's search", exc)
        return None
    frame = pd.DataFrame(rows)
    if len(frame):
        frame["start_time"] = pd.to_datetime(frame["start_time"], unit="ms", utc=True)
        # search_runs's column order: metrics, params, tags, each by name
        named = sorted(c for c in frame if "." in c and c.split(".")[0] in ("metrics", "params", "tags"))
        frame = frame[["run_id", "status", "start_time",
                       *sorted(named, key=lambda c: (("metrics", "params", "tags").index(c.split(".")[0]), c))]]
    return frame


def experiment_ids(tracking_uri: str) -> dict[str, str]:
    """Every experiment of the store by name (what a selection error lists)."""
    return {e.name: e.experiment_id for e in MlflowClient(tracking_uri).search_experiments()}
