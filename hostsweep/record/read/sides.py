"""The two sides of `stage=diff` read back from MLflow: a study (its experiment's FINISHED
cell runs, the newest per cell key, as the fit and compare stages read them) or one sweep
(the children of its parent run), each cell with every param, metric and provenance tag,
and its timed pairs from the run's raw_timings.csv (by engine start; and, measured in paired
rounds, by the round each pair was timed in with its partner's pair).

Naming a side is checked first, for both sides, before any artifact is read: an unknown
study or run is a one-line ConfigError. A paired study (measured with pair.against) holds
both sides in one sweep, told apart by the cell param `side` (a, b): paired_halves splits
its cells into the two.
"""
from __future__ import annotations

import io
import logging
import math
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional, Sequence

import mlflow
import numpy as np
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from hostsweep.config.redact import error_line, redact
from hostsweep.config.schema import ConfigError
from hostsweep.measure.stability import recorded_flags
from hostsweep.record.read.readback import FilterRefused, experiment_ids
from hostsweep.record.store import local_artifact_root

log = logging.getLogger(__name__)

RUN_ID = re.compile(r"[0-9a-f]{32}")
STUDY_PREFIX = "hostsweep-"
PAIR_SIDES = ("a", "b")  # a paired study's sides (param `side`): the study as given, and with pair.against
# Tags kept as columns: provenance and the per-cell stability flag (absent on older cells).
CELL_TAGS = ("vllm_version", "torch_version", "hostsweep_version", "ray_version", "git_sha", "device_name",
             "hostname", "stable", "unstable_reasons", "group_annotations", "cell_key", "mlflow.parentRunId", "mlflow.runName")


@dataclass(frozen=True)
class Located:
    """Where a side's cells are: a study's experiment, or one sweep in it."""

    given: str
    kind: str  # "study" or "sweep"
    experiment: str
    experiment_id: str
    parent_run: Optional[str] = None
    side: str = ""  # one side of a paired study ("a", "b"), "" for all of its cells

    @property
    def label(self) -> str:
        if self.kind == "sweep":
            name = self.parent_run[:8]  # type: ignore[index]
        else:
            name = self.experiment[len(STUDY_PREFIX):] if self.experiment.startswith(STUDY_PREFIX) else self.experiment
        return f"{name}:{self.side}" if self.side else name


@dataclass(frozen=True)
class Side:
    located: Located
    cells: pd.DataFrame  # one row per cell: params, metrics, CELL_TAGS, run_id, start_time
    raw: dict[str, list[np.ndarray]]  # run id -> step_ms of every timed pair, one array per engine start
    # run id -> step_ms / canary_ms of every timed pair with a canary, one array per engine
    # start: the step in units of the machine's speed at that moment (diff.normalize=canary)
    raw_canary: dict[str, list[np.ndarray]] = field(default_factory=dict)
    failed: pd.DataFrame = field(default_factory=pd.DataFrame)  # cells whose newest run FAILED: params, run_id
    # run id -> the pairs that carry a paired round (pair.design=rounds), one row each with the
    # columns of ROUND_COLUMNS (pairs_by_round): the diff matches a side-a pair with its side-b
    # pair by pair_round. Absent for runs without such pairs (older artifacts, start pairs).
    rounds: dict[str, pd.DataFrame] = field(default_factory=dict)

    @property
    def parent_runs(self) -> tuple[str, ...]:
        return tuple(sorted(self.cells["parent_run_id"].dropna().unique()))

    @property
    def raw_missing(self) -> int:
        return int((~self.cells["run_id"].isin(self.raw)).sum())


def check_store(tracking_uri: str) -> None:
    """A sqlite store must exist: opening a missing one would create an empty store."""
    root = local_artifact_root(tracking_uri)
    if root is not None and not Path(tracking_uri[len("sqlite:///"):]).is_file():
        raise ConfigError(f"diff: no MLflow store at {redact(tracking_uri)}; run the sweeps first (stage=sweep)")


def _studies(known: dict[str, str]) -> str:
    names = sorted(n[len(STUDY_PREFIX):] for n in known if n.startswith(STUDY_PREFIX))
    return ", ".join(names) or "none"


def locate(tracking_uri: str, given: Optional[str], key: str) -> Located:
    """A study name (experiment hostsweep-<name>, or any experiment's name) or the run id
    of a sweep's parent run; ConfigError (one line) for anything else."""
    if not given:
        raise ConfigError(f"{key} is required: a study name or a sweep's parent run id "
                          "(python -m hostsweep stage=diff diff.base=STUDY diff.head=STUDY)")
    given = str(given)
    known = experiment_ids(tracking_uri)
    for name in (STUDY_PREFIX + given, given):
        if name in known:
            return Located(given, "study", name, known[name])
    if not RUN_ID.fullmatch(given):
        raise ConfigError(f"{key}={given!r} is neither a study in {redact(tracking_uri)} (studies there: {_studies(known)}) "
                          "nor a run id (32 hex digits)")
    try:
        run = MlflowClient(tracking_uri).get_run(given)
    except MlflowException:
        raise ConfigError(f"{key}={given}: no such run in {redact(tracking_uri)} (and no study of that name; studies "
                          f"there: {_studies(known)})") from None
    tags = run.data.tags
    if "cell_key" in tags:
        raise ConfigError(f"{key}={given} is a cell run ({tags['cell_key']}), not a sweep; give its sweep's parent "
                          f"run {tags.get('mlflow.parentRunId', '?')} or the study")
    names = {v: k for k, v in known.items()}
    return Located(given, "sweep", names.get(run.info.experiment_id, run.info.experiment_id),
                   run.info.experiment_id, given)


def read_side_cells(tracking_uri: str, where: Located, filter_string: Optional[str], key: str) -> pd.DataFrame:
    """The side's FINISHED cell runs, newest per cell key, with every param and metric and
    the CELL_TAGS as columns; ConfigError when there are none."""
    clauses = [f"tags.mlflow.parentRunId = '{where.parent_run}'"] if where.parent_run else []
    clauses += [filter_string] if filter_string else []
    mlflow.set_tracking_uri(tracking_uri)
    try:
        runs = mlflow.search_runs(experiment_ids=[where.experiment_id], filter_string=" and ".join(clauses))
    except MlflowException as exc:
        raise FilterRefused(error_line(exc)) from None
    failed = pd.DataFrame()
    if not runs.empty and "tags.cell_key" in runs:
        failed = _failed(runs)
        runs = runs[runs["tags.cell_key"].notna() & (runs["status"] == "FINISHED")]
    if runs.empty or "tags.cell_key" not in runs:
        scope = f"sweep {where.parent_run}" if where.parent_run else f"experiment {where.experiment!r}"
        raise ConfigError(f"{key}={where.given}: no FINISHED cell runs in {scope} of {redact(tracking_uri)}"
                          + (f" matching diff.filter={filter_string!r}" if filter_string else ""))
    runs = runs.sort_values("start_time", ascending=False).drop_duplicates("tags.cell_key")
    # built in one go: a column added at a time fragments a frame of a hundred metrics
    frame = pd.DataFrame({
        **{c[len("params."):]: runs[c] for c in runs if c.startswith("params.")},
        **{c[len("metrics."):]: runs[c].astype(float) for c in runs if c.startswith("metrics.")},
        **{tag: runs.get(f"tags.{tag}", pd.Series(None, index=runs.index, dtype=object)) for tag in CELL_TAGS},
    })
    for other in ("params.stable", "metrics.stable"):  # the flag as a tag, else a param or a metric
        if other in runs:
            frame["stable"] = frame["stable"].where(frame["stable"].notna(), runs[other])
    # machine-only flags of older runs move to the annotations (measure/stability.recorded_flags);
    # a verdict only the moved flags made "false" reads "true", any other stays as recorded
    triples = [recorded_flags(str(stable).lower(), reasons, annotations) for stable, reasons, annotations
               in zip(frame["stable"], frame["unstable_reasons"], frame["group_annotations"])]
    frame["stable"] = [t[0] if t[0] == "true" and str(old).lower() == "false" else old
                       for t, old in zip(triples, frame["stable"])]
    frame["unstable_reasons"] = [t[1] if isinstance(old, str) else old for t, old in zip(triples, frame["unstable_reasons"])]
    frame["group_annotations"] = [t[2] or None for t in triples]
    frame = frame.rename(columns={"mlflow.parentRunId": "parent_run_id", "mlflow.runName": "run_name"})
    frame["run_id"], frame["start_time"] = runs["run_id"], runs["start_time"]
    frame = frame.reset_index(drop=True)
    frame.attrs["failed"] = failed  # read by with_pairs: a gate fails on them
    return frame


def _side_values(frame: pd.DataFrame) -> pd.Series:
    if "side" not in frame:
        return pd.Series([""] * len(frame), index=frame.index, dtype=object)
    return frame["side"].map(lambda v: "" if v is None or (isinstance(v, float) and math.isnan(v)) else str(v))


def sides_held(cells: pd.DataFrame) -> tuple[str, ...]:
    """The paired-study sides (a, b) the cells hold, in order; () for an unpaired study."""
    held = set(_side_values(cells))
    return tuple(s for s in PAIR_SIDES if s in held)


def paired_halves(where: Located, cells: pd.DataFrame) -> Optional[tuple[tuple[Located, pd.DataFrame], ...]]:
    """read_side_cells' frame of a paired study split into side a (the base) and side b (the
    head), each with its own FAILED runs and named `<label>:a`, `<label>:b`; None unless the
    cells hold both sides. Cells of the study measured unpaired (no side) are left out. Both
    halves keep the param pair_against (side b's overrides, the same on both sides), which the
    diff matches on, so sweeps of one study against different overrides are not mixed."""
    if sides_held(cells) != PAIR_SIDES:
        return None
    failed = cells.attrs.get("failed", pd.DataFrame())
    halves = []
    for name in PAIR_SIDES:
        part = cells[_side_values(cells) == name].reset_index(drop=True)
        part.attrs["failed"] = failed[_side_values(failed) == name].reset_index(drop=True) if len(failed) else failed
        halves.append((replace(where, side=name), part))
    left = int((~_side_values(cells).isin(PAIR_SIDES)).sum())
    if left:
        log.warning("%s: %d cell(s) measured unpaired (no side) are left out of the paired diff", where.given, left)
    return tuple(halves)


def _failed(runs: pd.DataFrame) -> pd.DataFrame:
    """Cell runs that FAILED with no FINISHED run of their cell key: their params and run id."""
    cells = runs[runs["tags.cell_key"].notna()]
    done = set(cells.loc[cells["status"] == "FINISHED", "tags.cell_key"])
    lost = cells[(cells["status"] == "FAILED") & ~cells["tags.cell_key"].isin(done)]
    lost = lost.sort_values("start_time", ascending=False).drop_duplicates("tags.cell_key")
    frame = pd.DataFrame({c[len("params."):]: lost[c] for c in lost if c.startswith("params.")})
    frame["run_id"] = lost["run_id"]
    return frame.reset_index(drop=True)


def timed_pairs(run_id: str) -> Optional[pd.DataFrame]:
    """A cell run's raw_timings.csv (every timed pair); None when it has none. pair_round is read
    as text, so an id that looks like a number is not turned into another string (1 -> 1.0)."""
    try:
        return pd.read_csv(io.StringIO(mlflow.artifacts.load_text(f"runs:/{run_id}/raw_timings.csv")),
                           dtype={"pair_round": str})
    except Exception:  # noqa: BLE001 - an old or foreign run without the artifact
        return None


def pairs_by_start(table: pd.DataFrame) -> Optional[list[np.ndarray]]:
    """A raw_timings table's step_ms grouped by engine start, in start order."""
    if "step_ms" not in table or table["step_ms"].dropna().empty:
        return None
    table = table[table["step_ms"].notna()]
    if "replicate" not in table or table["replicate"].isna().all():
        return [table["step_ms"].to_numpy(dtype=float)]
    return [g["step_ms"].to_numpy(dtype=float) for _, g in table.groupby(table["replicate"].fillna(0), sort=True)]


def pairs_per_canary(table: pd.DataFrame) -> Optional[list[np.ndarray]]:
    """A raw_timings table's step_ms / canary_ms per pair, grouped by engine start like
    pairs_by_start; None when its pairs carry no canary."""
    if "canary_ms" not in table or "step_ms" not in table:
        return None
    canary = pd.to_numeric(table["canary_ms"], errors="coerce")
    keep = table[(canary > 0) & table["step_ms"].notna()].assign(step_ms=lambda t: t["step_ms"] / canary)
    return pairs_by_start(keep) if len(keep) else None


# The columns of a run's paired-round pairs (pairs_by_round): the round's id, shared by the pair
# of the partner cell timed back to back with it; the pair's step and canary (nan: none); and
# where the round ran (engine start, period, round index), which the pairs of every cell of a
# group timed in that round share.
ROUND_COLUMNS = ("pair_round", "step_ms", "canary_ms", "replicate", "period", "round")


def _round_id(value: object) -> str:
    """A pair_round cell as its id; "" when empty (a pair not timed in paired rounds)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value).strip()


def pairs_by_round(table: pd.DataFrame) -> Optional[pd.DataFrame]:
    """A raw_timings table's pairs that carry a paired round (pair.design=rounds), with the
    columns of ROUND_COLUMNS, in the order they ran; None when none does (artifacts written
    before the column, start pairs, sequential studies: those read as before)."""
    if "pair_round" not in table or "step_ms" not in table:
        return None
    ids = table["pair_round"].map(_round_id)
    keep = (ids != "").to_numpy()
    if not keep.any():
        return None
    number = lambda name: (pd.to_numeric(table[name], errors="coerce") if name in table  # noqa: E731
                           else pd.Series(math.nan, index=table.index)).to_numpy(dtype=float)[keep]
    return pd.DataFrame({"pair_round": ids[keep].to_numpy(dtype=object),
                         **{name: number(name) for name in ROUND_COLUMNS[1:]}})


def period_spread(steps: Sequence[float], periods: Sequence[int]) -> tuple[float, float]:
    """(variance, df) of the log medians of one cell's periods (the group timed again later
    in the same engine start): nan, 0 with fewer than two periods."""
    table: dict[int, list[float]] = {}
    for step, period in zip(steps, periods):
        if math.isfinite(step) and step > 0:
            table.setdefault(int(period), []).append(step)
    logs = [math.log(float(np.median(v))) for v in table.values()]
    return (float(np.var(logs, ddof=1)), len(logs) - 1.0) if len(logs) > 1 else (math.nan, 0.0)


def with_pairs(where: Located, cells: pd.DataFrame, key: str) -> Side:
    """The side with its cells' timed pairs (read_side_cells' frame, then each run's artifact)."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # a bar per cell on stderr otherwise
    tables = {run_id: table for run_id in cells["run_id"] if (table := timed_pairs(run_id)) is not None}
    raw = {run_id: groups for run_id, table in tables.items() if (groups := pairs_by_start(table)) is not None}
    per_canary = {run_id: groups for run_id, table in tables.items()
                  if (groups := pairs_per_canary(table)) is not None}
    by_round = {run_id: pairs for run_id, table in tables.items() if (pairs := pairs_by_round(table)) is not None}
    spreads = {run_id: period_spread(*((t["step_ms"], t["period"]) if "period" in t else ([], [])))
               for run_id, t in tables.items()}
    cells = cells.assign(period_var=[spreads.get(r, (math.nan, 0.0))[0] for r in cells["run_id"]],
                         period_df=[spreads.get(r, (math.nan, 0.0))[1] for r in cells["run_id"]])
    log.info("%s=%s: %d cells from %s, %d with raw timed pairs, %d timed in paired rounds", key, where.given,
             len(cells), where.experiment, len(raw), len(by_round))
    return Side(where, cells, raw, raw_canary=per_canary, failed=cells.attrs.get("failed", pd.DataFrame()),
                rounds=by_round)
