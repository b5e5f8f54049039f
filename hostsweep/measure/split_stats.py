"""The device/host split of a cell from several profiled pairs, with CIs, a three-valued
regime and the physical checks that flag an implausible split (pure).

Inputs are per profiled T=1 / T pair its differenced device ms per step and its profiled
step ms, and the cell's timed step (its point, its CI and how many timed pairs it rests on).

- **device_ms** is the mean over the pairs with Student's t-interval (n - 1 degrees of
  freedom); **host_ms** = step - device, its half-width the root sum of squares of the two
  t-scaled errors (the step's standard error read off its CI, the two independent: the
  profiled and the timed pairs are other generates).
- **host_frac** = 1 - device / step, its CI from Fieller's interval for the ratio of two
  independent estimates, each error scaled by its own t quantile. A percentile bootstrap
  over 3-5 pairs undercovers (its draws never leave the range of the pairs:
  benchmarks/split_ci_coverage.py measures both); Fieller's interval does not, and it is
  unbounded (None) where the step is not clearly above zero.
- Fewer than MIN_PAIRS_FOR_CI pairs: no CI at all, rather than one that does not cover,
  and the regime is `undetermined`: one pair cannot say on which side of the threshold a
  cell lies (the regimes of one-pair splits flipped between two runs of one grid).
- **regime**: `host-bound` when the whole host_frac CI is at or above the threshold,
  `device-bound` when it is all below, `undetermined` when it straddles it.
- **checks** (IMPLAUSIBLE_CHECKS): what no real step can show: device time below the
  physical floor (split.device_floor_ms), compute inside the forward below zero, a
  profiled step faster than the timed one beyond both CIs, a profiler overhead outside
  split.min_profiler_overhead..max_profiler_overhead. Any of them makes the split `split_implausible`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np
from scipy import stats

MIN_PAIRS_FOR_CI = 3
HOST_BOUND, DEVICE_BOUND, UNDETERMINED = "host-bound", "device-bound", "undetermined"
REGIMES = (HOST_BOUND, DEVICE_BOUND, UNDETERMINED)
IMPLAUSIBLE_CHECKS = ("device_below_floor", "forward_compute_negative", "profiled_faster", "profiler_overhead")
# The floor sums float32 durations: a device time this close to it is at it, not below.
FLOOR_TOLERANCE = 1e-4

Interval = tuple[float, float]
ArrayLike = Union[float, np.ndarray]


@dataclass(frozen=True)
class TimedStep:
    """The cell's timed step as its measurement reports it: point, CI and the pairs behind it."""

    step_ms: float
    ci_low_ms: float
    ci_high_ms: float
    pairs: int
    level: float

    @property
    def se_ms(self) -> float:
        """Standard error read off the CI: its half-width over the normal quantile (an
        order-statistic CI of the median is not symmetric; its half-width is what it claims)."""
        return (self.ci_high_ms - self.ci_low_ms) / 2.0 / float(stats.norm.ppf((1.0 + self.level) / 2.0))


@dataclass(frozen=True)
class SplitStats:
    """A cell's split over its profiled pairs; the CIs are None below MIN_PAIRS_FOR_CI pairs."""

    pairs: int
    device_ms: float
    device_ci: Optional[Interval]
    host_ms: float
    host_ci: Optional[Interval]
    host_frac: float
    host_frac_ci: Optional[Interval]
    profiled_step_ms: float
    profiled_step_ci: Optional[Interval]
    profiler_overhead: float  # mean profiled step / timed step
    regime: str


def fieller_ratio_ci(num: ArrayLike, se_num: ArrayLike, den: ArrayLike, se_den: ArrayLike,
                     q_num: ArrayLike, q_den: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """Fieller's interval for num / den, two independent estimates, each error scaled by its
    own t quantile: the ratios R with (num - R·den)² <= q_num² se_num² + q_den² R² se_den².
    NaN where it is unbounded (den not clearly away from zero at this level). Vectorized."""
    a = np.square(den) - np.square(q_den) * np.square(se_den)
    b = np.multiply(num, den)
    c = np.square(num) - np.square(q_num) * np.square(se_num)
    disc = np.square(b) - a * c
    ok = (a > 0) & (disc >= 0)
    root = np.sqrt(np.where(ok, disc, 0.0))
    with np.errstate(divide="ignore", invalid="ignore"):
        low, high = (b - root) / a, (b + root) / a
    return np.where(ok, low, np.nan), np.where(ok, high, np.nan)


def t_quantile(df: ArrayLike, level: float) -> ArrayLike:
    return stats.t.ppf((1.0 + level) / 2.0, df)


def host_frac_ci_arrays(device_mean: ArrayLike, device_se: ArrayLike, device_df: ArrayLike, step: ArrayLike,
                        step_se: ArrayLike, step_df: ArrayLike, level: float) -> tuple[np.ndarray, np.ndarray]:
    """(low, high) of host_frac = 1 - device / step: Fieller on device / step, each error at its
    own degrees of freedom, turned around. (A Welch-Satterthwaite df instead undercovered at 3
    pairs, 0.936-0.944 for 0.95; this interval covers 0.97-0.98 from 3 to 8 pairs.) Vectorized."""
    low, high = fieller_ratio_ci(device_mean, device_se, step, step_se, t_quantile(device_df, level),
                                 t_quantile(step_df, level))
    # A fraction of the step lies in [0, 1]: the interval cut to it covers as often and reads
    # as what it is (with 3 pairs on a machine that changed speed it reached [-2.03, 2.25]).
    return np.clip(1.0 - high, 0.0, 1.0), np.clip(1.0 - low, 0.0, 1.0)


def mean_t_ci(values: Sequence[float], level: float) -> tuple[float, Optional[Interval], float]:
    """(mean, its t-interval or None below MIN_PAIRS_FOR_CI values, standard error)."""
    data = np.asarray(values, dtype=float)
    mean = float(data.mean())
    if data.size < MIN_PAIRS_FOR_CI:
        return mean, None, float("nan")
    se = float(data.std(ddof=1) / np.sqrt(data.size))
    half = float(stats.t.ppf((1.0 + level) / 2.0, data.size - 1)) * se
    return mean, (mean - half, mean + half), se


def regime_of(host_frac_ci: Optional[Interval], threshold: float) -> str:
    """host-bound when the whole CI is at or above the threshold, device-bound when all of it
    is below, undetermined when it straddles the threshold or there is no CI."""
    if host_frac_ci is None or not all(np.isfinite(host_frac_ci)):
        return UNDETERMINED
    low, high = host_frac_ci
    if low >= threshold:
        return HOST_BOUND
    return DEVICE_BOUND if high < threshold else UNDETERMINED


def split_stats(device_ms: Sequence[float], profiled_step_ms: Sequence[float], step: TimedStep,
                threshold: float) -> SplitStats:
    """The cell's split from its profiled pairs (one device and one profiled step value each)
    and its timed step."""
    if len(device_ms) != len(profiled_step_ms) or not device_ms:
        raise ValueError(f"split: need one device and one profiled step per pair, got {len(device_ms)} and "
                         f"{len(profiled_step_ms)}")
    n, level = len(device_ms), step.level
    device, device_ci, device_se = mean_t_ci(device_ms, level)
    profiled, profiled_ci, _ = mean_t_ci(profiled_step_ms, level)
    # A step at or below zero (noise swamping a tiny step) leaves no fraction: the split is then
    # impossible (host time < 0) and flagged so by the caller, not an error of the cell.
    if step.step_ms <= 0:
        nan = float("nan")
        return SplitStats(n, device, device_ci, step.step_ms - device, None, nan, None, profiled, profiled_ci, nan,
                          UNDETERMINED)
    host, host_frac = step.step_ms - device, 1.0 - device / step.step_ms
    host_ci = frac_ci = None
    if device_ci is not None:
        step_df = max(step.pairs - 1, 1)
        half = float(np.hypot(t_quantile(n - 1, level) * device_se, t_quantile(step_df, level) * step.se_ms))
        host_ci = (host - half, host + half)
        low, high = host_frac_ci_arrays(device, device_se, n - 1, step.step_ms, step.se_ms, step_df, level)
        frac_ci = (float(low), float(high)) if np.isfinite(low) and np.isfinite(high) else None
    return SplitStats(n, device, device_ci, host, host_ci, host_frac, frac_ci, profiled, profiled_ci,
                      profiled / step.step_ms, regime_of(frac_ci, threshold))


def implausible_checks(s: SplitStats, step: TimedStep, device_floor_ms: float,
                       forward_compute: Optional[tuple[float, Optional[Interval]]],
                       overhead_band: tuple[float, float]) -> tuple[str, ...]:
    """The IMPLAUSIBLE_CHECKS this split fails. Each compares against its noise: with CIs the
    whole interval must lie on the wrong side; without, the point does (the overhead: its
    range over both CIs, overhead_range, must lie outside the band).
    forward_compute: (compute ms inside the forward scope, its CI), when phases were taken."""
    failed = []
    device_high = s.device_ci[1] if s.device_ci is not None else s.device_ms
    if device_high < device_floor_ms * (1.0 - FLOOR_TOLERANCE):
        failed.append("device_below_floor")
    if forward_compute is not None:
        point, ci = forward_compute
        if (ci[1] if ci is not None else point) < 0:
            failed.append("forward_compute_negative")
    profiled_high = s.profiled_step_ci[1] if s.profiled_step_ci is not None else s.profiled_step_ms
    if profiled_high < step.ci_low_ms:
        failed.append("profiled_faster")
    low, high = overhead_band
    least, most = overhead_range(s, step)
    if most < low or least > high:
        failed.append("profiler_overhead")
    return tuple(failed)


def overhead_range(s: SplitStats, step: TimedStep) -> tuple[float, float]:
    """The profiler overhead's range over both CIs: the profiled step's (its point below 3
    pairs) over the timed step's. Unbounded above where the timed CI reaches 0."""
    p_low, p_high = s.profiled_step_ci if s.profiled_step_ci is not None else (s.profiled_step_ms,) * 2
    if step.ci_low_ms <= 0:
        return (p_low / step.ci_high_ms if step.ci_high_ms > 0 else float("-inf")), float("inf")
    return p_low / step.ci_high_ms, p_high / step.ci_low_ms
