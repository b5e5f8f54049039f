"""The cell table in the Hydra run directory (cells.csv): one row appended per cell."""
from __future__ import annotations

import csv
import logging
import math
import threading
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from hostsweep.config.grid import Cell
from hostsweep.config.redact import error_line

log = logging.getLogger(__name__)

# Run-id corrections wait until they are this share of the rows (or the table is read), so
# a sweep rewrites the file O(log n) times instead of once per cell.
REWRITE_SHARE = 0.1
REWRITE_MIN = 20


def csv_value(value: object) -> object:
    """A value as pandas' to_csv writes it: missing and NaN empty, the rest unchanged."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return value


@dataclass(frozen=True)
class ResumedRows:
    """The cells earlier runs FINISHED that a resumed sweep skips: their runs are known
    when the sweep is planned, their rows (every param, metric and tag, read from MLflow)
    may come later, while measuring starts (StudyOpening)."""

    run_ids: tuple[str, ...]
    rows: Future[list[dict[str, object]]] = field(default_factory=Future)

    @classmethod
    def of(cls, rows: list[dict[str, object]]) -> "ResumedRows":
        """Rows already read."""
        resumed = cls(tuple(str(row["mlflow_run_id"]) for row in rows))
        resumed.rows.set_result(rows)
        return resumed

    @property
    def count(self) -> int:
        return len(self.run_ids)


class CellTable:
    """The cell table in the run directory; every cell's row is appended (and flushed) as
    soon as it is measured, so none is lost and a 10,000-cell sweep writes O(n), not O(n²).

    A resumed sweep's table holds the whole study: the cells FINISHED by earlier runs
    (`resumed` true, their own MLflow run ids), written in as soon as their rows are read
    and always before the table is read, and the ones measured now. A table an
    earlier sweep left in the same run directory is replaced, never appended to, so each
    cell has one row. A row names the
    MLflow run its cell is written into as soon as it is measured (a database store: the
    run id is chosen then, SweepTracker.planned_run_id), else the run that claimed it, and
    the run the cell was logged into once MLflow has it (`set_run_id`, from the uploader's
    thread): those corrections are applied in batches and always before the table is read
    (`flush`).
    The rows themselves are not kept in memory; only each new cell's key and status are."""

    def __init__(self, path: Path, resumed: ResumedRows | None = None) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.resumed = resumed or ResumedRows.of([])
        self._resumed_written = False
        self.columns: list[str] = []
        self.run_ids: dict[str, str] = {}  # cell key -> run id, for the cells measured now
        self.statuses: dict[str, str] = {}  # cell key -> status, for the cells measured now
        self._pending: dict[str, str] = {}  # run-id corrections not yet in the file
        self.lock = threading.Lock()
        path.unlink(missing_ok=True)  # an earlier sweep's table in this run directory: its cells are in MLflow by now
        self.resumed.rows.add_done_callback(lambda _: self._write_resumed())

    @property
    def resumed_count(self) -> int:
        """Rows of cells earlier runs FINISHED (known from the plan, before their rows are read)."""
        return self.resumed.count

    @property
    def count(self) -> int:
        """Rows measured by this sweep."""
        return len(self.statuses)

    def measured_keys(self) -> set[str]:
        with self.lock:
            return set(self.statuses)

    def failed(self) -> int:
        """Cells of this sweep neither FINISHED nor SKIPPED."""
        with self.lock:
            return sum(status not in ("FINISHED", "SKIPPED") for status in self.statuses.values())

    def append(self, row: dict[str, object]) -> None:
        row = {**row, "resumed": False}
        with self.lock:
            self._take_resumed()
            key = str(row["cell_key"])
            self.run_ids[key], self.statuses[key] = str(row["mlflow_run_id"]), str(row["status"])
            if not self.columns or any(column not in self.columns for column in row):
                self._rewrite(self._read_all_text(), extra=row)
                return
            with self.path.open("a", newline="") as handle:
                csv.writer(handle).writerow([csv_value(row.get(column)) for column in self.columns])

    def set_run_id(self, key: str, run_id: str) -> None:
        """The cell `key` was logged into `run_id`."""
        with self.lock:
            if key not in self.run_ids or self.run_ids[key] == run_id:
                return
            self.run_ids[key] = self._pending[key] = run_id
            if len(self._pending) >= max(REWRITE_MIN, REWRITE_SHARE * len(self.run_ids)):
                self._apply_pending()

    def flush(self) -> None:
        """Write the resumed rows (waiting for them) and the run-id corrections still pending."""
        wait([self.resumed.rows])
        with self.lock:
            self._take_resumed()
            self._apply_pending()

    def study_frame(self, cells: list[Cell]) -> pd.DataFrame:
        """Every row, earlier and new, in grid order (read back from the file, as the summary
        is: a frame, not a list of dicts, which for 10,000 cells is ten times the memory)."""
        self.flush()
        if not self.path.is_file():
            return pd.DataFrame()
        frame = pd.read_csv(self.path)
        order = {cell.key: i for i, cell in enumerate(cells)}
        rank = frame["cell_key"].map(lambda key: order.get(str(key), len(order)))
        return frame.iloc[rank.argsort(kind="stable")].reset_index(drop=True)

    def study_rows(self, cells: list[Cell]) -> list[dict[str, object]]:
        """study_frame as one dict per row."""
        return self.study_frame(cells).to_dict("records")

    def _write_resumed(self) -> None:
        with self.lock:
            self._take_resumed()

    def _take_resumed(self) -> None:
        """Write the resumed rows in once they are read (under the lock; once)."""
        if self._resumed_written or not self.resumed.rows.done():
            return
        self._resumed_written = True
        try:
            rows = self.resumed.rows.result()
        except Exception as exc:  # noqa: BLE001 - they are in MLflow; only this table lacks them
            log.error("cells.csv lacks the %d cell(s) resumed from earlier runs: reading their runs failed: %s",
                      self.resumed_count, error_line(exc))
            return
        if rows:
            self._rewrite(pd.concat([pd.DataFrame([{**row, "resumed": True} for row in rows]), self._read_all_text()],
                                    ignore_index=True))

    def _apply_pending(self) -> None:
        if not self._pending or not self.path.is_file():
            return
        frame = self._read_all_text()
        fixes = frame["cell_key"].map(self._pending).where(frame["resumed"] != "True")
        mask = fixes.notna()
        frame.loc[mask, "mlflow_run_id"] = fixes[mask]
        self._pending.clear()
        self._rewrite(frame)

    def _read_all_text(self) -> pd.DataFrame:
        """The file as written, every value a string (so a rewrite changes nothing else)."""
        if not self.path.is_file():
            return pd.DataFrame()
        return pd.read_csv(self.path, dtype=str, keep_default_na=False)

    def _rewrite(self, frame: pd.DataFrame, extra: dict[str, object] | None = None) -> None:
        if extra is not None:
            frame = pd.concat([frame, pd.DataFrame([{k: csv_value(v) for k, v in extra.items()}])],
                              ignore_index=True)
        self.columns = list(frame.columns)
        temporary = self.path.with_suffix(".tmp")
        frame.to_csv(temporary, index=False)
        temporary.replace(self.path)  # a crash mid-rewrite leaves the old table, never half of one
