"""One cell measured in several engine starts, merged into the one result it reports (pure).

With measure.replicates >= 2 every engine group is measured again in fresh engine starts.
A cell's pairs from all starts are kept (each pair knows its start); its step is the mean of
the starts' medians, each start weighted equally, with a t-interval on those medians (k - 1
degrees of freedom, intervals.between_starts_ci), so the CI covers what changes from one
engine start to the next, which a CI over one start's pairs cannot. The split likewise:
each start's device time one sample, with between-start CIs against the merged step
(merged_split).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Optional, Sequence

import numpy as np

from hostsweep.measure.intervals import between_starts_ci, few_starts_warning
from hostsweep.measure.periods import DesignRecord, median_canary_ms
from hostsweep.measure.protocol import CellMeasurement, summarize
from hostsweep.measure.results import CellResult
from hostsweep.measure.split import SplitResult, pooled_allreduce
from hostsweep.measure.split_stats import TimedStep, split_stats
from hostsweep.measure.stability import REASONS, StabilityRules, Stability, contention_summary


log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def _warn_few_starts(starts: int) -> None:
    """Say once per process that cells merged from this few starts have a wide CI."""
    warning = few_starts_warning(starts)
    if warning:
        log.warning(warning)


def _steps_ms(result: CellResult) -> list[float]:
    assert result.measurement is not None
    return [r.step_s * 1e3 for r in result.measurement.reps]


def merged_measurement(starts: Sequence[CellResult], rules: StabilityRules) -> CellMeasurement:
    """The step across the starts (mean of their medians) with its t-interval; every pair
    kept, tagged with its start. One start: its own median CI (nothing between starts to see)."""
    reps = tuple(dataclasses.replace(rep, replicate=i) for i, r in enumerate(starts)
                 for rep in r.measurement.reps)  # type: ignore[union-attr]
    timed_s = sum(r.measurement.timed_s for r in starts)  # type: ignore[union-attr]
    if len(starts) == 1:
        return dataclasses.replace(summarize(reps, rules.level), timed_s=timed_s)
    _warn_few_starts(len(starts))
    step, low, high = between_starts_ci([_steps_ms(r) for r in starts], rules.level)
    return CellMeasurement(
        step_ms=step, step_ci_low_ms=low, step_ci_high_ms=high,
        wall_1_ms=float(np.median([rep.wall_1_s for rep in reps]) * 1e3),
        wall_T_ms=float(np.median([rep.wall_T_s for rep in reps]) * 1e3),
        reps=reps, timed_s=timed_s, ci_coverage=rules.level,  # nominal: t on approximately normal medians
    )


def merged_split(starts: Sequence[CellResult], measurement: CellMeasurement, host_bound_threshold: float,
                 level: float) -> Optional[SplitResult]:
    """The split across the starts: each start's device time one sample, so device, host and
    host_frac get between-start CIs (measure/split_stats.py, k - 1 degrees of freedom; none
    below 3 starts) against the merged step, and the regime from them; what is per pair from
    the start with the median device time. One start: its own split, CIs over its own pairs."""
    splits = [r.split for r in starts if r.split is not None]
    if len(splits) < 2:
        return splits[0] if splits else None
    chosen = sorted(splits, key=lambda s: s.device_ms)[(len(splits) - 1) // 2]
    step = TimedStep(measurement.step_ms, measurement.step_ci_low_ms, measurement.step_ci_high_ms, len(starts), level)
    s = split_stats([sp.device_ms for sp in splits], [sp.profiled_step_ms for sp in splits], step,
                    host_bound_threshold)
    return dataclasses.replace(chosen, device_ms=s.device_ms, host_ms=s.host_ms, host_frac=s.host_frac,
                               profiled_step_ms=s.profiled_step_ms, profiler_overhead=s.profiler_overhead,
                               regime=s.regime, device_ci=s.device_ci, host_ci=s.host_ci, host_frac_ci=s.host_frac_ci,
                               profiled_step_ci=s.profiled_step_ci, pairs=sum(sp.pairs for sp in splits),
                               **pooled_allreduce(splits, level))


def merged_stability(starts: Sequence[CellResult], measurement: CellMeasurement, rules: StabilityRules) -> Stability:
    """What any start broke (its own CI's width aside), and the merged CI's width."""
    reasons = {reason for r in starts if r.stability is not None for reason in r.stability.reasons} - {"ci_width"}
    if measurement.ci_half_width_pct > rules.max_ci_pct:
        reasons.add("ci_width")
    first = starts[0].stability
    return Stability(
        reasons=tuple(r for r in REASONS if r in reasons),
        attempts=max((r.stability.attempts for r in starts if r.stability is not None), default=1),
        contention=contention_summary(measurement.reps),
        replicate_step_ms=first.replicate_step_ms if first is not None else None,
        start_medians_ms=tuple(float(np.median(_steps_ms(r))) for r in starts),
        design=merged_design([r.stability.design for r in starts if r.stability is not None], measurement),
    )


def merged_design(designs: Sequence[Optional[DesignRecord]], measurement: CellMeasurement) -> Optional[DesignRecord]:
    """The design record of a cell merged from several starts: periods and pairs summed over
    the starts, the canary the median over every pair that carries one, its shift (and the
    cells' common shift) the largest a start saw (what the diff and the summary read of the machine's speed)."""
    known = [d for d in designs if d is not None]
    if not known:
        return None
    shifts = [d.canary_shift_pct for d in known if d.canary_shift_pct is not None]
    together = [d.common_shift_pct for d in known if d.common_shift_pct is not None]
    # the weakest start's canary tracking: a diff normalizes only where every start tracked
    weakest = min(((d.canary_r, d.canary_explains_pct) for d in known if d.canary_explains_pct is not None),
                  key=lambda t: t[1], default=(None, None))
    return DesignRecord(periods=max(d.periods for d in known),
                        period_medians_ms=tuple(m for d in known for m in d.period_medians_ms),
                        clean_pairs=sum(d.clean_pairs for d in known),
                        contended_rounds=sum(d.contended_rounds for d in known),
                        canary_ms=median_canary_ms(measurement.reps),
                        canary_shift_pct=max(shifts) if shifts else None,
                        common_shift_pct=max(together) if together else None,
                        gpu_canary_ms=median_canary_ms(measurement.reps, gpu=True),
                        remeasured_for=tuple(w for d in known for w in d.remeasured_for),
                        warmup_rounds=max(d.warmup_rounds for d in known),
                        canary_r=weakest[0], canary_explains_pct=weakest[1])


def merge_starts(starts: Sequence[CellResult], rules: StabilityRules, host_bound_threshold: float) -> CellResult:
    """The cell's one result from its FINISHED results of several engine starts, in start order."""
    if not starts or any(r.status != "FINISHED" or r.measurement is None for r in starts):
        raise ValueError("merge_starts takes the FINISHED results of one cell")
    if len({r.key for r in starts}) != 1:
        raise ValueError(f"results of different cells: {sorted({r.key for r in starts})}")
    measurement = merged_measurement(starts, rules)
    first = starts[0]
    return dataclasses.replace(
        first, measurement=measurement,
        split=merged_split(starts, measurement, host_bound_threshold, rules.level),
        stability=merged_stability(starts, measurement, rules),
        duration_s=sum(r.duration_s for r in starts),
        started_at=min(r.started_at for r in starts), ended_at=max(r.ended_at for r in starts),
        earlier_timings=tuple(reps for r in starts for reps in r.earlier_timings),
        traces={name: blob for r in starts for name, blob in r.traces.items()},
    )
