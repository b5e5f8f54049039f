"""Whether a cell's number can be trusted on the host it was measured on (pure).

A cell's CI covers the noise among its own timed pairs; it says nothing about a neighbour
that used the CPUs while it ran, or about the host drifting while its pairs were taken.
These rules look for exactly that, each with a reason a user can act on:

    foreign_cpu   processes outside the engine and the sweep used more than
                  measure.max_foreign_cpu_frac of the machine's CPU in so many of the group's
                  rounds that the rounds clean for every cell leave the cell too few pairs
    ci_width      the CI's half-width is above measure.max_ci_pct % of the median
    drift         the first and second half of the cell's pairs (in the order they ran)
                  differ by a robust test at 1 - measure.ci_level (Yuen's test on trimmed
                  means: one outlier pair does not defeat it) and their medians differ by
                  measure.min_shift_pct %; in a group, on its steps relative to its
                  companions' in the same rounds (measure/periods.py), so the machine's
                  move, which every cell met, is not taken for the cell's
    period        re-measured, the cell moved between the group's periods differently from
                  its group (measure/periods.py): the cell, not the machine, did not reproduce
    split_impossible  the profiled pair's device time is outside [0, the timed step]
                  (host_frac < 0 or > 1), also after its re-measure: above the step, the two
                  ran under different conditions; below zero, the longer generate's ops
                  summed to less than the shorter's
    split_implausible  the split is possible but physically implausible, also after its
                  re-measure (measure/split_stats.py's checks): device time below the floor of
                  its kernels, compute inside the forward below zero, a profiled step faster
                  than the timed one beyond both CIs, or a profiler overhead outside
                  split.min/max_profiler_overhead; its host_frac and regime are not reported

What the whole group met is not a cell's flag: it is a group **annotation** (ANNOTATIONS),
carried by every cell of the group with its magnitude (DesignRecord's canary_shift_pct and
common_shift_pct) and shown once per group. It marks no cell unstable, hatches no figure
and leaves no cell out of a fit or a diff: every cell met it alike, and the cells' numbers
come from rounds in which they did.

    machine_speed the speed canary timed beside every pair moved by more than
                  measure.max_canary_shift_pct % over the group's rounds: the host changed
                  speed (a cloud VM does, with nothing in /proc)
    group_trend   the cells moved together over the rounds (measure/trend.py's step test on
                  their common speed, which holds its level under an autocorrelated machine
                  speed, and medians of the halves measure.min_shift_pct apart) while the
                  canary held: the engine, or a resource the canary does not see
    replicate     the group's first cell, measured again once the group's rounds ended,
                  disagrees with itself (the drift rule's test): the host changed during
                  the group (measure.replicate_first)

Across independent engine starts (replicates), as the host-exposed-latency paper's five
replicates did, a t-interval on the starts' medians (intervals.between_starts_ci) gives
the CI, where a one-level CI covers one start.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import numpy as np

from hostsweep.config.schema import MeasureConfig
from hostsweep.measure.intervals import shift_pvalue
from hostsweep.measure.periods import DesignRecord
from hostsweep.measure.protocol import CellMeasurement, RepTiming

REASONS = ("foreign_cpu", "ci_width", "drift", "period", "split_impossible", "split_implausible")
ANNOTATIONS = ("machine_speed", "group_trend", "replicate")
# A half needs this many pairs for a test of two halves to reach 5 % at all (3 against 3;
# an outlier pair is trimmed away only from 4 a half, 8 pairs).
MIN_PAIRS_PER_HALF = 3


@dataclass(frozen=True)
class StabilityRules:
    """The thresholds of the rules; the defaults are measure.*'s (config/schema.py), one fact."""

    max_foreign_cpu_frac: float = MeasureConfig.max_foreign_cpu_frac
    max_ci_pct: float = MeasureConfig.max_ci_pct
    # drift and replicate need a significant shift and medians this many % apart: a shift
    # too small to move a comparison is not a reason to distrust the cell
    min_shift_pct: float = MeasureConfig.min_shift_pct
    level: float = MeasureConfig.ci_level  # the drift and replicate tests run at 1 - level

    @classmethod
    def of(cls, m: MeasureConfig) -> "StabilityRules":
        return cls(m.max_foreign_cpu_frac, m.max_ci_pct, m.min_shift_pct, m.ci_level)


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
    design: Optional[DesignRecord] = None  # periods, clean rounds and canary (measure/periods.py)
    annotations: tuple[str, ...] = ()  # what the whole group met (ANNOTATIONS): no cell's flag

    @property
    def stable(self) -> bool:
        return not self.reasons

    def with_reason(self, reason: str) -> "Stability":
        """The verdict with one more flag: an own-number reason (REASONS) makes the cell
        unstable, a group annotation (ANNOTATIONS) does not."""
        if reason in ANNOTATIONS:
            return replace(self, annotations=tuple(a for a in ANNOTATIONS if a in (*self.annotations, reason)))
        if reason not in REASONS:
            raise ValueError(f"unknown stability reason {reason!r}; allowed: {', '.join(REASONS + ANNOTATIONS)}")
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


def shift_flags(a: np.ndarray, b: np.ndarray, level: float, min_shift_pct: float) -> np.ndarray:
    """shifted() over the rows of a and b (the last axis holds each sample's steps)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if min(a.shape[-1], b.shape[-1]) < MIN_PAIRS_PER_HALF:
        return np.zeros(a.shape[:-1], dtype=bool)
    centre_a, centre_b = np.median(a, axis=-1), np.median(b, axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        apart = np.abs(centre_b - centre_a) / np.abs(centre_a) * 100.0 > min_shift_pct
    return apart & (shift_pvalue(a, b) < 1.0 - level)  # nan p (equal constant samples): no shift


def shifted(a: Sequence[float], b: Sequence[float], level: float, min_shift_pct: float) -> bool:
    """Two samples of one cell's steps at two moments: their locations differ by Yuen's
    trimmed-means test at 1 - level, and their medians by more than min_shift_pct %."""
    return bool(shift_flags(np.asarray(a, dtype=float), np.asarray(b, dtype=float), level, min_shift_pct))


def drifted(timings: Sequence[RepTiming], rules: StabilityRules) -> bool:
    """Whether the first and second half of the pairs, in the order they ran, disagree
    (shifted). From 8 pairs on one outlier pair cannot decide it; 6 or 7 pairs can show a
    shift only without one; fewer never."""
    ordered = sorted(timings, key=lambda t: (t.round, t.rep))
    half = len(ordered) // 2
    steps = [t.step_s * 1e3 for t in ordered]
    return shifted(steps[:half], steps[half:], rules.level, rules.min_shift_pct)


def timing_reasons(timings: Sequence[RepTiming], measurement: CellMeasurement,
                   rules: StabilityRules, judge_drift: bool = True) -> tuple[str, ...]:
    """The rules a cell's timed pairs break (foreign_cpu, ci_width, drift), in REASONS order;
    judge_drift=False leaves drift to the caller (a group judges it against companions)."""
    reasons = []
    contention = contention_summary(timings)
    if contention is not None and contention.foreign_cpu_frac > rules.max_foreign_cpu_frac:
        reasons.append("foreign_cpu")
    if measurement.ci_half_width_pct > rules.max_ci_pct:
        reasons.append("ci_width")
    if judge_drift and drifted(timings, rules):
        reasons.append("drift")
    return tuple(reasons)


def judge(timings: Sequence[RepTiming], measurement: CellMeasurement, rules: StabilityRules,
          attempts: int = 1) -> Stability:
    return Stability(timing_reasons(timings, measurement, rules), attempts, contention_summary(timings))


def replicate_disagrees(first: CellMeasurement, again: CellMeasurement,
                        min_shift_pct: float = MeasureConfig.min_shift_pct,
                        level: float = MeasureConfig.ci_level) -> bool:
    """The same cell measured twice in one engine, apart in time: pairs that differ by the
    drift rule's test (shifted) mean the host, not the cell, changed."""
    return shifted([r.step_s * 1e3 for r in first.reps], [r.step_s * 1e3 for r in again.reps], level, min_shift_pct)


def between_replicate_spread_pct(replicates: Sequence[Sequence[float]]) -> float:
    """(max − min) of the replicates' medians over their median, in %."""
    medians = np.array([np.median(r) for r in replicates if len(r)])
    centre = float(np.median(medians))
    return float((medians.max() - medians.min()) / centre * 100.0) if centre else float("nan")


def recorded_flags(stable: object, reasons: object, annotations: object = "") -> tuple[str, str, str]:
    """A cell's recorded (stable, unstable_reasons, group_annotations) as this version reads
    them: cells logged before the annotations carried machine_speed and replicate among
    their unstable reasons, and were marked unstable for them alone. Those names move to the
    annotations, and a cell whose every reason moved is stable. A cell with no verdict
    ("" or None) keeps none."""
    def names(value: object) -> list[str]:
        return [r.strip() for r in value.split(",") if r.strip()] if isinstance(value, str) else []

    flags = names(reasons)
    own = [r for r in flags if r not in ANNOTATIONS]
    group = [a for a in ANNOTATIONS if a in {*names(annotations), *flags}]
    verdict = stable if isinstance(stable, str) else ""
    if verdict.strip().lower() == "false" and flags and not own:
        verdict = "true"
    return verdict, ",".join(own), ",".join(group)
