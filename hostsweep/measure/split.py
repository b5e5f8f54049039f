"""Device/host split of a decode step, and the linearity check of differencing (pure).

device_ms is the differenced kernel-time total per step, (kernels(T) - kernels(1)) /
(T - 1), from profiled generates; host_ms = step_ms - device_ms is the host-exposed
residual, with step_ms from the timed (unprofiled) pairs. `device_split` splits one
profiled pair; `pooled_split` makes a cell's split of several, with the CIs, the regime and
the checks of measure/split_stats.py. `device_floor_ms` is the physical floor of a step's
device time: the T - 1 decode steps' kernels (CUDA kernels, or the CPU build's counted compute
ops) are among the long generate's, so they take at least as long as that many of its shortest.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from hostsweep.measure.phases import PhaseSplit
from hostsweep.measure.split_stats import TimedStep, implausible_checks, mean_t_ci, split_stats
from hostsweep.measure.traces import TraceTotals


@dataclass(frozen=True)
class SplitResult:
    kernel_source: str
    device_ms: float
    host_ms: float
    host_frac: float
    overlap_gap_ms: float  # (kernel sum - kernel union) per step
    copy_ms: float  # host<->device copy time per step (cuda traces only)
    copy_bytes: float  # bytes copied per step (cuda traces only)
    profiled_step_ms: float
    profiler_overhead: float  # profiled step / unprofiled step
    regime: str  # "host-bound" or "device-bound", from host_frac
    per_rank_device_ms: tuple[float, ...]
    top_ops: tuple[tuple[str, float], ...]  # (name, ms per step), largest first
    kernels_per_step: float = 0.0  # CUDA kernels, or counted CPU compute ops, per step
    launches_per_step: float = 0.0  # host launch calls per step (cuda traces only)
    split_s: float = 0.0  # wall time of the whole split phase (the worker sets it)
    split_overhead_s: float = 0.0  # split_s minus as many unprofiled pairs (see SweepWorker._split)
    phases: Optional[PhaseSplit] = None  # host ms per named phase (measure/phases.py), when scoped
    # Over the cell's profiled pairs (measure/split_stats.py); the CIs are None below 3 pairs.
    pairs: int = 1
    device_ci: Optional[tuple[float, float]] = None
    host_ci: Optional[tuple[float, float]] = None
    host_frac_ci: Optional[tuple[float, float]] = None
    profiled_step_ci: Optional[tuple[float, float]] = None
    device_floor_ms: float = 0.0  # no real step's device time is below this (device_floor_ms())
    implausible: tuple[str, ...] = ()  # the split_stats.IMPLAUSIBLE_CHECKS it fails
    # The all-reduce in situ, ms per step of each rank (a part of its device time); pooled: the
    # mean over the pairs, rank 0's with a t-interval (None below 3 pairs). Empty at TP-1.
    per_rank_allreduce_ms: tuple[float, ...] = ()
    allreduce_insitu_ci: Optional[tuple[float, float]] = None
    allreduces_per_step: float = 0.0  # rank 0's all-reduce calls per step (2L + 1 on vLLM's Llama)

    @property
    def possible(self) -> bool:
        """Whether the split describes a real step: device time in [0, step]. Above the step
        (host time < 0) the profiled pair and the timed step ran under different conditions;
        below zero the longer generate's ops summed to less than the shorter's (profiler
        noise over too few steps, or a speculative engine that took fewer of them)."""
        return self.device_ms >= 0 and self.host_ms >= 0

    @property
    def sound(self) -> bool:
        """Possible and passing every physical check: a split whose host_frac may be shown."""
        return self.possible and not self.implausible

    @property
    def allreduce_insitu_ms(self) -> float:
        """Rank 0's all-reduce time per step; NaN without several ranks (nothing to reduce)."""
        return self.per_rank_allreduce_ms[0] if len(self.per_rank_allreduce_ms) > 1 else float("nan")

    @property
    def slowest_rank(self) -> int:
        """The rank whose device time the split reports (and whose phases it reads)."""
        return int(np.argmax(self.per_rank_device_ms))


@dataclass(frozen=True)
class LinearityResult:
    tokens: tuple[int, ...]
    wall_ms: tuple[float, ...]
    kernel_ms: tuple[float, ...]  # empty when the split is off
    r2_wall: float
    r2_kernel: float
    slope_fit_ms: float  # least-squares wall slope over all points
    slope_two_point_ms: float  # wall slope from the first and last points alone
    slope_disagreement: float  # |two-point - fit| / fit


def per_step(total_1: float, total_T: float, T: int) -> float:
    return (total_T - total_1) / (T - 1)


def differenced_top_ops(short: TraceTotals, long: TraceTotals, T: int, n: int) -> tuple[tuple[str, float], ...]:
    """The n ops/kernels with the most time per decode step (ms)."""
    names = set(short.by_name_us) | set(long.by_name_us)
    diffs = Counter({name: per_step(short.by_name_us.get(name, 0.0), long.by_name_us.get(name, 0.0), T) / 1e3
                     for name in names})
    return tuple((name, ms) for name, ms in diffs.most_common(n))


def device_floor_ms(kernels_per_step: float, durations_us: Sequence[float], steps: int) -> float:
    """The least device time per step that `steps` decode steps of `kernels_per_step` kernels
    each can take: those kernels are among the trace's (`durations_us`, ascending), so together
    they take at least the sum of that many of its shortest. 0 without kernels or durations."""
    k = int(np.floor(kernels_per_step * steps)) if np.isfinite(kernels_per_step) and steps > 0 else 0
    if k <= 0 or not len(durations_us):
        return 0.0
    return float(np.sum(np.asarray(durations_us[:k], dtype=float))) / steps / 1e3


def device_split(
    ranks_1: Sequence[TraceTotals], ranks_T: Sequence[TraceTotals], T: int, step_ms: float,
    profiled_step_ms: float, host_bound_threshold: float, top_n: int = 15,
) -> SplitResult:
    """Split one cell's step given per-rank totals of a profiled T=1 / T pair.

    With several ranks the step waits for the slowest, so device_ms is the largest
    per-rank value; all ranks are kept in per_rank_device_ms.
    """
    if len(ranks_1) != len(ranks_T) or not ranks_1:
        raise ValueError(f"need one trace per rank for both generates, got {len(ranks_1)} and {len(ranks_T)}")
    per_rank = [per_step(a.kernel_sum_us, b.kernel_sum_us, T) / 1e3 for a, b in zip(ranks_1, ranks_T)]
    slowest = int(np.argmax(per_rank))
    short, long = ranks_1[slowest], ranks_T[slowest]
    device_ms = per_rank[slowest]
    union_ms = per_step(short.kernel_union_us, long.kernel_union_us, T) / 1e3
    host_ms = step_ms - device_ms
    host_frac = host_ms / step_ms
    kernels_per_step = per_step(short.kernel_count, long.kernel_count, T)
    allreduce = tuple(per_step(a.allreduce_us, b.allreduce_us, T) / 1e3 for a, b in zip(ranks_1, ranks_T))
    return SplitResult(
        kernel_source=long.kernel_source,
        device_ms=device_ms,
        host_ms=host_ms,
        host_frac=host_frac,
        overlap_gap_ms=device_ms - union_ms,
        copy_ms=per_step(short.copy_us, long.copy_us, T) / 1e3,
        copy_bytes=per_step(short.copy_bytes, long.copy_bytes, T),
        profiled_step_ms=profiled_step_ms,
        profiler_overhead=profiled_step_ms / step_ms,
        regime="host-bound" if host_frac >= host_bound_threshold else "device-bound",
        per_rank_device_ms=tuple(per_rank),
        top_ops=differenced_top_ops(short, long, T, top_n),
        kernels_per_step=kernels_per_step,
        launches_per_step=per_step(short.launch_count, long.launch_count, T),
        device_floor_ms=device_floor_ms(kernels_per_step, long.durations_us, T - 1),
        per_rank_allreduce_ms=allreduce if len(allreduce) > 1 else (),
        allreduces_per_step=per_step(ranks_1[0].allreduce_count, ranks_T[0].allreduce_count, T),
    )


def pooled_allreduce(splits: Sequence[SplitResult], level: float) -> dict[str, object]:
    """The in-situ all-reduce over several splits (pairs, or starts), as SplitResult fields:
    each rank's mean, rank 0's t-interval, the calls per step's mean. Empty at TP-1."""
    ranks = [s.per_rank_allreduce_ms for s in splits if s.per_rank_allreduce_ms]
    if not ranks or len({len(r) for r in ranks}) != 1:
        return {}
    means = tuple(float(v) for v in np.mean(np.asarray(ranks, dtype=float), axis=0))
    _, ci, _ = mean_t_ci([r[0] for r in ranks], level)
    return {"per_rank_allreduce_ms": means, "allreduce_insitu_ci": ci,
            "allreduces_per_step": float(np.mean([s.allreduces_per_step for s in splits]))}


def pooled_split(splits: Sequence[SplitResult], step: TimedStep, threshold: float,
                 overhead_band: tuple[float, float], phases: Optional[PhaseSplit] = None) -> SplitResult:
    """A cell's split from its profiled pairs' (device_split of each): device, host, host_frac,
    the profiled step, their CIs and the regime over the pairs (split_stats); what is per pair
    (ranks, top ops, overlap, copies, counts) from the pair with the median device time; the
    floor the median of the pairs' floors; `phases` pooled by the caller (phases.over_pairs);
    and the checks it fails (split_stats.implausible_checks)."""
    if not splits:
        raise ValueError("split: no profiled pairs to pool")
    s = split_stats([p.device_ms for p in splits], [p.profiled_step_ms for p in splits], step, threshold)
    chosen = sorted(splits, key=lambda p: p.device_ms)[(len(splits) - 1) // 2]
    floor = float(np.median([p.device_floor_ms for p in splits]))
    forward = None if phases is None else (phases.forward_compute_ms, phases.forward_compute_ci)
    return dataclasses.replace(
        chosen, device_ms=s.device_ms, host_ms=s.host_ms, host_frac=s.host_frac, profiled_step_ms=s.profiled_step_ms,
        profiler_overhead=s.profiler_overhead, regime=s.regime, pairs=s.pairs, device_ci=s.device_ci,
        host_ci=s.host_ci, host_frac_ci=s.host_frac_ci, profiled_step_ci=s.profiled_step_ci, device_floor_ms=floor,
        phases=phases if phases is not None else chosen.phases,
        implausible=implausible_checks(s, step, floor, forward, overhead_band), **pooled_allreduce(splits, step.level))


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """(slope, intercept, R²) of the least-squares line."""
    x, y = np.asarray(xs, float), np.asarray(ys, float)
    slope, intercept = np.polyfit(x, y, 1)
    residual = y - (slope * x + intercept)
    total = np.sum((y - y.mean()) ** 2)
    r2 = 1.0 - float(np.sum(residual ** 2) / total) if total > 0 else float("nan")
    return float(slope), float(intercept), r2


def linearity(tokens: Sequence[int], wall_ms: Sequence[float], kernel_ms: Sequence[float] = ()) -> LinearityResult:
    """Is wall (and kernel) time linear in T, and does the two-point slope agree with the fit?"""
    if len(tokens) < 3:
        raise ValueError(f"linearity needs at least 3 values of T, got {list(tokens)}")
    order = np.argsort(tokens)
    t = [int(tokens[i]) for i in order]
    w = [float(wall_ms[i]) for i in order]
    k = [float(kernel_ms[i]) for i in order] if len(kernel_ms) else []
    slope, _, r2_wall = linear_fit(t, w)
    two_point = (w[-1] - w[0]) / (t[-1] - t[0])
    r2_kernel = linear_fit(t, k)[2] if k else float("nan")
    return LinearityResult(tuple(t), tuple(w), tuple(k), r2_wall, r2_kernel, slope, two_point,
                           abs(two_point - slope) / abs(slope))
