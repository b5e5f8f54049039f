"""The cell table in the Hydra run directory (cells.csv), rewritten after every cell."""
from __future__ import annotations

import threading
from pathlib import Path

import pandas as pd

from hostsweep.config.grid import Cell


class CellTable:
    """The cell table in the run directory, rewritten after every cell so none is lost.

    A resumed sweep's table holds the whole study: the cells FINISHED by earlier runs
    (`resumed` true, their own MLflow run ids) and the ones measured now (`rows`). A row
    names the MLflow run that claimed its cell as soon as it is measured, and the run the
    cell was logged into once MLflow has it (`set_run_id`, from the uploader's thread)."""

    def __init__(self, path: Path, resumed: list[dict[str, object]] | None = None) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.resumed = [{**row, "resumed": True} for row in resumed or []]
        self.rows: list[dict[str, object]] = []
        self.lock = threading.Lock()
        self._write()

    def append(self, row: dict[str, object]) -> None:
        with self.lock:
            self.rows.append({**row, "resumed": False})
            self._write()

    def set_run_id(self, key: str, run_id: str) -> None:
        """The cell `key` was logged into `run_id`."""
        with self.lock:
            for row in self.rows:
                if row["cell_key"] == key and row["mlflow_run_id"] != run_id:
                    row["mlflow_run_id"] = run_id
                    self._write()

    def study_rows(self, cells: list[Cell]) -> list[dict[str, object]]:
        """Every row, earlier and new, in grid order."""
        order = {cell.key: i for i, cell in enumerate(cells)}
        with self.lock:
            rows = self.resumed + self.rows
        return sorted(rows, key=lambda row: order.get(str(row["cell_key"]), len(order)))

    def _write(self) -> None:
        if self.resumed or self.rows:
            pd.DataFrame(self.resumed + self.rows).to_csv(self.path, index=False)
