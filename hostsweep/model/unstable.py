"""Which cells the fit, H(N) and the comparison leave out: those the sweep flagged unstable
(pure).

Every measured cell carries `stable` ("true"/"false") and `unstable_reasons` (comma
separated: foreign_cpu, ci_width, drift, replicate, ...; empty when stable), as MLflow tags
read back into the cell table and as cells.csv columns. Cells of runs older than the
stability verdict have neither: a missing or empty `stable` counts as stable, so an old
study fits as it always did. `Exclusion` records what was left out and why, for the
console, fit.json and the comparison report.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from hostsweep.config.grid import CELL_AXES

UNSTABLE_VALUES = {"false", "0", "no"}
IDENTITY = (*CELL_AXES, "run_id")  # how a left-out cell is named (config/grid.py, then its MLflow run)


def _unstable(value: Any) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return not bool(value)
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return False
    return str(value).strip().lower() in UNSTABLE_VALUES


def unstable_mask(cells: pd.DataFrame) -> np.ndarray:
    """True for each cell flagged unstable; cells without a verdict are stable."""
    if "stable" not in cells:
        return np.zeros(len(cells), bool)
    return np.array([_unstable(v) for v in cells["stable"]], bool)


def reasons_of(cells: pd.DataFrame) -> list[list[str]]:
    """Each cell's unstable reasons as a list (empty when none are recorded)."""
    if "unstable_reasons" not in cells:
        return [[] for _ in range(len(cells))]
    return [[r.strip() for r in str(v).split(",") if r.strip()] if isinstance(v, str) else []
            for v in cells["unstable_reasons"]]


@dataclass(frozen=True)
class Exclusion:
    """The unstable cells a stage left out of `total`, counted per reason."""

    total: int
    left_out: pd.DataFrame = field(default_factory=pd.DataFrame)  # the cells' identity and reasons
    enabled: bool = True  # fit.exclude_unstable
    flagged: int = 0  # unstable cells in the selection, left out or not

    @property
    def count(self) -> int:
        return len(self.left_out)

    def reasons(self) -> dict[str, int]:
        counts: Counter[str] = Counter()
        for text in self.left_out.get("unstable_reasons", pd.Series(dtype=str)):
            parts = [r for r in text.split(",") if r] if isinstance(text, str) else []
            counts.update(parts or ["unstated"])
        return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))

    def describe(self) -> str:
        """One line: how many cells were left out and why (or kept, and that they were)."""
        if not self.enabled:
            return (f"fit.exclude_unstable=false: {self.flagged} of {self.total} cells flagged unstable, "
                    "fitted anyway" if self.flagged else f"no cell of {self.total} is flagged unstable")
        if not self.count:
            return f"no cell of {self.total} is flagged unstable: all fitted"
        why = ", ".join(f"{reason}: {n}" for reason, n in self.reasons().items())
        return (f"left out {self.count} of {self.total} cells as unstable ({why}); "
                "fit.exclude_unstable=false fits them anyway")

    def to_dict(self) -> dict[str, Any]:
        cells = self.left_out.astype(object).where(self.left_out.notna(), None).to_dict(orient="records")
        return {"enabled": self.enabled, "total": self.total, "flagged": self.flagged, "left_out": self.count,
                "reasons": self.reasons(), "summary": self.describe(), "cells": cells}


def exclude_unstable(cells: pd.DataFrame, enabled: bool = True) -> tuple[pd.DataFrame, Exclusion]:
    """(the cells to fit, with their index, and what was left out): the unstable ones go
    when `enabled`."""
    unstable = unstable_mask(cells)
    reasons = [",".join(r) for r in reasons_of(cells)]
    columns = [c for c in IDENTITY if c in cells]
    flagged = cells.loc[unstable, columns].assign(
        unstable_reasons=[r for r, bad in zip(reasons, unstable) if bad]).reset_index(drop=True)
    if not enabled:
        return cells, Exclusion(len(cells), flagged.iloc[0:0], False, int(unstable.sum()))
    return cells[~unstable], Exclusion(len(cells), flagged, True, int(unstable.sum()))
