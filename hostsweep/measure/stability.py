"""Whether a cell's number can be trusted on the host it was measured on (pure).

A cell's CI covers the noise among its own timed pairs; it says nothing about a neighbour
that used the CPUs while it ran, or about the host drifting while its pairs were taken.
These rules look for exactly that, each with a reason a user can act on:

    foreign_cpu   processes outside the engine and the sweep used more than
                  measure.max_foreign_cpu_frac of the machine's CPU during the cell's pairs
    ci_width      the CI's half-width is above measure.max_ci_pct % of the median
    drift         the medians of the first and second half of the cell's pairs (in the
                  order they ran) have disjoint CIs and differ by measure.min_shift_pct %
    replicate     the group's first cell, measured again once the group's rounds ended,
                  disagrees with itself (the same test): the host changed during the group
    split_impossible  the profiled pair's device time is outside [0, the timed step]
                  (host_frac < 0 or > 1), also after its re-measure: above the step, the two
                  ran under different conditions; below zero, the longer generate's ops
                  summed to less than the shorter's

The two-level bootstrap gives a CI across independent engine starts (replicates), as the
host-exposed-latency paper's five replicates did, where a one-level CI covers one start.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import numpy as np

from hostsweep.measure.protocol import CellMeasurement, RepTiming, bootstrap_median_ci

REASONS = ("foreign_cpu", "ci_width", "drift", "replicate", "split_impossible")
# A half needs this many pairs for its median's CI to mean anything.
MIN_PAIRS_PER_HALF = 4


@dataclass(frozen=True)
class StabilityRules:
    """The thresholds of the rules (measure.* keys); defaults a quiet run of a 2-core VM passes."""

    max_foreign_cpu_frac: float = 0.10
    max_ci_pct: float = 10.0
    # drift and replicate need disjoint CIs and medians this many % apart: a shift too small
    # to move a comparison is not a reason to distrust the cell
    min_shift_pct: float = 3.0
    resamples: int = 2000
    level: float = 0.95
    seed: int = 0


@dataclass(frozen=True)
class ContentionSummary:
    """A cell's contention record over its timed pairs (None where none was observed)."""

    foreign_cpu_frac: float  # mean over the pairs: the share of the machine others used
    foreign_cpu_frac_max: float  # the worst pair
    engine_cpu_frac: float
    steal_frac: float
    load1_max: float


@dataclass(frozen=True)
class Stability:
    """A cell's verdict, with what it rests on."""

    reasons: tuple[str, ...] = ()
    attempts: int = 1  # timed measurements of the cell: 1, or more when it was re-measured
    contention: Optional[ContentionSummary] = None
    replicate_step_ms: Optional[float] = None  # the group's first cell measured again at the end
    start_medians_ms: tuple[float, ...] = ()  # per engine start (measure.replicates >= 2)

    @property
    def stable(self) -> bool:
        return not self.reasons

    def with_reason(self, reason: str) -> "Stability":
        if reason in self.reasons:
            return self
        return replace(self, reasons=tuple(r for r in REASONS if r in (*self.reasons, reason)))


def contention_summary(timings: Sequence[RepTiming]) -> Optional[ContentionSummary]:
    records = [t.contention for t in timings if t.contention is not None]
    if not records:
        return None
    foreign = np.array([r.foreign_cpu_frac for r in records])
    return ContentionSummary(
        foreign_cpu_frac=float(foreign.mean()), foreign_cpu_frac_max=float(foreign.max()),
        engine_cpu_frac=float(np.mean([r.engine_cpu_frac for r in records])),
        steal_frac=float(np.mean([r.steal_frac for r in records])),
        load1_max=float(max(r.load1 for r in records)),
    )


def cis_disjoint(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[1] < b[0] or b[1] < a[0]


def shifted(a: float, b: float, a_ci: tuple[float, float], b_ci: tuple[float, float], min_shift_pct: float) -> bool:
    """Two medians of one cell at two moments: apart beyond both CIs and by min_shift_pct %."""
    return cis_disjoint(a_ci, b_ci) and abs(b - a) / abs(a) * 100.0 > min_shift_pct if a else False


def drifted(timings: Sequence[RepTiming], rules: StabilityRules) -> bool:
    """Whether the first and second half of the pairs, in the order they ran, disagree."""
    ordered = sorted(timings, key=lambda t: (t.round, t.rep))
    half = len(ordered) // 2
    if half < MIN_PAIRS_PER_HALF:
        return False
    rng = np.random.default_rng(rules.seed)
    steps = [[t.step_s * 1e3 for t in part] for part in (ordered[:half], ordered[half:])]
    first, second = (bootstrap_median_ci(s, rules.resamples, rules.level, rng) for s in steps)
    return shifted(float(np.median(steps[0])), float(np.median(steps[1])), first, second, rules.min_shift_pct)


def timing_reasons(timings: Sequence[RepTiming], measurement: CellMeasurement,
                   rules: StabilityRules) -> tuple[str, ...]:
    """The rules a cell's timed pairs break (foreign_cpu, ci_width, drift), in REASONS order."""
    reasons = []
    contention = contention_summary(timings)
    if contention is not None and contention.foreign_cpu_frac > rules.max_foreign_cpu_frac:
        reasons.append("foreign_cpu")
    if measurement.ci_half_width_pct > rules.max_ci_pct:
        reasons.append("ci_width")
    if drifted(timings, rules):
        reasons.append("drift")
    return tuple(reasons)


def judge(timings: Sequence[RepTiming], measurement: CellMeasurement, rules: StabilityRules,
          attempts: int = 1) -> Stability:
    return Stability(timing_reasons(timings, measurement, rules), attempts, contention_summary(timings))


def replicate_disagrees(first: CellMeasurement, again: CellMeasurement, min_shift_pct: float = 3.0) -> bool:
    """The same cell measured twice in one engine, apart in time: medians apart beyond both
    CIs (and by min_shift_pct %) mean the host, not the cell, changed."""
    return shifted(first.step_ms, again.step_ms, (first.step_ci_low_ms, first.step_ci_high_ms),
                   (again.step_ci_low_ms, again.step_ci_high_ms), min_shift_pct)


def two_level_bootstrap_ci(replicates: Sequence[Sequence[float]], resamples: int = 2000, level: float = 0.95,
                           rng: Optional[np.random.Generator] = None) -> tuple[float, float, float]:
    """(median, low, high) of the step across replicates: resample the replicates, then the
    pairs within each drawn replicate, and take the median of the pooled draw. The CI then
    covers what changes from one engine start to the next, not only pair-to-pair noise."""
    groups = [np.asarray(r, dtype=float) for r in replicates if len(r)]
    if not groups:
        raise ValueError("no replicates to bootstrap")
    rng = rng if rng is not None else np.random.default_rng(0)
    point = float(np.median(np.concatenate(groups)))
    medians = np.empty(resamples)
    for b in range(resamples):
        drawn = rng.integers(0, len(groups), size=len(groups))
        pooled = [groups[g][rng.integers(0, groups[g].size, size=groups[g].size)] for g in drawn]
        medians[b] = np.median(np.concatenate(pooled))
    tail = (1.0 - level) / 2.0 * 100.0
    low, high = np.percentile(medians, [tail, 100.0 - tail])
    return point, float(low), float(high)


def between_replicate_spread_pct(replicates: Sequence[Sequence[float]]) -> float:
    """(max − min) of the replicates' medians over their median, in %."""
    medians = np.array([np.median(r) for r in replicates if len(r)])
    centre = float(np.median(medians))
    return float((medians.max() - medians.min()) / centre * 100.0) if centre else float("nan")
