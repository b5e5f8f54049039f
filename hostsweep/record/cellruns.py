"""Each measured cell written as a child run of the sweep's parent run, through MLflow's API
or, into a database store, in one transaction.

Through the API: create_run with every tag, one log_batch, the artifacts, set_terminated
(all a server's clients have). Into a database store: the artifacts, then the run in its
final status, many cells to a transaction (dbwrite.py). A retried delivery reuses the run
it created, and a journal entry an earlier sweep could not log is logged once, into the
run that claimed it when that run is still there.

CellRuns is a base of SweepTracker (tracking.py); its state is set up there.
"""
from __future__ import annotations

import logging
import math
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Optional, Sequence

from mlflow.entities import Metric, Param, RunTag

from hostsweep.config.redact import error_line, redact
from hostsweep.measure.results import CellResult, cell_metrics, split_tags, stability_tags
from hostsweep.record import crashpoints
from hostsweep.record.artifacts import earlier_timings_table, linearity_table, timings_table, top_ops_table
from hostsweep.record.claims import PARENT_TAG
from hostsweep.record.read.dbread import is_database
from hostsweep.record.experimentruns import ExperimentRuns
from hostsweep.record.store import local_folder, served_location
from hostsweep.record.views import JOURNAL_TAG, NOTE_TAG, cell_note, cell_run_name

log = logging.getLogger(__name__)

# Cells written to a database store in one transaction (one commit: an fsync on sqlite).
CELLS_PER_TRANSACTION = 25


def _ms(seconds: float) -> Optional[int]:
    return int(seconds * 1000) if seconds > 0 else None


class CellRuns(ExperimentRuns):
    """Logs the sweep's cells, each into its own child run of the parent run."""

    # Write a cell's run into a database store in one transaction (dbwrite.py), not the four
    # calls of MLflow's API (a server's clients have only those); tracking.direct_writes.
    direct_writes = True
    varying: Optional[tuple[str, ...]]  # the axes cell run names show
    # journal entry -> the run a cell's measurement is being logged into (a retried
    # delivery reuses it instead of creating another), until `delivered`
    logged_into: dict[str, str]
    _planned: dict[str, str]  # journal entry -> the run id a direct write uses, until written
    _repos: dict[str, str]  # run id -> its artifact URI, while its cell is logged
    _writer: Any  # a database store's writer (dbwrite.py), made at the first cell; False: none

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
