"""The statistics of `stage=diff` (pure, vectorized over the last axis or over cells): each
side of a cell as a log-scale estimate with its variance and degrees of freedom, their
difference (the log of head/base), one-sided p-values for slower and faster, the
equivalence test (TOST) for `same`, Holm's step-down adjustment over the judged cells, and
the between-start component a one-start side is widened by.

Why log scale: a ratio's CI is symmetric there, variances of two independent sides add,
and a between-start spread quoted in % is a standard deviation of the log step.

- One engine start: the median of the log pairs (the log of the cell's median), its
  variance by the Maritz–Jarrett estimate (beta weights over the order statistics: smooth,
  no resampling, so no seed), n - 1 degrees of freedom.
- Several starts: intervals.between_starts_ci on the log pairs grouped by start (each
  start's median, a t-interval with k - 1 degrees of freedom, every start weighted equally);
  the variance is read back from the interval's half-width.
- A one-start side cannot see what changes between engine starts, so its variance gets a
  between-start component added (a stated noise floor, or the study's replicate-first
  re-measures); the degrees of freedom of a sum of variances by Welch–Satterthwaite.
- Paired (both sides of a cell measured in one sweep, their engine starts alternated A B,
  B A, ...: start pair i is side a's start i and side b's start i, adjacent in time): the
  log-ratio of each start pair's medians, d_i, then their mean with a t on k - 1 degrees of
  freedom; what the machine did to both starts of a pair cancels in d_i. The spread of each
  side's start medians, pooled over the paired cells, is the machine's between-start noise
  floor, which a sequential diff of two studies measured apart needs.
- Paired rounds (both sides' engines live in one worker, a cell's side-a pair and side-b pair
  timed back to back in every round): d_r = log(head_r / base_r) per round, the ratio
  exp(median d_r) and its CI the order statistics of the d_r (intervals.median_ci: exact
  coverage for any continuous distribution, no normality on the heavy-tailed per-round
  ratios); the p-values are the exact sign tests whose inversion that CI is, so the CI and the
  verdict say the same thing. What the machine did for the length of a round cancels in d_r.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Hashable, Optional, Sequence

import numpy as np
from scipy import special, stats

from hostsweep.compare.rules import (DEFAULT_RULE, judge_family, null_pct, same_shown, sign_tail, t_bounds,
                                     widened_sign_bounds)
from hostsweep.measure.intervals import between_starts_ci, median_ci_bounds

INF = math.inf


@dataclass(frozen=True)
class LogEstimate:
    """One side of one cell on log scale: estimate, variance, degrees of freedom, starts."""

    est: float
    var: float
    df: float
    starts: int
    pairs: int


@functools.lru_cache(maxsize=256)
def mj_weights(n: int) -> np.ndarray:
    """Maritz–Jarrett weights of the sorted values for the median's standard error: the
    probability mass of Beta(m - 1, n - m), m = floor(n/2 + 0.5), on each ((i-1)/n, i/n]."""
    m = int(n / 2 + 0.5)
    edges = stats.beta.cdf(np.arange(n + 1) / n, max(m - 1, 1e-9), max(n - m, 1e-9))
    return np.diff(edges)


def median_log(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(median, Maritz–Jarrett variance, n - 1 df) of log(values) over the last axis."""
    logs = np.sort(np.log(np.asarray(values, dtype=float)), axis=-1)
    n = logs.shape[-1]
    w = mj_weights(n)
    first, second = logs @ w, (logs ** 2) @ w
    return np.median(logs, axis=-1), np.maximum(second - first ** 2, 0.0), np.full(logs.shape[:-1], n - 1.0)


def start_medians_log(medians: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean, variance of the mean, k - 1 df) of log start medians over the last axis."""
    logs = np.log(np.asarray(medians, dtype=float))
    k = logs.shape[-1]
    return logs.mean(axis=-1), logs.var(axis=-1, ddof=1) / k, np.full(logs.shape[:-1], k - 1.0)


def side_estimate(groups: Sequence[np.ndarray], level: float) -> LogEstimate:
    """A side of a cell from its timed pairs grouped by engine start (one group: one start)."""
    groups = [np.asarray(g, dtype=float) for g in groups if len(g)]
    pairs = sum(g.size for g in groups)
    if len(groups) == 1:
        est, var, df = median_log(groups[0])
        return LogEstimate(float(est), float(var), float(df), 1, pairs)
    point, low, high = between_starts_ci([np.log(g) for g in groups], level)
    k = len(groups)
    se = (high - low) / (2 * stats.t.ppf(0.5 + level / 2, k - 1))
    return LogEstimate(point, float(se ** 2), k - 1.0, k, pairs)


def satterthwaite(variances: Sequence[np.ndarray], dfs: Sequence[np.ndarray]) -> np.ndarray:
    """Welch–Satterthwaite degrees of freedom of a sum of independent variance estimates
    (an infinite df: a variance taken as known)."""
    total = sum(np.asarray(v, dtype=float) for v in variances)
    parts = sum(np.where(np.isinf(d), 0.0, np.asarray(v, dtype=float) ** 2 / np.where(np.isinf(d), 1.0, d))
                for v, d in zip(variances, dfs))
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(parts > 0, total ** 2 / np.where(parts > 0, parts, 1.0), INF)


def widen(var: np.ndarray, df: np.ndarray, between_var: float, between_df: float) -> tuple[np.ndarray, np.ndarray]:
    """A one-start side's variance plus the between-start component, with its df."""
    return var + between_var, satterthwaite([var, np.full_like(np.asarray(var, float), between_var)],
                                            [df, np.full_like(np.asarray(df, float), between_df)])


def pvalues(d: np.ndarray, se: np.ndarray, df: np.ndarray, threshold_pct: float,
            null_pct: Optional[float] = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(p_slower, p_faster, p_same) for log-ratios d with standard errors se and df. p_slower
    tests H0 ratio <= 1 + n, p_faster H0 ratio >= 1 - n, n = null_pct/100 (rules.null_pct: 0
    under the `significant` rule; None: the threshold t, the `margin` rule's shifted null);
    p_same the equivalence test (TOST) of H0 ratio outside [1 - t, 1 + t], the larger of its
    two one-sided p-values."""
    d, se, df = (np.asarray(x, dtype=float) for x in (d, se, df))
    safe = np.where(se > 0, se, np.nan)
    null = threshold_pct if null_pct is None else null_pct
    p_slower = stats.t.sf((d - math.log1p(null / 100)) / safe, df)
    p_faster = stats.t.cdf((d - math.log1p(-null / 100)) / safe, df)
    up, down = math.log(1 + threshold_pct / 100), math.log(1 - threshold_pct / 100)
    p_same = np.maximum(stats.t.cdf((d - up) / safe, df), stats.t.sf((d - down) / safe, df))
    return p_slower, p_faster, p_same


def holm(p: np.ndarray) -> np.ndarray:
    """Holm's step-down adjusted p-values over the last axis (NaN: not judged, left NaN and
    not counted in the family): reject where adjusted <= alpha controls the family-wise
    error at alpha for any dependence between the cells."""
    p = np.asarray(p, dtype=float)
    finite = np.isfinite(p)
    m = finite.sum(axis=-1, keepdims=True)
    order = np.argsort(np.where(finite, p, np.inf), axis=-1)
    ranked = np.take_along_axis(np.where(finite, p, 1.0), order, axis=-1)  # the not judged sort last
    factor = m - np.arange(p.shape[-1])
    adjusted = np.minimum(np.maximum.accumulate(np.clip(ranked * factor, 0, 1), axis=-1), 1.0)
    out = np.empty_like(p)
    np.put_along_axis(out, order, adjusted, axis=-1)
    return np.where(finite, out, np.nan)


def ci(d: np.ndarray, se: np.ndarray, df: np.ndarray, level: float) -> tuple[np.ndarray, np.ndarray]:
    """The ratio's two-sided CI at `level` from the log-ratio's t reference."""
    q = stats.t.ppf(0.5 + level / 2, df)
    return np.exp(d - q * se), np.exp(d + q * se)


def pooled(variances: Sequence[float], dfs: Sequence[float]) -> tuple[float, float]:
    """Variance estimates pooled by their df (nan, 0 when there are none)."""
    parts = [(v, d) for v, d in zip(variances, dfs) if d > 0 and math.isfinite(v)]
    total = sum(d for _, d in parts)
    return (sum(v * d for v, d in parts) / total, total) if total else (math.nan, 0.0)


def pooled_per_group(keys: Sequence[Hashable], variances: Sequence[float], dfs: Sequence[float]) -> tuple[float, float]:
    """Variance estimates pooled with one entry per group (its cells' mean variance, its
    largest df): the cells of an engine group share its starts and periods, one machine move
    each, so they are one observation of the spread, not one per cell."""
    groups: dict[Hashable, list[tuple[float, float]]] = {}
    for key, v, d in zip(keys, variances, dfs):
        if math.isfinite(v) and math.isfinite(d):  # a cell that shows none does not speak for its group
            groups.setdefault(key, []).append((float(v), float(d)))
    return pooled([float(np.mean([v for v, _ in g])) for g in groups.values()],
                  [max(d for _, d in g) for g in groups.values()])


def replicate_component(step_ms: Sequence[float], replicate_step_ms: Sequence[float]) -> tuple[float, float]:
    """(variance, df) from replicate-first re-measures of cells that are alone in their engine
    group (a group's re-measure is of its first cell, and every cell of the group carries it,
    so only a group of one says whose it is): half the mean squared log difference, each
    difference holding two measures' noise (so it errs wide), one df per difference."""
    counts: dict[float, int] = {}
    for r in replicate_step_ms:
        if r is not None and math.isfinite(r):
            counts[r] = counts.get(r, 0) + 1
    pairs = [(s, r) for s, r in zip(step_ms, replicate_step_ms) if r is not None and math.isfinite(r)
             and counts[r] == 1 and s is not None and math.isfinite(s) and s > 0 and r > 0]
    if not pairs:
        return math.nan, 0.0
    d = np.log([r / s for s, r in pairs])
    return float(np.mean(d ** 2) / 2), float(len(pairs))


def side_arrays(pairs: np.ndarray, between_var: float = math.nan, between_df: float = math.inf
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(est, var, df) of many cells' sides at once: pairs shaped (..., k starts, n pairs).
    One start: median and Maritz–Jarrett variance, widened by the between-start component
    when it is known; several: the t on the starts' medians, as side_estimate does."""
    pairs = np.asarray(pairs, dtype=float)
    if pairs.shape[-2] == 1:
        est, var, df = median_log(pairs[..., 0, :])
        return (est, *widen(var, df, between_var, between_df)) if math.isfinite(between_var) else (est, var, df)
    return start_medians_log(np.median(pairs, axis=-1))


def paired_log_ratio(base_medians: np.ndarray, head_medians: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean d, its standard error, k - 1 df) of d_i = log(head_i) - log(base_i) over the last
    axis: the k start pairs' medians of the two sides of paired cells (start i of side a and
    start i of side b were adjacent in time, so what the machine did to both cancels in d_i).
    NaN where a median is not positive."""
    b, h = (np.asarray(m, dtype=float) for m in (base_medians, head_medians))
    with np.errstate(divide="ignore", invalid="ignore"):
        d = np.log(np.where(h > 0, h, np.nan)) - np.log(np.where(b > 0, b, np.nan))
    k = d.shape[-1]
    return d.mean(axis=-1), d.std(axis=-1, ddof=1) / math.sqrt(k), np.full(d.shape[:-1], k - 1.0)


def start_spread(medians: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(variance, k - 1 df) of the log start medians of one side of a cell, over the last axis:
    how far one engine start's step lies from the next's on this machine."""
    logs = np.log(np.asarray(medians, dtype=float))
    return logs.var(axis=-1, ddof=1), np.full(logs.shape[:-1], logs.shape[-1] - 1.0)


def noise_floor_pct(variance: float) -> float:
    """A between-start variance of the log step as the SD in % that diff.noise_floor_pct takes."""
    return math.expm1(math.sqrt(variance)) * 100 if math.isfinite(variance) and variance >= 0 else math.nan


def rounds_log_ratio(base: np.ndarray, head: np.ndarray, level: float
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """(median d, its CI's low and high, the CI's exact coverage) of d_r = log(head_r) - log(base_r)
    over the last axis: the two sides' pairs of paired cells, matched round by round (timed back
    to back, so what the machine did to both cancels in d_r). The CI is the order-statistic
    interval of the median (intervals.median_ci_bounds): its coverage, which depends on the
    number of rounds only, is exact for any continuous distribution of d_r; below the level
    asked for when the rounds are too few (the caller reports it)."""
    d = np.log(np.asarray(head, dtype=float)) - np.log(np.asarray(base, dtype=float))
    low, high, coverage = median_ci_bounds(d, level)
    return np.median(d, axis=-1), low, high, coverage


def sign_pvalues(d: np.ndarray, threshold_pct: float, null_pct: Optional[float] = None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(p_slower, p_faster, p_same) of per-round log ratios d (last axis) by exact sign tests,
    the tests whose inversion is the order-statistic CI of their median, with the null shifted
    to the threshold t: p_slower tests H0 median <= log(1 + t) (the chance of at least this
    many d_r above it among n, Binomial(n, 1/2)), p_faster the mirror at log(1 - t), p_same the equivalence test (TOST) of H0 median outside
    [log(1 - t), log(1 + t)], the larger of its two one-sided p-values. A d_r exactly on a
    bound counts against rejecting: conservative with ties, exact without."""
    d = np.asarray(d, dtype=float)
    n = d.shape[-1]

    def at_least(count: np.ndarray) -> np.ndarray:  # P(B >= count), B ~ Binomial(n, 1/2)
        return stats.binom.sf(count - 1, n, 0.5)

    up, down = math.log(1 + threshold_pct / 100), math.log(1 - threshold_pct / 100)
    null = threshold_pct if null_pct is None else null_pct  # pvalues' null_pct
    p_slower = at_least((d > math.log1p(null / 100)).sum(axis=-1))
    p_faster = at_least((d < math.log1p(-null / 100)).sum(axis=-1))
    p_same = np.maximum(at_least((d < up).sum(axis=-1)), at_least((d > down).sum(axis=-1)))
    return p_slower, p_faster, p_same


def _p_median_above(values: np.ndarray, x: float, variance: float) -> np.ndarray:
    """The p-value of H0 median <= x for rounds widened by `variance` (widened_sign_pvalues):
    over every count c, the c-th largest value's widened lower bound clears x from the level
    max(P(B >= c), the normal's share) on; 1 where the median is not above x."""
    return _p_ranked_above(-np.sort(-values, axis=-1), np.median(values, axis=-1, keepdims=True), x, variance)


def _p_ranked_above(ranked: np.ndarray, centre: np.ndarray, x: float, variance: float) -> np.ndarray:
    """_p_median_above from the values sorted largest first and their median (keepdims): a
    shift of every value shifts both, so sign_mde_pct sorts its draws once, not once a shift."""
    tail = sign_tail(ranked.shape[-1])  # P(B >= c) for c = 1..n
    level = tail
    if variance > 0:  # without a floor the normal's share is 0: the sign test's own levels
        room = (centre - x) ** 2 - np.clip(centre - ranked, 0.0, None) ** 2
        # ndtr(-z) is norm.sf(z) without the distribution object's overhead (most of an MDE's cost)
        level = np.maximum(tail, special.ndtr(-np.sqrt(np.clip(room, 0.0, None) / variance)))
    p = np.where((ranked > x) & (centre > x), level, 1.0)
    return p.min(axis=-1)


def widened_sign_pvalues(d: np.ndarray, threshold_pct: float, null_pct: Optional[float], variance: float
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """sign_pvalues for rounds widened by an instance floor (`variance`, log scale): each
    p-value the smallest one-sided level at which rules.widened_sign_bounds lies beyond the
    null, so that a cell is rejected at Holm's level exactly when its widened bound at that
    level says so. Exact in the rounds' part (a count c of rounds beyond the null is reached
    at P(B >= c)); a p-value over 1/2, which decides nothing, is given as 1. Variance 0: the
    sign test itself (sign_pvalues)."""
    if variance <= 0:
        return sign_pvalues(d, threshold_pct, null_pct)
    d = np.asarray(d, dtype=float)
    null = threshold_pct if null_pct is None else null_pct
    up, down = math.log(1 + threshold_pct / 100), math.log(1 - threshold_pct / 100)
    return (_p_median_above(d, math.log1p(null / 100), variance),
            _p_median_above(-d, -math.log1p(-null / 100), variance),
            np.maximum(_p_median_above(-d, -up, variance), _p_median_above(d, down, variance)))


def sign_mde_pct(d: Sequence[float], variance: float, level: float, threshold_pct: float, rule: str = DEFAULT_RULE,
                 power: float = 0.8, draws: int = 1000, seed: int = 0) -> float:
    """The MDE (%) of a rounds cell under the test it is judged by (the sign test, widened by
    `variance` when floored), one-sided at `level` (Holm's first step, alpha / cells): the
    smallest shift its test finds `power` of the time when the rounds scatter as this cell's
    do (its d_r about their median, resampled) and each study draws its own instance effect
    (normal, `variance`). Common random numbers make the found share rise with the shift, so
    a bisection settles it; inf when even a doubling up to +500 % is not found. A normal read
    off the CI overstated the sign test's power at 12 rounds about twofold."""
    d = np.asarray(d, dtype=float)
    if d.size == 0 or not np.isfinite(d).all():
        return math.nan
    rng = np.random.default_rng(seed)
    resid = d - np.median(d)
    sample = resid[rng.integers(0, d.size, (draws, d.size))]
    # A smoothed bootstrap (variance kept): a plain one never draws beyond the most extreme of
    # the cell's rounds, and at 12 rounds that tail is what the sign test's power turns on.
    sd = float(np.std(resid, ddof=1)) if d.size > 1 else 0.0
    spread = min(sd, float(stats.iqr(resid)) / 1.349)  # Silverman's robust spread
    if spread > 0:
        h = 1.06 * spread * d.size ** -0.2
        sample = (sample + rng.normal(0.0, h, sample.shape)) / math.sqrt(1 + (h / sd) ** 2)
    if variance > 0:
        sample = sample + rng.normal(0.0, math.sqrt(variance), (draws, 1))
    null, point = math.log1p(null_pct(rule, threshold_pct) / 100), math.log1p(threshold_pct / 100)

    ranked, centre = -np.sort(-sample, axis=-1), np.median(sample, axis=-1, keepdims=True)

    def found(shift: float) -> bool:
        hit = _p_ranked_above(ranked + shift, centre + shift, null, variance) <= level
        if rule != "margin":  # significant: a real change whose estimate is beyond the threshold
            hit &= centre[:, 0] + shift > point
        return float(hit.mean()) >= power

    low, high = 0.0, 0.05
    while not found(high):
        low, high = high, high * 2
        if high > math.log(6.0):
            return math.inf
    for _ in range(20):  # to within 2e-6 on the log scale: the MDE is printed to 0.001 %
        middle = (low + high) / 2
        low, high = (low, middle) if found(middle) else (middle, high)
    return math.expm1(high) * 100


def judge_rounds(base: np.ndarray, head: np.ndarray, threshold_pct: float, alpha: float,
                 level: float = 0.95, rule: str = DEFAULT_RULE, instance_var: float = 0.0) -> np.ndarray:
    """The verdicts compare/verdicts.py gives paired-rounds cells, for many simulated studies at
    once: base and head shaped (studies, cells, rounds), round r of base and of head timed back
    to back; Holm over each study's cells under `rule` (rules.py). instance_var > 0: each cell's
    sign tests and bounds widened by it (widened_sign_pvalues, rules.widened_sign_bounds), as
    compare/verdicts.py judges with diff.instance_floor_pct; else the exact sign tests."""
    d = np.log(np.asarray(head, dtype=float)) - np.log(np.asarray(base, dtype=float))
    median, low, high, _ = rounds_log_ratio(base, head, level)
    null = null_pct(rule, threshold_pct)
    slower, faster, same = widened_sign_pvalues(d, threshold_pct, null, instance_var)
    if instance_var > 0:
        z = stats.norm.ppf(0.5 + level / 2)
        low = median - np.sqrt((median - low) ** 2 + z * z * instance_var)
        high = median + np.sqrt((high - median) ** 2 + z * z * instance_var)
    bounds = lambda a, b: widened_sign_bounds(d, a, b, instance_var)  # noqa: E731
    shown = same_shown(same, alpha, np.exp(low), np.exp(high), threshold_pct)
    return judge_family(median, slower, faster, shown, alpha, rule, threshold_pct, bounds)[0]


def judge_arrays(base: np.ndarray, head: np.ndarray, threshold_pct: float, alpha: float,
                 between_var: float = math.nan, between_df: float = math.inf, paired: bool = False,
                 level: float = 0.95, rule: str = DEFAULT_RULE) -> np.ndarray:
    """The verdicts compare/verdicts.py gives, for many simulated studies at once: base and head
    shaped (studies, cells, k starts, n pairs); Holm over each study's cells under `rule`
    (rules.py); `same` agreeing with the cell's printed CI at level. paired: start i of base and
    start i of head form a start pair (a paired sweep's cells, k >= 2). Sequential one-start
    sides with no between-start component are inconclusive, whatever their pairs say
    (cellwise does the same)."""
    if paired:
        d, se, df = paired_log_ratio(np.median(base, axis=-1), np.median(head, axis=-1))
    else:
        if min(np.shape(base)[-2], np.shape(head)[-2]) == 1 and not math.isfinite(between_var):
            return np.full(np.shape(base)[:-2], "inconclusive", dtype=object)
        (eb, vb, fb), (eh, vh, fh) = side_arrays(base, between_var, between_df), \
            side_arrays(head, between_var, between_df)
        d, se = eh - eb, np.sqrt(vb + vh)
        df = satterthwaite([vb, vh], [fb, fh])
    slower, faster, same = pvalues(d, se, df, threshold_pct, null_pct(rule, threshold_pct))
    low, high = ci(d, se, df, level)
    shown = same_shown(same, alpha, low, high, threshold_pct)
    return judge_family(d, slower, faster, shown, alpha, rule, threshold_pct,
                        lambda a, b: t_bounds(d, se, df, a, b))[0]
