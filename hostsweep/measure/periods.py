"""The measurement design of one engine group (pure): periods, common clean rounds and the
speed canary, and what each says about a cell.

- A **period** is one pass of the group's interleaved rounds. A re-measure times the whole
  group again in a new period, never a cell alone, so every cell meets the same machine in
  every period and cross-cell comparisons stay within the periods all cells share.
- A **contended round** is a round in which any pair's contention record crossed
  measure.max_foreign_cpu_frac. Every cell of the group is estimated on the rounds clean
  for all of them (the common clean rounds), so a neighbour that comes and goes cannot
  make one cell look fast because its pairs happened to fall in the quiet phase.
- The **canary** (run/canary.py) is a fixed workload timed beside every pair: the
  machine's own speed. Its movement across the group's rounds is `canary_shift_pct`.
- **Companions** are the other cells of the group, timed in the same rounds. A cell's
  drift is judged on its steps relative to theirs (`relative_to_companions`): a machine
  that sped up or slowed down over the rounds moves every cell alike and is the group's
  `common_trend`, judged once for the whole group; a cell that moved alone is the cell's.
- **Profiled pairs** (the device/host split's) are taken inside the first period's rounds,
  right after a timed pair, in the same rounds for every cell (`profiled_rounds`), so the
  device time and the step it is subtracted from come from one period of the machine.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable, Optional, Sequence

import numpy as np

from hostsweep.measure.intervals import median_ci
from hostsweep.measure.phases import PhaseTotals
from hostsweep.measure.protocol import RepTiming
from hostsweep.measure.traces import TraceTotals

# A canary bucket (a half period) needs this many timings for its median to mean anything.
MIN_CANARY_PER_BUCKET = 3
# A cell keeps its estimate on the common clean rounds only if they leave it this many pairs
# and this share of its pairs; otherwise its pairs are too contended to trust.
MIN_CLEAN_PAIRS, MIN_CLEAN_SHARE = 5, 0.5

RoundId = tuple[int, int]  # (period, round)


@dataclass(frozen=True)
class DesignRecord:
    """What the group's design says about one cell's number."""

    periods: int = 1  # periods the cell was timed in (1 + group re-measures)
    period_medians_ms: tuple[float, ...] = ()  # the cell's median step in each period
    clean_pairs: int = 0  # the pairs its estimate rests on (in the common clean rounds)
    contended_rounds: int = 0  # the group's rounds left out as contended
    canary_ms: Optional[float] = None  # median canary over the cell's pairs
    canary_shift_pct: Optional[float] = None  # how far the machine's speed moved over the group's rounds
    # how far every cell's step moved together over the group's rounds (common_shift_pct):
    # the machine's speed as the cells themselves saw it; None for a group of one cell
    common_shift_pct: Optional[float] = None
    gpu_canary_ms: Optional[float] = None  # median of the canary's GPU kernel over the cell's pairs (a CUDA worker)
    # why each period after the first was taken: the rules it was to cure ('ci_width',
    # 'foreign_cpu+drift'), one entry a period
    remeasured_for: tuple[str, ...] = ()
    warmup_rounds: int = 0  # untimed rounds the group warmed up in before its first timed one
    # how well the canary tracked the group's step moves over its rounds (canary_tracking.py):
    # their correlation and the share (%) of the steps' moves it explains; None: too few rounds
    canary_r: Optional[float] = None
    canary_explains_pct: Optional[float] = None


def round_of(pair: RepTiming) -> RoundId:
    return pair.period, pair.round


def contended_rounds(cells: Iterable[Sequence[RepTiming]], max_foreign_cpu_frac: float) -> set[RoundId]:
    """The rounds (of every cell's pairs) in which any pair's neighbours used more than
    max_foreign_cpu_frac of the machine."""
    return {round_of(p) for pairs in cells for p in pairs
            if p.contention is not None and p.contention.foreign_cpu_frac > max_foreign_cpu_frac}


def clean_pairs(pairs: Sequence[RepTiming], contended: set[RoundId]) -> Optional[tuple[RepTiming, ...]]:
    """The cell's pairs in the common clean rounds, or None when too few are left
    (fewer than MIN_CLEAN_PAIRS, or under MIN_CLEAN_SHARE of its pairs)."""
    kept = tuple(p for p in pairs if round_of(p) not in contended)
    if len(kept) < MIN_CLEAN_PAIRS or len(kept) < MIN_CLEAN_SHARE * len(pairs):
        return None
    return kept


def by_period(pairs: Sequence[RepTiming]) -> list[tuple[RepTiming, ...]]:
    """The pairs split by period, in period order (periods without pairs left out)."""
    periods = sorted({p.period for p in pairs})
    return [tuple(p for p in pairs if p.period == k) for k in periods]


def period_medians_ms(pairs: Sequence[RepTiming]) -> tuple[float, ...]:
    return tuple(float(np.median([p.step_s for p in part]) * 1e3) for part in by_period(pairs))


def canary_shift_pct(pairs: Iterable[RepTiming]) -> Optional[float]:
    """How far the machine's speed moved over these pairs: the canary's median in each half
    of each period (by round), then (slowest / fastest - 1) in %. Medians, so one slow
    canary (a page fault, a timer interrupt) does not move it; None without enough canaries."""
    timed = [p for p in pairs if p.canary_ms is not None]
    buckets: dict[tuple[int, int], list[float]] = {}
    for period in sorted({p.period for p in timed}):
        rounds = sorted({p.round for p in timed if p.period == period})
        middle = rounds[len(rounds) // 2] if rounds else 0
        for p in timed:
            if p.period == period:
                buckets.setdefault((period, int(p.round >= middle)), []).append(p.canary_ms)  # type: ignore[arg-type]
    medians = [float(np.median(v)) for v in buckets.values() if len(v) >= MIN_CANARY_PER_BUCKET]
    if len(medians) < 2 or min(medians) <= 0:
        return None
    return (max(medians) / min(medians) - 1.0) * 100.0


def _speed_in_round(cells: Sequence[Sequence[RepTiming]]) -> list[dict[RoundId, float]]:
    """Each cell's step in each of its rounds over its own median step in that period: how
    fast the cell ran in that round against its usual, comparable across cells of unequal
    steps."""
    out = []
    for pairs in cells:
        medians = {part[0].period: float(np.median([p.step_s for p in part])) for part in by_period(pairs)}
        out.append({round_of(p): p.step_s / medians[p.period] for p in pairs if medians[p.period] > 0})
    return out


def _median_by_round(speeds: Sequence[dict[RoundId, float]]) -> dict[RoundId, float]:
    rounds = sorted({r for s in speeds for r in s})
    return {r: float(np.median([s[r] for s in speeds if r in s])) for r in rounds}


def relative_to_companions(cells: Sequence[Sequence[RepTiming]],
                           not_companions: frozenset[int] = frozenset()) -> list[Optional[tuple[RepTiming, ...]]]:
    """Each cell's pairs with every step divided by its companions' speed in that round (the
    median, over the group's other cells, of their step in the round over their period
    median): what is left of the cell's movement once the machine's, which every cell of the
    round met, is taken out. Cells in `not_companions` (those found moving alone) do not
    serve as anyone's companion while others are left. Pairs of rounds no companion ran in
    are left out; None for a cell without companions (a group of one)."""
    speeds = _speed_in_round(cells)
    out: list[Optional[tuple[RepTiming, ...]]] = []
    for i, pairs in enumerate(cells):
        others = [s for j, s in enumerate(speeds) if j != i and s and j not in not_companions] \
            or [s for j, s in enumerate(speeds) if j != i and s]
        if not others:
            out.append(None)
            continue
        companions = _median_by_round(others)
        out.append(tuple(replace(p, step_s=p.step_s / companions[round_of(p)]) for p in pairs
                         if companions.get(round_of(p), 0.0) > 0))
    return out


def common_trend(cells: Sequence[Sequence[RepTiming]]) -> Optional[tuple[RepTiming, ...]]:
    """The group's speed in each round as pseudo-pairs (step_s: the median over cells of
    their step in the round over their period median; 1.0 is a usual round): the machine's
    movement as every cell met it. None for a group of one cell, whose own movement cannot
    be told from the machine's."""
    speeds = [s for s in _speed_in_round(cells) if s]
    if len(speeds) < 2:
        return None
    return tuple(RepTiming(rep=r[1], t1_first=True, wall_1_s=0.0, wall_T_s=0.0, step_s=v, round=r[1], period=r[0])
                 for r, v in _median_by_round(speeds).items())


def common_shift_pct(trend: Optional[Sequence[RepTiming]]) -> Optional[float]:
    """How far the group's common speed moved within a period: the median of each half of a
    period's rounds, (slower / faster - 1) in %, the largest over the periods."""
    if not trend:
        return None
    shifts = []
    for part in by_period(trend):
        ordered = [p.step_s for p in sorted(part, key=lambda p: p.round)]
        half = len(ordered) // 2
        if half >= 1:
            a, b = float(np.median(ordered[:half])), float(np.median(ordered[half:]))
            if min(a, b) > 0:
                shifts.append((max(a, b) / min(a, b) - 1.0) * 100.0)
    return max(shifts) if shifts else None


def median_canary_ms(pairs: Iterable[RepTiming], gpu: bool = False) -> Optional[float]:
    """The median canary over the pairs that carry one (gpu: its GPU kernel's)."""
    values = [v for v in ((p.gpu_canary_ms if gpu else p.canary_ms) for p in pairs) if v is not None]
    return float(np.median(values)) if values else None


def common_period_ratios(cells: Sequence[Sequence[RepTiming]]) -> list[float]:
    """Per later period, the group's common speed change against the first period: the
    median over cells of (cell's period median / its first period median)."""
    per_cell = [period_medians_ms(pairs) for pairs in cells]
    periods = min((len(m) for m in per_cell), default=0)
    return [float(np.median([m[k] / m[0] for m in per_cell if m[0] > 0])) for k in range(1, periods)]


def period_disagrees(pairs: Sequence[RepTiming], common: Sequence[float], min_shift_pct: float,
                     level: float) -> bool:
    """Whether a cell moved between periods differently from its group: its first period's
    median CI, scaled by the group's common change, and a later period's CI are disjoint,
    and their medians differ by more than min_shift_pct %. The group moving together is
    the machine; one cell moving alone is the cell's number not reproducing."""
    parts = by_period(pairs)
    if len(parts) < 2:
        return False
    steps = [[p.step_s * 1e3 for p in part] for part in parts]
    first = median_ci(steps[0], level)
    for later_steps, ratio in zip(steps[1:], common):
        later = median_ci(later_steps, level)
        low, high, median = first.low * ratio, first.high * ratio, float(np.median(steps[0])) * ratio
        disjoint = later.high < low or high < later.low
        if disjoint and median > 0 and abs(float(np.median(later_steps)) / median - 1.0) * 100.0 > min_shift_pct:
            return True
    return False


@dataclass(frozen=True)
class ProfiledPair:
    """One profiled T=1 / T pair of a cell: per-rank kernel totals of each generate, their
    (profiler-inflated) walls, the phase totals when recorded, and when and how long it ran."""

    short: tuple[TraceTotals, ...]
    long: tuple[TraceTotals, ...]
    wall_1_s: float
    wall_T_s: float
    phases_1: Optional[tuple[PhaseTotals, ...]]
    phases_T: Optional[tuple[PhaseTotals, ...]]
    round: int  # the round it followed the cell's timed pair in; -1: taken after the rounds
    seconds: float  # what taking it cost: profiler start and stop, both generates, the traces read

    def profiled_step_ms(self, T: int) -> float:
        return (self.wall_T_s - self.wall_1_s) / (T - 1) * 1e3


def profiled_rounds(reps: int, profiled: int) -> frozenset[int]:
    """The rounds (0-based, of `reps`) after which a cell's `profiled` pairs are taken: spread
    evenly over the rounds, one in every reps / profiled, the same rounds for every cell of
    equal reps. More profiled pairs than rounds: every round, the rest after the rounds."""
    if reps < 1 or profiled < 1:
        return frozenset()
    return frozenset(min(reps - 1, int((j + 0.5) * reps / profiled)) for j in range(min(profiled, reps)))
