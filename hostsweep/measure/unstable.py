"""Which cells the fit, H(N) and the comparison leave out: those the sweep flagged unstable
(pure).

Every measured cell carries `stable` ("true"/"false") and `unstable_reasons` (comma
separated: foreign_cpu, ci_width, drift, period, ...; empty when stable), as MLflow tags
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
from hostsweep.measure.stability import ANNOTATIONS

UNSTABLE_VALUES = {"false", "0", "no"}
IDENTITY = (*CELL_AXES, "run_id")  # how a left-out cell is named (config/grid.py, then its MLflow run)
# What the whole group met, not the cell (measure/stability.ANNOTATIONS: machine_speed,
# group_trend, replicate). Cells recorded today carry them apart from their reasons; cells
# recorded before the annotations existed were marked unstable for machine_speed or
# replicate alone, and a frame not read through record/read keeps that: they are kept here
# too. On a cloud VM the machine moves on nearly every group (by tens of percent between
# minutes); the cell's own pairs, its CI and its drift against its companions still judge
# its number, and the report's host-speed table shows how fast each group's machine was.
MACHINE_ONLY = frozenset(ANNOTATIONS)


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


def left_out_mask(cells: pd.DataFrame) -> np.ndarray:
    """True for each cell the fit leaves out: flagged unstable for a reason about its own
    number. A cell flagged only for the machine (MACHINE_ONLY) is kept: its pairs agree
    with themselves, and the machine's speed per group is reported beside the fit."""
    unstable = unstable_mask(cells)
    machine_only = np.array([bool(r) and set(r) <= MACHINE_ONLY for r in reasons_of(cells)], bool)
    return unstable & ~machine_only


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
    machine_only: int = 0  # of them, flagged only for the machine (MACHINE_ONLY) and kept

    @property
    def count(self) -> int:
        return len(self.left_out)

    def reasons(self) -> dict[str, int]:
        counts: Counter[str] = Counter()
        for text in self.left_out.get("unstable_reasons", pd.Series(dtype=str)):
            # what left the cell out: a machine-only flag it also carries did not
            parts = [r for r in text.split(",") if r and r not in MACHINE_ONLY] if isinstance(text, str) else []
            counts.update(parts or ["unstated"])
        return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))

    def describe(self) -> str:
        """One line: how many cells were left out and why (or kept, and that they were)."""
        if not self.enabled:
            return (f"fit.exclude_unstable=false: {self.flagged} of {self.total} cells flagged unstable, "
                    "fitted anyway" if self.flagged else f"no cell of {self.total} is flagged unstable")
        kept = (f"; kept {self.machine_only} flagged only for the machine ({'/'.join(sorted(MACHINE_ONLY))}: "
                "the machine moved, their pairs agree)"
                if self.machine_only else "")
        if not self.count:
            return (f"no cell of {self.total} is left out as unstable: all fitted{kept}" if self.machine_only
                    else f"no cell of {self.total} is flagged unstable: all fitted")
        why = ", ".join(f"{reason}: {n}" for reason, n in self.reasons().items())
        return (f"left out {self.count} of {self.total} cells as unstable ({why}){kept}; "
                "fit.exclude_unstable=false fits them anyway")

    def to_dict(self) -> dict[str, Any]:
        cells = self.left_out.astype(object).where(self.left_out.notna(), None).to_dict(orient="records")
        return {"enabled": self.enabled, "total": self.total, "flagged": self.flagged, "left_out": self.count,
                "kept_machine_only": self.machine_only,
                "reasons": self.reasons(), "summary": self.describe(), "cells": cells}


def exclude_unstable(cells: pd.DataFrame, enabled: bool = True) -> tuple[pd.DataFrame, Exclusion]:
    """(the cells to fit, with their index, and what was left out): when `enabled`, the
    unstable ones go, except those flagged only for the machine (left_out_mask)."""
    unstable, leave = unstable_mask(cells), left_out_mask(cells)
    if not enabled:
        return cells, Exclusion(len(cells), _named(cells, leave).iloc[0:0], False, int(unstable.sum()))
    return cells[~leave], Exclusion(len(cells), _named(cells, leave), True, int(unstable.sum()),
                                    int((unstable & ~leave).sum()))


def _named(cells: pd.DataFrame, mask: np.ndarray) -> pd.DataFrame:
    """The masked cells' identity (IDENTITY) and their unstable reasons."""
    reasons = [",".join(r) for r, pick in zip(reasons_of(cells), mask) if pick]
    return cells.loc[mask, [c for c in IDENTITY if c in cells]].assign(unstable_reasons=reasons).reset_index(drop=True)
