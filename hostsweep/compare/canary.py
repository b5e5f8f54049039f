"""The two sides' machines compared by their speed canary (pure): how much slower or faster
the head's machine ran than the base's, and each cell's ratio with that taken out.

Every timed pair carries the canary (run/canary.py): a fixed workload timed beside it, the
machine's own speed. Two studies measured minutes apart on a cloud VM meet machines tens of
percent apart; the canary says so, and `diff.normalize=canary` divides each cell's ratio by
the sides' canary ratio. The normalized ratio is shown beside the raw one, never instead:
it assumes the step slows as the canary does, which holds for a hypervisor taking CPU time
from the guest and need not hold for everything else (a slower memory path, another CPU).
A paired cell (side a and side b of one sweep) is normalized pair by pair instead: each
timed pair's step over the canary timed beside it, then the paired statistics over the
start pairs (paired_canary_ratio), so a slow spell inside a start is taken out where it
happened; a cell paired by rounds likewise round by round (rounds_canary_ratio).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional

import numpy as np
import pandas as pd
from scipy import stats

from hostsweep.compare.options import GATED, MIN_ROUNDS, by_rounds
from hostsweep.compare.rounds import MatchedRounds
from hostsweep.compare.stats import ci, paired_log_ratio, rounds_log_ratio

# A side's canary needs this many cells for its spread, and so its CI, to mean anything.
MIN_CELLS = 3


@dataclass(frozen=True)
class SideCanary:
    """A side's machine speed: the median of its cells' canary medians, and the standard
    error of its log (the median's, from the spread of the cells' canaries)."""

    ms: float
    log_se: float
    cells: int


def side_canary(cells: pd.DataFrame) -> Optional[SideCanary]:
    """The side's canary, or None with fewer than MIN_CELLS cells that carry one."""
    if "canary_ms" not in cells:
        return None
    values = pd.to_numeric(cells["canary_ms"], errors="coerce").dropna()
    values = np.log(values[values > 0].to_numpy(dtype=float))
    if len(values) < MIN_CELLS:
        return None
    # the median's standard error is about 1.25 times the mean's for a bell-shaped spread
    return SideCanary(float(np.exp(np.median(values))), 1.2533 * float(values.std(ddof=1)) / math.sqrt(len(values)),
                      len(values))


def side_tracking(cells: pd.DataFrame) -> Optional[float]:
    """The share (%) of the steps' round-to-round moves a side's canary explained: the median
    over its cells of the groups' canary_explains_pct (measure/canary_tracking.py), 0 where the
    canary moved against the steps (r < 0); None when its cells recorded none (runs from
    before the canary's tracking was recorded, or groups of too few rounds)."""
    if "canary_r" not in cells:
        return None
    r = pd.to_numeric(cells["canary_r"], errors="coerce").dropna().to_numpy(dtype=float)
    if not r.size:
        return None
    return float(np.median(np.where(r > 0, r * r * 100.0, 0.0)))


def tracking_line(base: Optional[float], head: Optional[float]) -> Optional[str]:
    """"the canary explains 12 % (base) / 40 % (head) of the steps' round-to-round moves", or
    None when neither side recorded it."""
    if base is None and head is None:
        return None
    named = " / ".join(f"{'not recorded' if v is None else f'{v:.0f} %'} ({name})"
                       for name, v in (("base", base), ("head", head)))
    return f"the canary explains {named} of the steps' round-to-round moves"


def machine_line(base: Optional[SideCanary], head: Optional[SideCanary]) -> Optional[str]:
    """"the head's machine ran 31 % slower than the base's (speed canary 2.215 vs 1.691 ms)",
    or None when either side has no canary."""
    if base is None or head is None:
        return None
    change = (head.ms / base.ms - 1.0) * 100.0
    how = "as fast as" if abs(change) < 0.5 else f"{abs(change):.0f} % {'slower' if change > 0 else 'faster'} than"
    return f"the head's machine ran {how} the base's (speed canary {head.ms:.3f} vs {base.ms:.3f} ms)"


def normalized_ratio(ratio: float, low: float, high: float, level: float, base: Optional[SideCanary],
                     head: Optional[SideCanary]) -> tuple[float, float, float]:
    """A cell's ratio and CI divided by the sides' canary ratio (head / base), the CI widened
    by the canary ratio's own uncertainty (in log space, root-sum-square with the ratio's
    half-width: an approximation that treats both as independent and the CI as symmetric in
    log); nan without both sides' canaries."""
    if base is None or head is None or not (0 < low <= ratio <= high):
        return math.nan, math.nan, math.nan
    centre = math.log(ratio) - math.log(head.ms / base.ms)
    half = (math.log(high) - math.log(low)) / 2.0
    z = float(stats.norm.ppf(0.5 + level / 2.0))
    half = math.hypot(half, z * math.hypot(base.log_se, head.log_se))
    return math.exp(centre), math.exp(centre - half), math.exp(centre + half)


def paired_canary_ratio(base: list[np.ndarray], head: list[np.ndarray], level: float) -> tuple[float, float, float]:
    """A paired cell's ratio and CI with each pair's step divided by its own canary: per start
    the median of step / canary, d_i = log(head_i / base_i) over the k start pairs, its mean
    with a t-interval on k - 1 df; nan with fewer than 2 start pairs or unequal starts."""
    if len(base) != len(head) or len(base) < 2 or not all(len(g) for g in (*base, *head)):
        return math.nan, math.nan, math.nan

    d, se, df = paired_log_ratio(np.array([np.median(g) for g in base]), np.array([np.median(g) for g in head]))
    if not (np.isfinite(d) and np.isfinite(se)):
        return math.nan, math.nan, math.nan
    low, high = ci(d, se, df, level)
    return math.exp(float(d)), float(low), float(high)


def rounds_canary_ratio(base: np.ndarray, base_canary: np.ndarray, head: np.ndarray, head_canary: np.ndarray,
                        level: float, min_rounds: int) -> tuple[float, float, float]:
    """A cell paired by rounds, each pair's step divided by the canary timed right after it:
    d_r = log((head_r / head canary_r) / (base_r / base canary_r)) over the rounds whose pairs
    both carry a canary, exp of their median with the order-statistic CI (the raw rounds
    statistic, stats.rounds_log_ratio); nan with fewer than min_rounds such rounds."""

    arrays = [np.asarray(x, dtype=float) for x in (base, base_canary, head, head_canary)]
    with np.errstate(invalid="ignore"):
        keep = np.logical_and.reduce([np.isfinite(x) & (x > 0) for x in arrays])
    if int(keep.sum()) < min_rounds:
        return math.nan, math.nan, math.nan
    b, bc, h, hc = (x[keep] for x in arrays)
    median, low, high, _ = rounds_log_ratio(b / bc, h / hc, level)
    return math.exp(float(median)), math.exp(float(low)), math.exp(float(high))


CANARY_COLUMNS = ("ratio_canary", "ci_low_canary", "ci_high_canary")


def with_canary_ratios(cells: pd.DataFrame, quantity: str, level: float, base: Optional[SideCanary],
                       head: Optional[SideCanary]) -> pd.DataFrame:
    """The diff's `quantity` rows (step_ms) with their ratio and CI divided by the sides'
    canary ratio, in columns of their own beside the raw ones (which keep the verdicts and
    the gate)."""
    cells = cells.copy()
    values = [normalized_ratio(r, lo, hi, level, base, head) if q == quantity else (math.nan,) * 3
              for q, r, lo, hi in zip(cells["quantity"], cells["ratio"], cells["ci_low"], cells["ci_high"])]
    for k, name in enumerate(CANARY_COLUMNS):
        cells[name] = [v[k] for v in values]
    return cells


def paired_canary_ratios(cells: pd.DataFrame, raw_canary: Mapping[str, list[np.ndarray]], level: float,
                          rounds: Mapping[str, Optional[MatchedRounds]]) -> pd.DataFrame:
    """The paired step rows' canary columns from their pairs' step / canary: start pair by start
    pair (compare/canary.paired_canary_ratio) where both runs have them, round by round
    (rounds_canary_ratio) for a cell judged by paired rounds."""
    cells = cells.copy()
    timed_in_rounds = by_rounds(cells)
    for i in cells.index[(cells["quantity"] == GATED) & (cells["design"] == "paired")]:
        matched = rounds.get(str(cells.at[i, "base_run"]))
        if timed_in_rounds[i] and matched is not None:
            cells.loc[i, list(CANARY_COLUMNS)] = rounds_canary_ratio(
                matched.base, matched.base_canary, matched.head, matched.head_canary, level, MIN_ROUNDS)
            continue
        base, head = raw_canary.get(str(cells.at[i, "base_run"])), raw_canary.get(str(cells.at[i, "head_run"]))
        if base is not None and head is not None:
            cells.loc[i, list(CANARY_COLUMNS)] = paired_canary_ratio(base, head, level)
    return cells

