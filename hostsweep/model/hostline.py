"""H(N) = s0 + s1·(N − 1) fitted to measured host times, bounded to H >= 0 over the batches
it serves, with a bootstrap CI on s0 and s1 (pure, vectorized).

A line is >= 0 on [N_lo, N_hi] exactly when it is >= 0 at both ends, so the fit is done in
the line's end values h_lo = H(N_lo), h_hi = H(N_hi) with box bounds h >= 0: bounded least
squares as for the host forms (hostforms.py, `scipy.optimize.lsq_linear`), here on
absolute residuals (a host time can measure near or below zero; relative ones would blow
up). N_lo is 1, so s0 = H(1) is itself a physical time, and N_hi the largest batch served.
Unbounded, a noisy host residual gave H(N) = 5.969 − 2.296·(N−1) ms: negative from N = 4.

The CI is a residual bootstrap over the cells (each resample refitted under the same
bounds, so it never leaves them), read as Hesterberg's expanded percentile interval: the
percentile level widened so that z = sqrt(n / (n − 2))·t(n − 2), which corrects the
bootstrap's narrowness with few cells. Two cells leave no residual: no CI.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import lsq_linear
from scipy.stats import norm, t as student_t

from hostsweep.model.fit import HostFit

PARAMS = 2


def endpoint_design(batch: np.ndarray, low: float, high: float) -> np.ndarray:
    """Columns multiplying (H(low), H(high)): H(N) = h_lo·(1 − u) + h_hi·u, u = (N − low)/(high − low)."""
    u = (np.asarray(batch, float) - low) / (high - low)
    return np.column_stack([1.0 - u, u])


def nnls2(design: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """min ||design·x − y||² with x >= 0 for every row y of `targets` (R × n) at once, for a
    two-column design: the best of the unconstrained solution (when feasible), each
    column alone clipped at 0, and 0 — the KKT candidates of a convex problem."""
    gram = design.T @ design
    rhs = np.atleast_2d(targets) @ design  # R × 2
    free = np.linalg.solve(gram, rhs.T).T
    only = [np.column_stack([np.maximum(rhs[:, 0] / gram[0, 0], 0), np.zeros(len(rhs))]),
            np.column_stack([np.zeros(len(rhs)), np.maximum(rhs[:, 1] / gram[1, 1], 0)])]
    candidates = [free, *only]

    def objective(x: np.ndarray) -> np.ndarray:
        value = np.einsum("ri,ij,rj->r", x, gram, x) - 2 * np.einsum("ri,ri->r", x, rhs)
        return np.where((x >= 0).all(axis=1), value, np.inf)

    best = np.argmin(np.vstack([objective(c) for c in candidates]), axis=0)
    return np.stack(candidates)[best, np.arange(len(rhs))]


def _line(ends: np.ndarray, low: float, high: float) -> tuple[np.ndarray, np.ndarray]:
    """(s0, s1) of the lines through (low, h_lo) and (high, h_hi)."""
    ends = np.atleast_2d(ends)
    slope = (ends[:, 1] - ends[:, 0]) / (high - low)
    return ends[:, 0] - slope * (low - 1.0), slope


@dataclass(frozen=True)
class BoundedLine:
    """H(N) in ms, bounded to >= 0 on batches [low, high], with 95% CIs (NaN: none)."""

    s0_ms: float
    s1_ms: float
    s0_ci_ms: tuple[float, float]
    s1_ci_ms: tuple[float, float]
    low: float
    high: float
    at_bound: tuple[str, ...]  # "H(N_lo)", "H(N_hi)": the ends the bound holds at 0
    unbounded_s0_ms: float
    unbounded_s1_ms: float
    cells: int
    resamples: int

    @property
    def host(self) -> HostFit:
        return HostFit(self.s0_ms * 1e-3, self.s1_ms * 1e-3)

    def at_batches_ms(self, batch: np.ndarray) -> np.ndarray:
        return self.s0_ms + self.s1_ms * (np.asarray(batch, float) - 1.0)


def _expanded_level(cells: int, level: float = 0.95) -> float:
    """The percentile coverage whose normal quantile is sqrt(n/(n−p))·t(n−p) (Hesterberg 2015)."""
    dof = cells - PARAMS
    widened = np.sqrt(cells / dof) * student_t.ppf(0.5 + level / 2, dof)
    return float(2 * norm.cdf(widened) - 1)


def fit_bounded_line(batch: np.ndarray, host_ms: np.ndarray, served: np.ndarray | None = None,
                     resamples: int = 2000, seed: int = 0) -> BoundedLine:
    """H(N) = s0 + s1·(N−1) with H >= 0 from N = 1 to the largest batch of `served` and the
    measured cells, and the residual-bootstrap 95% CI of s0 and s1."""
    batch, host_ms = np.asarray(batch, float), np.asarray(host_ms, float)
    if np.unique(batch).size < 2:
        raise ValueError("H(N) needs host times at two or more batch sizes")
    low = 1.0
    high = float(max(batch.max(), np.max(served) if served is not None and len(served) else batch.max()))
    design = endpoint_design(batch, low, high)
    ends = lsq_linear(design, host_ms, bounds=(0.0, np.inf), method="bvls").x
    ends = np.maximum(ends, 0.0)
    s0, s1 = (float(v[0]) for v in _line(ends, low, high))
    slope, intercept = np.polyfit(batch - 1.0, host_ms, 1)
    # the bound is active where the end sits at 0 and the data pull it lower
    free = np.linalg.lstsq(design, host_ms, rcond=None)[0]
    at_bound = tuple(name for name, end, want in zip(("H(N_lo)", "H(N_hi)"), ends, free) if end <= 0 and want < 0)
    s0_ci = s1_ci = (float("nan"), float("nan"))
    if batch.size > PARAMS and resamples > 0:
        fitted = design @ ends
        residual = host_ms - fitted
        rng = np.random.default_rng(seed)
        drawn = fitted + residual[rng.integers(0, batch.size, size=(resamples, batch.size))]
        s0_draws, s1_draws = _line(nnls2(design, drawn), low, high)
        tail = (1 - _expanded_level(batch.size)) / 2 * 100
        s0_ci = tuple(float(v) for v in np.percentile(s0_draws, [tail, 100 - tail]))
        s1_ci = tuple(float(v) for v in np.percentile(s1_draws, [tail, 100 - tail]))
    return BoundedLine(s0, s1, s0_ci, s1_ci, low, high, at_bound, float(intercept), float(slope),
                       int(batch.size), resamples if batch.size > PARAMS else 0)
