"""What `slower` means (pure): the gate's two rules, the Holm-stepped level each cell is tested
at, and the interval a verdict is read from, so that a reader can check every verdict against
what is printed beside it.

- rule `significant` (the default, as asv's `compare --factor` and most CI benchmark gates
  read a change): the change is real (the one-sided test against no change, ratio 1.00,
  Holm over the judged cells at alpha) and its point estimate lies beyond the threshold.
- rule `margin`: sure the change is beyond the threshold (the one-sided test of ratio <=
  1 + t, Holm over the judged cells at alpha): stricter, it misses a true change just above
  the threshold about half the time or more.

The verdict interval: Holm compares a cell's p-value, ranked i-th smallest of m, with
alpha / (m - i + 1) and stops at the first it cannot reject. Each cell's lower bound is the
one-sided bound at the level Holm tested it at (the cells after the stop: the stop's level), so
the bound excludes the rule's null exactly when Holm rejects it; the upper bound likewise from
the faster family. A Student-t row's bound is d - t_(1-a, df) se; a paired-rounds row's the
order statistic its sign test inverts. All functions run over the last axis (cells), so the
simulations judge thousands of studies at once with the code the diff judges with.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
from scipy import stats

RULES = ("significant", "margin")
DEFAULT_RULE = "significant"


def null_pct(rule: str, threshold_pct: float) -> float:
    """Where the slower/faster tests put their null, in % beyond 1: 0 (no change) under
    `significant`, the threshold under `margin`."""
    if rule not in RULES:
        raise ValueError(f"rule={rule!r} is not allowed; allowed: {', '.join(RULES)}")
    return 0.0 if rule == "significant" else float(threshold_pct)


def slower_means(rule: str, threshold_pct: float, alpha: float) -> str:
    """The one sentence that says what `slower` means under `rule` (the gate line, the report
    and the MLflow run say it in these words; docs/diff.md states the same)."""
    t = f"{threshold_pct:g} %"
    if rule == "margin":
        return (f"rule margin: slower = sure the ratio is above 1 + {t} (its one-sided test of ratio <= 1 + {t}, Holm "
                f"over the judged cells, rejects at alpha {alpha:g}; the verdict interval lies wholly above "
                f"{1 + threshold_pct / 100:.2f})")
    return (f"rule significant: slower = the change is real (its one-sided test against no change, Holm over the "
            f"judged cells, rejects at alpha {alpha:g}: the verdict interval lies wholly above 1.00) and its ratio is "
            f"above 1 + {t}")


def holm_levels(p: np.ndarray, alpha: float) -> np.ndarray:
    """The one-sided level Holm tests each p-value at, over the last axis: alpha / (m - i) for
    the rank-i p-value (0-based) while every smaller one was rejected, and the level of the
    first not rejected for it and every later one. A p-value is rejected exactly when it is
    <= its level. NaN: not judged (not counted in m, level NaN)."""
    p = np.asarray(p, dtype=float)
    finite = np.isfinite(p)
    m = finite.sum(axis=-1, keepdims=True)
    order = np.argsort(np.where(finite, p, np.inf), axis=-1, kind="stable")
    ranked = np.take_along_axis(np.where(finite, p, np.inf), order, axis=-1)
    rank = np.arange(p.shape[-1])
    step = alpha / np.maximum(m - rank, 1)
    rejected = np.cumprod((ranked <= step) & (rank < m), axis=-1).astype(bool)
    stop = alpha / np.maximum(m - rejected.sum(axis=-1, keepdims=True), 1)
    out = np.empty_like(p)
    np.put_along_axis(out, order, np.where(rejected, step, stop), axis=-1)
    return np.where(finite, out, np.nan)


def t_bounds(d: np.ndarray, se: np.ndarray, df: np.ndarray, a_low: np.ndarray, a_high: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray]:
    """(lower, upper) one-sided bounds of a log ratio on a Student t reference: the lower at
    level 1 - a_low, the upper at 1 - a_high (NaN where a level is NaN)."""
    d, se, df = (np.asarray(x, dtype=float) for x in (d, se, df))
    with np.errstate(invalid="ignore"):
        return d - stats.t.isf(a_low, df) * se, d + stats.t.isf(a_high, df) * se


def sign_tail(n: int) -> np.ndarray:
    """P(B >= c) for c = 1..n, B ~ Binomial(n, 1/2): the sign test's p-value of c rounds on one
    side of the null (stats.sign_pvalues computes the same numbers)."""
    return stats.binom.sf(np.arange(n) , n, 0.5)


def sign_bounds(d: np.ndarray, a_low: np.ndarray, a_high: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(lower, upper) one-sided order-statistic bounds of the median of d (last axis: rounds)
    at levels 1 - a_low and 1 - a_high: the lower is the (n - c + 1)-th smallest d, c the
    fewest rounds above a null whose sign-test p-value is <= a_low, so the lower bound lies
    above a null exactly when the sign test rejects it there; -inf (+inf) when no count can."""
    d = np.sort(np.asarray(d, dtype=float), axis=-1)
    n = d.shape[-1]
    tail = sign_tail(n)

    def count(a: np.ndarray) -> np.ndarray:  # the fewest rounds c (1..n) with P(B >= c) <= a; n + 1: none
        a = np.nan_to_num(np.asarray(a, dtype=float), nan=-1.0)
        return np.searchsorted(-tail, -a, side="left") + 1

    c_low, c_high = count(a_low), count(a_high)
    low = np.take_along_axis(d, np.clip(n - c_low, 0, n - 1)[..., None], axis=-1)[..., 0]
    high = np.take_along_axis(d, np.clip(c_high - 1, 0, n - 1)[..., None], axis=-1)[..., 0]
    return np.where(c_low <= n, low, -np.inf), np.where(c_high <= n, high, np.inf)


def widened_sign_bounds(d: np.ndarray, a_low: np.ndarray, a_high: np.ndarray, variance: float | np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray]:
    """sign_bounds widened by a normal component of `variance` shared by every round (one engine
    instance a side: diff.instance_floor_pct): each bound's distance from the median of d and
    the normal's own quantile at that bound's level, added in quadrature. At the printed CI's
    level these are the printed CI (compare/rounds.widened); at Holm's levels they stay exact
    order statistics in the rounds' part, where a normal read from the 95 % CI would assume
    tails the rounds' medians need not have."""
    d = np.asarray(d, dtype=float)
    low, high = sign_bounds(d, a_low, a_high)
    centre = np.median(d, axis=-1)
    var = np.asarray(variance, dtype=float)
    z_low, z_high = (np.clip(np.nan_to_num(stats.norm.isf(np.asarray(a, dtype=float)), nan=0.0), 0.0, None)
                     for a in (a_low, a_high))
    return (centre - np.sqrt(np.clip(centre - low, 0.0, None) ** 2 + z_low ** 2 * var),
            centre + np.sqrt(np.clip(high - centre, 0.0, None) ** 2 + z_high ** 2 * var))


def rule_verdicts(d: np.ndarray, low: np.ndarray, high: np.ndarray, same: np.ndarray, rule: str,
                  threshold_pct: float) -> np.ndarray:
    """Verdicts read from the verdict interval [low, high] (log scale) and the point d: under
    `significant` slower when low > 0 and d > log(1 + t), faster the mirror; under `margin`
    slower when low > log(1 + t), faster when high < log(1 - t); `same` where `same` says
    (the equivalence test and the printed CI); else inconclusive."""
    d, low, high = (np.nan_to_num(np.asarray(x, dtype=float), nan=n) for x, n in
                    ((d, 0.0), (low, -np.inf), (high, np.inf)))
    up, down = math.log1p(threshold_pct / 100), math.log1p(-threshold_pct / 100)
    null_up, null_down = (0.0, 0.0) if rule == "significant" else (up, down)
    slower = (low > null_up) & (d > up)
    faster = (high < null_down) & (d < down)
    out = np.full(d.shape, "inconclusive", dtype=object)
    out[np.asarray(same, dtype=bool)] = "same"
    out[faster] = "faster"
    out[slower] = "slower"
    return out


def verdict_interval_label(level: Optional[float]) -> str:
    """How the verdict interval's level reads in a table header or line."""
    return "verdict interval (Holm-stepped one-sided bounds)" if level is None else \
        f"verdict interval (one-sided bounds at {1 - level:.4g})"


def same_shown(p_same: np.ndarray, alpha: float, ci_low: np.ndarray, ci_high: np.ndarray,
               threshold_pct: float) -> np.ndarray:
    """`same`: the equivalence test (TOST) rejects at alpha and the printed CI (ratio scale) lies
    inside [1 - t, 1 + t] (per cell: proving every cell the same is an intersection-union test,
    which needs no adjustment)."""
    t = threshold_pct / 100
    low, high = (np.nan_to_num(np.asarray(x, dtype=float), nan=n) for x, n in ((ci_low, -np.inf), (ci_high, np.inf)))
    return (np.nan_to_num(np.asarray(p_same, dtype=float), nan=1.0) <= alpha) & (low >= 1 - t) & (high <= 1 + t)


def judge_family(d: np.ndarray, p_slower: np.ndarray, p_faster: np.ndarray, same: np.ndarray, alpha: float,
                 rule: str, threshold_pct: float, bounds) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(verdicts, verdict interval low, high (log scale), the lower bound's one-sided level) of a
    family of cells (last axis): Holm's level for each cell in each direction (holm_levels of
    the rule's p-values), the bounds at those levels (`bounds(a_low, a_high)`: t_bounds or
    sign_bounds bound to the cells' data), the verdicts read from them (rule_verdicts)."""
    a_low, a_high = holm_levels(p_slower, alpha), holm_levels(p_faster, alpha)
    low, high = bounds(a_low, a_high)
    return rule_verdicts(d, low, high, same, rule, threshold_pct), low, high, a_low
