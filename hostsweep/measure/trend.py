"""Did a group's cells move together over its rounds? A step test that holds its level
when the machine's speed is autocorrelated (pure).

The series is the group's common speed per round (measure/periods.common_trend: the
median over cells of each step over its period median). Its two halves are compared by
two t-like pivots on log speed, and the larger is read: the least-squares slope over its
standard error (a ramp) and the difference of the halves' means over its standard error (a
step), each with the residual SD of its own fit (trend_pivot).

A t-test reads that pivot as if rounds were independent. On a cloud VM they are not: the
machine's speed wanders and round k+1 resembles round k. Under a stationary AR(1) speed
(SD 10 %, 6 cells, 12 rounds) the old Yuen test on the halves fired in 13 % of steady
groups at rho = 0.5 and 29 % at rho = 0.9, against the 5 % it states. With 12 rounds an
autocorrelation cannot be estimated well enough to correct for (rho-hat from 12 points is
biased low by about (1 + 3 rho) / 6 and a plug-in correction still fired 21-35 %), so the
critical value here is the least favourable one: the largest (1 - alpha) quantile of the
pivot over stationary Gaussian AR(1) series with rho in [0, MAX_RHO], found by simulation
(seeded: the same n and level give the same value on every machine). The test then holds
alpha for every rho up to MAX_RHO, whatever rho the machine has. Its price is power, and
the price is steep at 12 rounds: with 2 % round-to-round noise, a 30 % ramp over the
rounds is found about 80 % of the time and a 20 % step about 85 %, a 10 % step about 10 %;
with 5 % noise, 15-25 %. (A confidence bound on rho, Berger and Boos' remedy, does not
help here: the residual autocorrelation of 12 rounds is biased so far below rho that its
bound covers the whole grid.) The common shift (DesignRecord.common_shift_pct) is
reported whatever the test says; tests/unit/test_trend.py measures level and power, and
benchmarks/trend_calibration.py prints the table.

The test is only half of a `group_trend` annotation: the medians of the halves must also
differ by more than measure.min_shift_pct (measure/group.py).
"""
from __future__ import annotations

import functools
from typing import Sequence

import numpy as np

# The autocorrelations the level is held for: a machine whose speed is more persistent
# than this over a group's rounds is indistinguishable from one that stepped.
MAX_RHO = 0.9
RHO_GRID = tuple(float(r) for r in np.linspace(0.0, MAX_RHO, 10))
SIMULATED_SERIES = 20_000  # per rho: the 95 % quantile to about +-1.5 % of itself
MIN_ROUNDS = 6  # 3 rounds a half: fewer leave the residual SD with too few degrees of freedom


def trend_pivot(log_speed: np.ndarray) -> np.ndarray:
    """The larger of two t-like pivots over the last axis (rounds, in the order they ran):
    the least-squares slope over its standard error (a ramp), and the difference of the
    halves' means over its standard error (a step), each with the residual SD of its own
    fit. A machine that sped up gradually and one that stepped are both caught."""
    x = np.asarray(log_speed, dtype=float)
    n = x.shape[-1]
    t = np.arange(n) - (n - 1) / 2.0
    slope = (x * t).sum(-1) / (t * t).sum()
    ramp_residual = x - x.mean(-1, keepdims=True) - slope[..., None] * t
    h = n // 2
    first, second = x[..., :h], x[..., h:]
    step_residual = np.concatenate([first - first.mean(-1, keepdims=True),
                                    second - second.mean(-1, keepdims=True)], -1)
    ramp = _ratio(np.abs(slope) * np.sqrt((t * t).sum()), ramp_residual, n)
    step = _ratio(np.abs(second.mean(-1) - first.mean(-1)) / np.sqrt(1.0 / h + 1.0 / (n - h)), step_residual, n)
    return np.maximum(ramp, step)


def _ratio(effect: np.ndarray, residual: np.ndarray, n: int) -> np.ndarray:
    sd = np.sqrt((residual ** 2).sum(-1) / (n - 2))
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(sd > 0, effect / sd, np.where(effect > 1e-12, np.inf, 0.0))


def _ar1(rho: float, n: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """`count` stationary Gaussian AR(1) series of length n, unit marginal variance."""
    z = rng.standard_normal((count, n))
    out = np.empty_like(z)
    out[:, 0] = z[:, 0]
    for t in range(1, n):
        out[:, t] = rho * out[:, t - 1] + np.sqrt(1.0 - rho * rho) * z[:, t]
    return out


@functools.lru_cache(maxsize=256)
def critical_pivot(n: int, alpha: float) -> float:
    """The least favourable (1 - alpha) quantile of step_pivot over AR(1) series of n rounds
    with rho in RHO_GRID (the pivot does not depend on the speed's scale)."""
    if n < MIN_ROUNDS:
        raise ValueError(f"a trend test needs at least {MIN_ROUNDS} rounds, got {n}")
    rng = np.random.default_rng(n)
    return float(max(np.quantile(trend_pivot(_ar1(rho, n, SIMULATED_SERIES, rng)), 1.0 - alpha) for rho in RHO_GRID))


def stepped(speed: Sequence[float], alpha: float) -> bool:
    """Whether the second half of the rounds ran at another speed than the first, at level
    alpha for any stationary AR(1) speed with rho <= MAX_RHO (False below MIN_ROUNDS)."""
    values = np.asarray(speed, dtype=float)
    if len(values) < MIN_ROUNDS or np.any(values <= 0):
        return False
    return bool(trend_pivot(np.log(values)) > critical_pivot(len(values), round(alpha, 12)))
