"""One quantity of one matched cell compared (Compared), and the reading of a cell row's
numbers and sides every design shares (pure)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from hostsweep.compare.match import text
from hostsweep.compare.options import SIDES

@dataclass(frozen=True)
class Compared:
    """One quantity of one matched cell: the ratio, and on log scale its difference d,
    standard error se and df (nan: no test, point only)."""

    ratio: float
    source: str
    d: float = math.nan
    se: float = math.nan
    df: float = math.nan
    between: str = ""  # the between-start component each one-start side was widened by
    starts: tuple[int, int] = (0, 0)
    design: str = "sequential"  # or "paired" (DESIGNS)
    d_starts: tuple[float, ...] = ()  # a paired cell's log ratio in each start pair
    # Paired rounds: the CI and p-values come from the rounds' order statistics and sign tests,
    # not from d, se, df (se and df stay nan): carried as they are, never turned into a t.
    log_ci: tuple[float, float] = (math.nan, math.nan)  # the CI of d (log scale)
    coverage: float = math.nan  # the CI's exact coverage (order statistics)
    p: tuple[float, float, float] = (math.nan, math.nan, math.nan)  # p_slower, p_faster, p_same
    rounds: int = 0  # matched rounds the cell is judged over
    d_rounds: tuple[tuple[str, float], ...] = ()  # (shared round, d_r) per matched round
    # Why the cell gets no verdict but inconclusive whatever its numbers say (NO_BETWEEN): its
    # ratio is shown, its CI and p-values are not, since no interval it could print would hold.
    note: str = ""
    between_var: float = 0.0  # the between-start variance the sides were widened by (log scale, summed)

    @property
    def test(self) -> str:
        """How the verdict is made (TESTS)."""
        if self.note:
            return ""
        if self.rounds and not math.isfinite(self.se):
            return "sign"
        return "t" if math.isfinite(self.se) and self.se > 0 else ""


def paired_sides(base: Mapping[str, Any], head: Mapping[str, Any]) -> bool:
    """Whether the base row is side a and the head row side b of one sweep (equal parent_run_id)."""
    parent = text(base.get("parent_run_id"))
    return (text(base.get("side")), text(head.get("side"))) == SIDES and bool(parent) \
        and parent == text(head.get("parent_run_id"))

