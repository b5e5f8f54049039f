"""The study's runs read back by the sweep that records into it, a page at a time: the
FINISHED cell runs a resumed sweep weighs, and the cell-table rows they were logged with.

Never every run MLflow returns at once. From a database store with plain SELECTs
(dbread.py), ten times faster; elsewhere (a server), through MLflow's search.

ExperimentRuns is the base of SweepTracker (tracking.py); its state is set up there.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional, Sequence

from mlflow.tracking import MlflowClient

from hostsweep.measure.results import logged_row
from hostsweep.record.read.dbread import finished_index, is_database, runs_by_id, stored_runs

log = logging.getLogger(__name__)

# Runs read per search call. Pages are used and dropped one at a time, so reading a
# 10,000-run experiment never holds more than one page of MLflow's run objects (with
# their tags, params and metrics) at once.
SEARCH_PAGE = 1000


@dataclass(frozen=True)
class FinishedRun:
    """A FINISHED cell run, as a resumed sweep weighs it: its id and the metrics it logged
    of those asked about."""

    run_id: str
    metric_keys: frozenset[str]


class ExperimentRuns:
    """The runs of one experiment, read back: what every part of the tracker searches with,
    and the FINISHED cell runs a resumed sweep skips or reuses."""

    # Read finished runs of a database store with plain SELECTs (dbread.py), not search_runs.
    direct_reads = True
    client: MlflowClient
    tracking_uri: str
    experiment_id: str
    parent_run_id: Optional[str]
    _rows_read: dict[str, dict[str, object]]  # run id -> row, where finished_index read every row

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
