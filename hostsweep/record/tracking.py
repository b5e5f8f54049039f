"""MLflow recording of sweeps: one experiment per study, a parent run per sweep, a child
per cell.

With registry.py (fitted models, calibrations) and readback.py (cells read back), the
only modules that import mlflow. It
uses MlflowClient with explicit run ids, so results can be logged from the driver's
result loop in any order.

What the UI shows: experiments carry a description; a cell run's start and end are its
measurement's (MLflow cannot move a run's start, so the claim run made before measuring
is replaced by one created with the measurement's start time); runs are named for what
varies (`b4-ctx512` under `default: cpu/tiny-llama/eager/tp1`); every link carries
`?workflowType=machine_learning`, without which MLflow 3 opens a GenAI overview
(mlflow/mlflow#24498; nothing on the server side chooses the view).
"""
from __future__ import annotations

import logging
import math
import os
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence

import pandas as pd
from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from hostsweep.measure.results import CellResult, cell_metrics, logged_row, split_tags, stability_tags
from hostsweep.config.redact import error_line, redact
from hostsweep.record import crashpoints
from hostsweep.record.artifacts import earlier_timings_table, linearity_table, timings_table, top_ops_table
from hostsweep.record.dbread import finished_index, is_database, runs_by_id, stored_runs
from hostsweep.record.store import (
    SERVED_SCHEME, local_artifact_root, local_folder, quiet_mlflow, served_artifacts, served_location,
)
from hostsweep.record.views import JOURNAL_TAG, KIND, KIND_TAG, NOTE_TAG, cell_note, cell_run_name, runs_table_url, ui_base
from hostsweep.record.claims import (
    CLAIMS_TAG, HEARTBEAT_TAG, KILLED_REASON_TAG, LIVE_HERE, OWNER_TAG, PARENT_TAG, RunView, claim_batches,
    claim_winner, parse_claims, stale_reason, this_owner,
)

log = logging.getLogger(__name__)


# Each MLflow HTTP call fails within seconds instead of retrying for ~4 min (MLflow's
# defaults: 7 retries, backoff factor 2, 120 s timeout); the uploader does the waiting.
# MLflow's own "View run at <uri>" lines would print the URI, credentials and all.
CLIENT_ENV = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
}
RUNNING = "attributes.status = 'RUNNING'"
# Runs read per search call. Pages are used and dropped one at a time, so reading a
# 10,000-run experiment never holds more than one page of MLflow's run objects (with
# their tags, params and metrics) at once.
SEARCH_PAGE = 1000
# The tags whether a RUNNING run is live depends on (claims.py); a RunView keeps only these
# (and a sweep's batched claims, tags named claims.<n>).
LIVENESS_TAGS = (PARENT_TAG, "cell_key", HEARTBEAT_TAG, OWNER_TAG)
# Cells written to a database store in one transaction (one commit: an fsync on sqlite).
CELLS_PER_TRANSACTION = 25
# Tags one log_batch may carry (MLflow's limit), and a tag value's length.
BATCH_TAGS = 100
TAG_VALUE_LIMIT = 8000
# On a sweep's parent run: how many claimed cells it did not measure, and which.
NOT_MEASURED_TAG, NOT_MEASURED_FILE = "not_measured", "not_measured.txt"


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


def _ms(seconds: float) -> Optional[int]:
    return int(seconds * 1000) if seconds > 0 else None


def prepare_store(tracking_uri: str) -> None:
    """Create the folder of a local sqlite store; MLflow does not."""
    root = local_artifact_root(tracking_uri)
    if root is not None:
        root.parent.mkdir(parents=True, exist_ok=True)


def run_view(run: Any) -> RunView:
    """What liveness needs of an MLflow run, with only the tags it reads (LIVENESS_TAGS)."""
    tags = run.data.tags
    kept = {k: v for k, v in tags.items() if k in LIVENESS_TAGS or k.startswith(CLAIMS_TAG)}
    return RunView(run.info.run_id, run.info.status, kept, run.info.start_time)


@dataclass(frozen=True)
class FinishedRun:
    """A FINISHED cell run, as a resumed sweep weighs it: its id and the metrics it logged
    of those asked about."""

    run_id: str
    metric_keys: frozenset[str]


class SweepTracker:
    """Records one sweep: the parent run, then a child run per cell as it arrives."""

    # Read finished runs of a database store with plain SELECTs (dbread.py), not search_runs.
    direct_reads = True
    # Write a cell's run into a database store in one transaction (dbwrite.py), not the four
    # calls of MLflow's API (a server's clients have only those); tracking.direct_writes.
    direct_writes = True

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

    def finished_runs(self) -> dict[str, list[dict[str, object]]]:
        """FINISHED cell runs of this experiment by cell key, newest first, each as the
        cell-table row it had when measured (report.cell_row's columns). Read a page at a
        time: only the rows are kept, never every run MLflow returns."""
        found: dict[str, list[tuple[int, dict[str, object]]]] = {}
        if self.direct_reads and is_database(self.tracking_uri):
            try:  # a database store: plain SELECTs, a page at a time (dbread.py), ten times faster
                for stored in stored_runs(self.tracking_uri, [self.experiment_id]):
                    for run in stored:
                        if "cell_key" in run.tags:
                            found.setdefault(run.tags["cell_key"], []).append(
                                (run.start_time, logged_row(run.params, run.metrics, run.tags, run.run_id)))
                return self._newest_first(found)
            except Exception as exc:  # noqa: BLE001 - another schema, a driver missing: MLflow's API
                log.debug("reading runs from the database failed (%s); using MLflow's search", exc)
                found = {}
        for page in self._pages("attributes.status = 'FINISHED'"):
            for run in page:
                tags = run.data.tags
                if "cell_key" in tags:
                    found.setdefault(tags["cell_key"], []).append(
                        (run.info.start_time, logged_row(run.data.params, run.data.metrics, tags, run.info.run_id)))
        return self._newest_first(found)

    @staticmethod
    def _newest_first(found: dict[str, list[tuple[int, Any]]]) -> dict[str, list[Any]]:
        # newest first; runs that started together keep MLflow's order (a stable sort)
        return {key: [row for _, row in sorted(runs, key=lambda r: -r[0])] for key, runs in found.items()}

    def finished_cells(self) -> dict[str, dict[str, object]]:
        """The newest FINISHED run of each cell key (what a resumed sweep may skip)."""
        return {key: runs[0] for key, runs in self.finished_runs().items()}

    def finished_index(self, metric_keys: Sequence[str]) -> dict[str, list[FinishedRun]]:
        """FINISHED cell runs of this experiment by cell key, newest first, each with which
        of `metric_keys` it logged: what a resumed sweep decides on. From a database, two
        narrow SELECTs (a few columns per run, no params); elsewhere (a server), the full
        read, whose rows resumed_rows then returns without reading them again."""
        found: dict[str, list[tuple[int, FinishedRun]]] = {}
        if self.direct_reads and is_database(self.tracking_uri):
            try:
                for run_id, start, key, logged in finished_index(self.tracking_uri, self.experiment_id, metric_keys):
                    found.setdefault(key, []).append((start, FinishedRun(run_id, logged)))
                return self._newest_first(found)
            except Exception as exc:  # noqa: BLE001 - another schema, a driver missing: the full read
                log.debug("reading the finished runs' index from the database failed (%s)", exc)
        self._rows_read = {}
        index: dict[str, list[FinishedRun]] = {}
        for key, rows in self.finished_runs().items():
            for row in rows:
                run_id = str(row["mlflow_run_id"])
                self._rows_read[run_id] = row
                index.setdefault(key, []).append(FinishedRun(run_id, frozenset(k for k in metric_keys if k in row)))
        return index

    def resumed_rows(self, run_ids: Sequence[str]) -> list[dict[str, object]]:
        """The cell-table rows (finished_runs' rows) of these FINISHED runs, in their order."""
        if not run_ids:
            return []
        order = {run_id: i for i, run_id in enumerate(run_ids)}
        return sorted(self._rows_of(order), key=lambda row: order[str(row["mlflow_run_id"])])

    def _rows_of(self, wanted: Mapping[str, int]) -> list[dict[str, object]]:
        if self._rows_read:  # finished_index read them all; held no longer than until now
            read, self._rows_read = self._rows_read, {}
            return [row for run_id, row in read.items() if run_id in wanted]
        if self.direct_reads and is_database(self.tracking_uri):
            try:
                return [logged_row(run.params, run.metrics, run.tags, run.run_id)
                        for page in runs_by_id(self.tracking_uri, list(wanted)) for run in page]
            except Exception as exc:  # noqa: BLE001 - as finished_runs: MLflow's search instead
                log.debug("reading runs from the database failed (%s); using MLflow's search", exc)
        return [row for rows in self.finished_runs().values() for row in rows if row["mlflow_run_id"] in wanted]

    def planned_run_id(self, result: CellResult, claim: Optional[str]) -> Optional[str]:
        """The id of the run a measured cell will be written into, chosen now (a database
        store: its cells.csv row names the run from the start, no correction later), None
        where MLflow's API chooses it. Hand it to `plan` with the cell's journal entry."""
        if not self._writer or (claim is not None and not result.started_at):
            return None
        return uuid.uuid4().hex

    def plan(self, entry: str, run_id: Optional[str]) -> None:
        """Journal entry `entry`'s cell goes into `run_id` (planned_run_id) when written."""
        if run_id is not None:
            self._planned.setdefault(entry, run_id)

    def upload(self, result: CellResult, tags: dict[str, str], run_id: Optional[str], entry: str,
               planned_run_id: Optional[str] = None) -> str:
        """Log a journal entry an earlier sweep could not: into the run that claimed it
        unless that run is gone, and only once (the entry id is tagged on the run that has it);
        written straight into a database, into the run id the earlier sweep planned for it."""
        done = [r for r in self._search(f"tags.{JOURNAL_TAG} = '{entry}'") if r.info.status != "RUNNING"]
        if done:
            return done[0].info.run_id
        self.plan(entry, planned_run_id)
        if run_id is not None:
            try:
                run = self.client.get_run(run_id)
            except Exception:  # noqa: BLE001 - not in this store (any more)
                run = None
            if run is None or run.info.lifecycle_stage == "deleted":
                run_id = None
        return self.log_cell(result, {**tags, JOURNAL_TAG: entry}, run_id)

    def _pages(self, filter_string: str) -> Iterator[list]:
        """The experiment's runs matching the filter, one page (SEARCH_PAGE runs) at a time."""
        token = None
        while True:
            page = self.client.search_runs([self.experiment_id], filter_string, max_results=SEARCH_PAGE,
                                           page_token=token)
            token = page.token
            yield page
            if not token:
                return

    def _search(self, filter_string: str) -> list:
        return [run for page in self._pages(filter_string) for run in page]

    def running_runs(self) -> tuple[list[RunView], dict[str, RunView]]:
        """The RUNNING runs of the experiment, and every run they name as parent, by id."""
        views = [run_view(r) for page in self._pages(RUNNING) for r in page]
        known = {v.run_id: v for v in views}
        for parent_id in {v.tags[PARENT_TAG] for v in views if PARENT_TAG in v.tags} - set(known):
            try:
                known[parent_id] = run_view(self.client.get_run(parent_id))
            except Exception:  # noqa: BLE001 - a deleted parent: its children are stale
                pass
        return views, known

    def reap_stale(self, stale_after_s: float) -> list[tuple[str, str]]:
        """Mark KILLED, with the reason as a tag, every RUNNING run whose sweep is gone."""
        views, known = self.running_runs()
        now, reaped = time.time(), []
        for view in views:
            reason = stale_reason(view, known, now, stale_after_s)
            if reason:
                self.client.set_tag(view.run_id, KILLED_REASON_TAG, f"marked KILLED by a later sweep: {reason}")
                self.client.set_terminated(view.run_id, status="KILLED")
                reaped.append((view.run_id, reason))
        return reaped

    def live_claims(self, stale_after_s: float) -> dict[str, list[RunView]]:
        """Claims of live sweeps, by cell key: the cells listed in a live sweep's claims.<n>
        tags (one view per cell, its time the claim's), and RUNNING cell runs of live
        sweeps (a cell being logged, or the claim run of a hostsweep before batched claims)."""
        views, known = self.running_runs()
        now, claims = time.time(), {}
        for view in views:
            if stale_reason(view, known, now, stale_after_s):
                continue
            if "cell_key" in view.tags:
                claims.setdefault(view.tags["cell_key"], []).append(view)
            elif PARENT_TAG not in view.tags:  # a live sweep: its batched claims
                for claimed_at, key in parse_claims(view.tags):
                    claims.setdefault(key, []).append(
                        RunView(view.run_id, "RUNNING", {PARENT_TAG: view.run_id, "cell_key": key}, claimed_at))
        return claims

    def claim(self, cells: Mapping[str, dict[str, object]] | Iterable[tuple[str, dict[str, object]]],
              stale_after_s: float) -> tuple[dict[str, None], dict[str, str]]:
        """Claim each cell (key -> params, or (key, params) pairs) not claimed by another
        live sweep: the keys go on this sweep's parent run as claims.<n> tags, about 150 to
        a tag and 100 tags to a log_batch (10,000 cells: one call), so claiming costs no
        run per cell. Returns (the keys claimed (-> None: no run yet; a cell's run is
        created when it is logged), key -> the other sweep's parent run id)."""
        if self.parent_run_id is None:
            raise RuntimeError("claim() needs the sweep's parent run (start_sweep)")
        taken = self.live_claims(stale_after_s)
        mine: dict[str, None] = {}
        asked = [key for key, _ in (cells.items() if isinstance(cells, Mapping) else cells)]
        for batch in claim_batches((k for k in asked if k not in taken), self.claim_tags, BATCH_TAGS,
                                   TAG_VALUE_LIMIT):
            stamp = int(time.time() * 1000)  # a claim's time is when it is written (claim_winner)
            tags = [RunTag(name, f"{stamp}\n" + "\n".join(batch_keys)) for name, batch_keys in batch]
            self.client.log_batch(self.parent_run_id, tags=tags)
            self.claim_tags += len(tags)
            for _, batch_keys in batch:
                mine.update(dict.fromkeys(batch_keys))
        # Two sweeps may claim one cell at once: every sweep keeps the earliest claim only.
        others: dict[str, str] = {}
        live = self.live_claims(stale_after_s)
        for key in asked:
            claims = live.get(key)
            if not claims:
                continue
            winner = claim_winner(claims)
            if winner.tags.get(PARENT_TAG) != self.parent_run_id:
                others[key] = winner.tags.get(PARENT_TAG, "?")
                mine.pop(key, "")
        return mine, others

    def release(self, keys: Iterable[str], reason: str) -> int:
        """Cells this sweep claimed and will not measure: their count (0 too) and reason on
        the parent run (not_measured, not_measured_reason) and their keys in not_measured.txt;
        its claims end with the parent run."""
        left = list(keys)
        if self.parent_run_id is None:
            return len(left)
        tags = [RunTag(NOT_MEASURED_TAG, str(len(left)))] + ([RunTag(f"{NOT_MEASURED_TAG}_reason", reason[:5000])]
                                                              if left else [])
        self.client.log_batch(self.parent_run_id, tags=tags)
        if left:
            self.client.log_text(self.parent_run_id, "\n".join(left) + "\n", NOT_MEASURED_FILE)
        return len(left)

    def heartbeat(self) -> None:
        if self.parent_run_id is not None:
            self.client.set_tag(self.parent_run_id, HEARTBEAT_TAG, f"{time.time():.0f}")

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

    def log_cell(self, result: CellResult, tags: dict[str, str], run_id: Optional[str] = None) -> str:
        """A cell's child run, terminated with the cell's status; returns its id. A measured
        cell gets a run that starts and ends when its measurement did; others are logged into
        `run_id` (a claim run from a journal written before batched claims; it is deleted
        when a new run replaces it), else a new run. Through MLflow's API (a server): create_run
        with every tag, one log_batch (metrics and params), the artifacts, set_terminated; into
        a database store: the artifacts, then the run in one transaction (dbwrite.py).
        Logging again is harmless: a retried delivery reuses the run it created, until
        `delivered` says the delivery is complete."""
        return self.log_cells([(result, tags, run_id)])[0]

    def cells_per_write(self) -> int:
        """How many cells one log_cells call writes together: CELLS_PER_TRANSACTION into a
        database store (one commit for them all), else 1 (a server takes one run a call)."""
        return CELLS_PER_TRANSACTION if self._direct_writer() else 1

    def log_cells(self, cells: Sequence[tuple[CellResult, dict[str, str], Optional[str]]]) -> list[str]:
        """log_cell for each (result, tags, run_id); into a database store, the new runs of
        them all in one transaction. Their run ids, in order."""
        writer = self._direct_writer()
        ids: list[Optional[str]] = [None] * len(cells)
        planned = []  # (index, run id, the write's arguments, claim)
        try:
            for i, (result, tags, run_id) in enumerate(cells):
                values, run_tags = self._cell_tags(result, tags)
                entry = next((t.value for t in run_tags if t.key == JOURNAL_TAG), None)
                if writer and not (entry in self.logged_into or (run_id is not None and not result.started_at)):
                    new_id, row = self._prepare_write(writer, result, values, run_tags, entry)
                    planned.append((i, new_id, row, entry, run_id))
                    continue
                ids[i] = self._log_through_api(result, values, run_tags, run_id)
            if planned:
                for i, run_id in self._write_directly(writer, planned, cells).items():
                    ids[i] = run_id
        finally:
            for _, new_id, _, _, _ in planned:
                self._repos.pop(new_id, None)
        for i, new_id, _, entry, claim in planned:
            if ids[i] is not None:  # logged through MLflow's API after the direct write failed
                continue
            ids[i] = new_id
            if entry:
                self.logged_into[entry] = new_id
                self._planned.pop(entry, None)
            if claim is not None and claim != new_id:
                self.client.delete_run(claim)  # a claim run of a journal from before batched claims
        return [run_id for run_id in ids if run_id is not None]

    def _write_directly(self, writer: Any, planned: list[tuple[int, str, dict[str, Any], Optional[str], Optional[str]]],
                        cells: Sequence[tuple[CellResult, dict[str, str], Optional[str]]]) -> dict[int, str]:
        """Write the planned runs in one transaction. When that fails while the store answers
        MLflow's API (a database of another MLflow's table layout, a constraint this writer
        does not know), these cells and every later one go through the API instead, with a
        warning; when the store does not answer either, the error goes to the uploader, which
        retries (an outage). Returns the runs logged through the API, by index in `cells`."""
        try:
            writer.write_many([row for _, _, row, _, _ in planned])
            return {}
        except Exception as exc:  # noqa: BLE001 - sqlalchemy's errors, a driver's, a lost connection
            failure = exc
        try:
            written = writer.existing([new_id for _, new_id, _, _, _ in planned])
        except Exception:  # noqa: BLE001 - the store does not answer: an outage, retried as one
            raise failure from None
        if written:  # one transaction: all of them are there (its answer was lost), or none is
            return {}
        self._writer = False
        log.warning("writing cell runs straight into %s failed (%s); MLflow's API logs them from now on "
                    "(tracking.direct_writes=false says so from the start)", redact(self.tracking_uri),
                    error_line(failure))
        logged = {}
        for i, _, _, entry, claim in planned:
            self._planned.pop(entry, None)
            result, tags, _ = cells[i]
            logged[i] = self._log_through_api(result, *self._cell_tags(result, tags), claim)
        return logged

    def _log_through_api(self, result: CellResult, values: dict[str, float], run_tags: list[RunTag],
                         claim: Optional[str]) -> str:
        """A cell's run through MLflow's calls (create_run or the run to reuse, log_batch,
        artifacts, set_terminated); its id."""
        run_id, created = self._cell_run(result, run_tags, claim)
        try:
            return self._log_into(run_id, created, claim, result, values, run_tags)
        finally:
            self._repos.pop(run_id, None)

    def _cell_tags(self, result: CellResult, tags: dict[str, str]) -> tuple[dict[str, float], list[RunTag]]:
        """A cell's metrics and every tag of its run."""
        all_tags = {
            PARENT_TAG: self.parent_run_id or "",
            "cell_key": result.key,
            **result.host,
            **split_tags(result),
            **stability_tags(result),
            "attempt": str(result.attempt),
            **tags,
        }
        if result.retry_reasons:
            all_tags["retry_reasons"] = " | ".join(result.retry_reasons)[:5000]
        values = cell_metrics(result)
        if result.measurement is not None:
            all_tags[NOTE_TAG] = cell_note(result.params, values, all_tags.get("regime"),
                                           all_tags.get("unstable_reasons", ""))
        if result.status == "SKIPPED":
            # MLflow has no SKIPPED status: KILLED (never measured, never resumed as done)
            # with the reason as tags.
            all_tags.update(skipped="true", skip_reason=(result.error or "")[:5000])
        elif result.error:
            all_tags["failure_reason"] = result.error[:5000]
        return values, [RunTag(k, str(v)) for k, v in all_tags.items()]

    def _log_into(self, run_id: str, created: bool, claim: Optional[str], result: CellResult,
                  values: dict[str, float], run_tags: list[RunTag]) -> str:
        metrics = [Metric(k, v, _ms(result.ended_at) or 0, 0) for k, v in values.items() if math.isfinite(v)]
        # a new run has its tags already (create_run); a reused one gets them here
        self.client.log_batch(run_id, metrics=metrics, params=[Param(k, str(v)) for k, v in result.params.items()],
                              tags=[] if created else run_tags)
        crashpoints.reached("uploading")
        if result.measurement is not None:
            self._text(run_id, timings_table(result), "raw_timings.csv")
            if result.earlier_timings:
                self._text(run_id, earlier_timings_table(result), "raw_timings_earlier_attempts.csv")
        self._log_analysis(run_id, result)
        if result.status == "SKIPPED":
            self.client.set_terminated(run_id, status="KILLED")
            return run_id
        if result.error:
            self._text(run_id, result.error, "failure.txt")
        if result.log_tail:
            self._text(run_id, result.log_tail, "worker_log_tail.txt")
        self.client.set_terminated(run_id, status=result.status, end_time=_ms(result.ended_at))
        if claim is not None and claim != run_id:
            self.client.delete_run(claim)  # the placeholder; the cell's run is the one just logged
        return run_id

    def _direct_writer(self) -> Any:
        """The database store's one-transaction writer (dbwrite.py), or False: MLflow's API."""
        if not self.direct_writes:
            return False
        if self._writer is None:
            self._writer = False
            if is_database(self.tracking_uri):
                from hostsweep.record.dbwrite import RunWriter

                try:
                    self._writer = RunWriter.of(self.client, self.experiment_id)
                except Exception as exc:  # noqa: BLE001 - another store or MLflow: the API does it
                    log.debug("writing runs straight to the database is off (%s); using MLflow's API", exc)
        return self._writer

    def _prepare_write(self, writer: Any, result: CellResult, values: dict[str, float], run_tags: list[RunTag],
                       entry: Optional[str]) -> tuple[str, dict[str, Any]]:
        """A new run's id and what RunWriter.write_many writes for it, its artifacts written
        first (into the folder of the run id chosen here; the run is written after them, in
        its final status). A retried delivery keeps the run id (its artifacts' folder), and a
        run already written is not written again."""
        run_id = self._planned.setdefault(entry, uuid.uuid4().hex) if entry else uuid.uuid4().hex
        self._repos[run_id] = writer.artifact_uri(run_id)
        if result.measurement is not None:
            self._text(run_id, timings_table(result), "raw_timings.csv")
            if result.earlier_timings:
                self._text(run_id, earlier_timings_table(result), "raw_timings_earlier_attempts.csv")
        self._log_analysis(run_id, result)
        if result.status != "SKIPPED":
            if result.error:
                self._text(run_id, result.error, "failure.txt")
            if result.log_tail:
                self._text(run_id, result.log_tail, "worker_log_tail.txt")
        crashpoints.reached("uploading")
        now = int(time.time() * 1000)
        row = dict(run_id=run_id, name=cell_run_name(result.params, self.varying),
                   start_ms=_ms(result.started_at) or now, end_ms=_ms(result.ended_at) or now,
                   status="KILLED" if result.status == "SKIPPED" else result.status, tags=run_tags,
                   params=[Param(k, str(v)) for k, v in result.params.items()],
                   metrics=[Metric(k, v, _ms(result.ended_at) or 0, 0) for k, v in values.items() if math.isfinite(v)])
        return run_id, row

    def delivered(self, entry: str) -> None:
        """Journal entry `entry` is logged and recorded as such: its run is not needed for a
        retry any more (a sweep keeps nothing per logged cell)."""
        self.logged_into.pop(entry, None)

    def _cell_run(self, result: CellResult, tags: list[RunTag], claim: Optional[str]) -> tuple[str, bool]:
        """The run to log a cell into, and whether it was created just now with `tags`: the
        one created for it by an earlier try of this delivery, the claim run of an
        unmeasured cell, else a new one (starting at the measurement's start)."""
        entry = next((t.value for t in tags if t.key == JOURNAL_TAG), None)
        if entry in self.logged_into:
            return self.logged_into[entry], False
        if claim is not None and not result.started_at:
            return claim, False
        name = cell_run_name(result.params, self.varying)
        info = self.client.create_run(self.experiment_id, start_time=_ms(result.started_at), run_name=name,
                                      tags={t.key: t.value for t in tags}).info
        if entry:
            self.logged_into[entry] = info.run_id
        self._repos[info.run_id] = info.artifact_uri
        return info.run_id, True

    def _text(self, run_id: str, text: str, artifact_file: str) -> None:
        """client.log_text without its get_run per file (MLflow looks the run up to find
        where its artifacts go): a run created by this tracker names that place already.
        Into a folder on this machine the file is written where it belongs; MLflow's
        repository would write it to a temporary folder and copy it, which cost an instant
        cell more than its database rows."""
        where = self._repos.get(run_id)
        if where is None:
            self.client.log_text(run_id, text, artifact_file)
            return
        if is_database(self.tracking_uri):
            where = served_location(where) or where
        folder, _, name = artifact_file.rpartition("/")
        local = local_folder(where)
        if local is not None:
            destination = local / folder if folder else local
            destination.mkdir(parents=True, exist_ok=True)
            (destination / name).write_text(text, encoding="utf-8")
            return
        from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / name
            path.write_text(text, encoding="utf-8")
            get_artifact_repository(where, tracking_uri=self.tracking_uri).log_artifact(str(path), folder or None)

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

    def _log_analysis(self, run_id: str, result: CellResult) -> None:
        if result.split is not None:
            self._text(run_id, top_ops_table(result), "top_ops.csv")
        if result.linearity is not None:
            self._text(run_id, linearity_table(result), "linearity.csv")
        if result.thread_states is not None:
            self._text(run_id, result.thread_states.to_csv(index=False), "thread_states.csv")
        if result.traces:
            with tempfile.TemporaryDirectory() as folder:
                for name, data in result.traces.items():
                    (Path(folder) / name).write_bytes(data)
                self.client.log_artifacts(run_id, folder, "traces")

    def end(self) -> None:
        """This sweep measures no more (its runs may stay RUNNING if MLflow is down)."""
        LIVE_HERE.discard(self.parent_run_id or "")

    def finish_sweep(self, status: str, metrics: dict[str, float]) -> None:
        if self.parent_run_id is None:
            return
        self.client.log_batch(self.parent_run_id, metrics=[Metric(k, v, 0, 0) for k, v in metrics.items()])
        self.client.set_terminated(self.parent_run_id, status=status)

    def runs_table_url(self, port: int = 5000) -> str:
        """The UI link that opens the runs table (3.x opens a GenAI overview otherwise)."""
        return runs_table_url(self.experiment_id, port, base=ui_base(self.tracking_uri, port))


# Cell metrics read back as columns besides step_ms (absent ones come back as NaN).
