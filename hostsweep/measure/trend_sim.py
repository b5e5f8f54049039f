"""Simulated groups for the trend test's calibration (pure): the common speed per round of
a group whose cells share a machine speed that wanders as a stationary AR(1), with each
pair's own heavy-tailed noise (tests/unit/test_trend.py, benchmarks/trend_calibration.py)."""
from __future__ import annotations

import numpy as np


def ar1_speed(rho: float, rounds: int, groups: int, sd: float, rng: np.random.Generator) -> np.ndarray:
    """Log machine speed per round: stationary AR(1), marginal SD `sd`, one row a group."""
    z = rng.standard_normal((groups, rounds))
    out = np.empty_like(z)
    out[:, 0] = sd * z[:, 0]
    for t in range(1, rounds):
        out[:, t] = rho * out[:, t - 1] + sd * np.sqrt(1.0 - rho * rho) * z[:, t]
    return out


def common_speed(log_machine: np.ndarray, cells: int, pair_sd: float, rng: np.random.Generator) -> np.ndarray:
    """The group's common speed per round as measure/periods.common_trend makes it: the
    median over cells of each step over that cell's median, each pair with Student-t (3
    degrees of freedom) noise of about pair_sd."""
    groups, rounds = log_machine.shape
    noise = rng.standard_t(3, (groups, cells, rounds)) * pair_sd / np.sqrt(3.0)
    steps = np.exp(log_machine[:, None, :] + noise)
    return np.median(steps / np.median(steps, axis=2, keepdims=True), axis=1)
