"""Confidence intervals and tests whose coverage is stated, for the cell statistics (pure).

Every function here works on plain numbers, vectorized along the last axis where a
simulation needs it (benchmarks/gate_calibration.py, tests/unit/test_coverage.py measure
their coverage over thousands of simulated cells):

    median_ci            the median of one start's pairs: order statistics, exact for any
                         continuous distribution (a binomial count, no resampling)
    between_starts_ci    the step across engine starts: a t-interval on the starts' medians,
                         k - 1 degrees of freedom, each start weighted equally
    shift_pvalue         two samples of one cell (the halves of its pairs, or a cell and its
                         replicate): Yuen's test on 25 %-trimmed means, which one outlier
                         pair per sample does not defeat
    look_level           adaptive repetitions: the level each planned look's CI is taken at,
                         so that stopping at any look keeps the overall coverage (the error
                         split across the looks, computed exactly)
    seed_for             a seed of its own for each cell (and engine start), from its key

No resampling remains in the cell statistics, so no seed decides a cell's CI or verdict.
"""
from __future__ import annotations

import functools
import hashlib
import warnings
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
from scipy import stats

# Below this many engine starts the between-start spread rests on one degree of freedom
# (t = 12.7 at 95 %): the interval is honest but very wide, and says so.
MIN_STARTS = 3
# Yuen's test trims this share of each sample's ends: 1 of 4 to 7 pairs, 3 of 12.
TRIM = 0.25
ALTERNATIVES = ("two-sided", "less", "greater")


@dataclass(frozen=True)
class MedianCI:
    """An order-statistic CI of a median: [X(lower_rank), X(upper_rank)] of the sorted values."""

    low: float
    high: float
    coverage: float  # the exact probability that the interval holds the true median
    level: float  # the level asked for

    @property
    def below_level(self) -> bool:
        """Too few values for any order-statistic interval to reach the level asked for."""
        return self.coverage < self.level


def median_ci_ranks(n: int, level: float) -> tuple[int, int, float]:
    """1-based ranks (l, u) of the narrowest equal-tailed interval [X(l), X(u)], u = n + 1 - l,
    that holds the median of any continuous distribution with probability >= level, and that
    probability: 1 - 2 * P(B <= l - 1), B ~ Binomial(n, 1/2) the count of values below the
    median. Each end misses with at most (1 - level) / 2, so either end alone is a one-sided
    bound at (1 + level) / 2. The achievable levels are discrete: at 95 % and n = 8 only
    [min, max] reaches it (99.2 %), at n = 12 it is [X(3), X(10)] (96.1 %). When even
    [min, max] falls short (1 - 2^(1-n) < level: n < 6 at 95 %), (1, n) is returned with its
    lower coverage, which the caller must report instead of the level."""
    if n < 1:
        raise ValueError(f"n must be >= 1 for a median CI, got {n}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    ranks = np.arange(1, (n + 1) // 2 + 1)
    coverage = 1.0 - 2.0 * stats.binom.cdf(ranks - 1, n, 0.5)
    reach = np.nonzero(coverage >= level - 1e-12)[0]
    pick = int(reach[-1]) if reach.size else 0
    return int(ranks[pick]), n + 1 - int(ranks[pick]), float(coverage[pick])


def median_ci_bounds(samples: np.ndarray, level: float) -> tuple[np.ndarray, np.ndarray, float]:
    """median_ci over the last axis of `samples` (one row per simulated cell): low, high and
    the exact coverage, which depends on n only."""
    data = np.sort(np.asarray(samples, dtype=float), axis=-1)
    low_rank, high_rank, coverage = median_ci_ranks(data.shape[-1], level)
    return data[..., low_rank - 1], data[..., high_rank - 1], coverage


def median_ci(values: Sequence[float], level: float) -> MedianCI:
    """The distribution-free CI of the median of `values` (median_ci_ranks says which)."""
    data = np.asarray(values, dtype=float)
    if data.ndim != 1 or data.size == 0:
        raise ValueError("values must be a non-empty 1-D sequence for a median CI")
    low, high, coverage = median_ci_bounds(data, level)
    return MedianCI(float(low), float(high), coverage, level)


def t_interval_bounds(values: np.ndarray, level: float,
                      alternative: str = "two-sided") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean, low, high) over the last axis: Student's t-interval with n - 1 degrees of
    freedom (scipy.stats.ttest_1samp). "greater" gives [low, inf), "less" (-inf, high]."""
    if alternative not in ALTERNATIVES:
        raise ValueError(f"alternative must be one of {ALTERNATIVES}, got {alternative!r}")
    data = np.asarray(values, dtype=float)
    if data.shape[-1] < 2:
        raise ValueError(f"a t-interval needs >= 2 values, got {data.shape[-1]}")
    with warnings.catch_warnings():  # identical values: a zero-width interval, not a warning
        warnings.simplefilter("ignore", RuntimeWarning)
        ci = stats.ttest_1samp(data, 0.0, axis=-1, alternative=alternative).confidence_interval(level)
    mean = data.mean(axis=-1)
    same = np.all(data == data[..., :1], axis=-1)  # scipy's nan for zero spread: the interval is the point
    low = np.where(same & (alternative != "less"), mean, ci.low)
    high = np.where(same & (alternative != "greater"), mean, ci.high)
    return mean, low, high


def between_starts_ci(groups: Sequence[Sequence[float]], level: float,
                      alternative: str = "two-sided") -> tuple[float, float, float]:
    """(point, low, high) of a cell's step across engine starts: each start reduced to the
    median of its pairs, then a t-interval on those k medians with k - 1 degrees of freedom.
    Every start weighs the same whatever its pair count. The point is the mean of the start
    medians, the centre the interval is built around (the median of the start medians would
    sit off-centre and is not what the interval covers). Needs >= 2 starts; below MIN_STARTS
    it is honest but wide (few_starts_warning says so)."""
    medians = [float(np.median(g)) for g in groups if len(g)]
    if len(medians) < 2:
        raise ValueError(f"groups must hold >= 2 non-empty engine starts, got {len(medians)}")
    point, low, high = t_interval_bounds(np.array(medians), level, alternative)
    return float(point), float(low), float(high)


def few_starts_warning(starts: int) -> Optional[str]:
    """One line to show when a between-start CI rests on fewer than MIN_STARTS starts."""
    if starts >= MIN_STARTS:
        return None
    if starts <= 1:
        return "one engine start: the CI covers pair-to-pair noise only, not what changes between starts"
    return (f"{starts} engine starts: the between-start CI has {starts - 1} degree(s) of freedom and is wide; "
            f"measure.replicates (or, paired, pair.starts) >= {MIN_STARTS} narrows it")


def shift_pvalue(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Two-sided p-value that samples a and b (last axis) differ in location: Yuen's test on
    TRIM-trimmed means (scipy.stats.ttest_ind, trim=TRIM, Welch's degrees of freedom). The
    trim drops the most extreme pair of each end of a sample of 4 or more, so one outlier pair
    neither hides a shift nor makes one. Two constant, equal samples give nan (no evidence)."""
    with warnings.catch_warnings():  # near-identical values: scipy warns of precision loss
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.asarray(stats.ttest_ind(a, b, axis=-1, trim=TRIM, equal_var=False).pvalue)


def _reports(n: int, each: float, last: bool) -> bool:
    """Whether a look at n pairs can report a CI at `each` (the last look always does)."""
    return last or median_ci_ranks(n, each)[2] >= each - 1e-12


def any_look_misses(looks: Sequence[int], each: float) -> float:
    """The exact probability that the median CI (at `each`) of at least one reporting look
    misses the true median. The count of pairs below the median is a fair binomial walk for
    any continuous noise, so this is distribution-free: a walk over the counts, with the
    probability of the counts outside each look's ranks taken out as it goes."""
    counts = np.zeros(looks[-1] + 1)
    counts[0] = 1.0
    missed, taken = 0.0, 0
    for i, n in enumerate(looks):
        for _ in range(n - taken):  # one more pair: below the median or not, 1/2 each
            counts[1:] = 0.5 * (counts[1:] + counts[:-1])
            counts[0] *= 0.5
        taken = n
        if _reports(n, each, i == len(looks) - 1):
            low_rank, high_rank, _ = median_ci_ranks(n, each)
            outside = np.r_[np.arange(low_rank), np.arange(high_rank, n + 1)]
            missed += counts[outside].sum()
            counts[outside] = 0.0
    return float(missed)


@functools.lru_cache(maxsize=64)
def _look_level(level: float, looks: tuple[int, ...]) -> float:
    low, high = level, 1.0 - 1e-9
    for _ in range(60):  # bisection: a higher per-look level never misses more often
        mid = (low + high) / 2.0
        low, high = (low, mid) if any_look_misses(looks, mid) <= 1.0 - level else (mid, high)
    return high


def look_level(level: float, looks: Sequence[int]) -> float:
    """The level every planned look (pair counts, ascending) takes its median CI at, so that
    the CI reported at whichever look a cell stops covers the median with probability
    >= level: the lowest per-look level at which the chance that any reporting look misses
    is <= 1 - level (any_look_misses, exact). It splits the error across the looks like
    Bonferroni does, without Bonferroni's slack for looks that miss together."""
    looks = tuple(looks)
    if not looks or list(looks) != sorted(set(looks)) or looks[0] < 1:
        raise ValueError(f"looks must be ascending pair counts >= 1, got {looks}")
    return level if len(looks) == 1 else _look_level(level, looks)


def sequential_coverage(looks: Sequence[int], level: float) -> float:
    """A lower bound on the coverage of the CI reported after stopping at one of `looks`:
    1 - any_look_misses at the looks' level. For one look it is that look's exact coverage
    (below `level` when even [min, max] falls short)."""
    looks = tuple(looks)
    return 1.0 - any_look_misses(looks, look_level(level, looks))


def seed_for(key: str, seed: int, start: int = 0) -> int:
    """A reproducible 63-bit seed for one cell (and engine start): the study's seed mixed
    with a hash of the cell key, so cells never share random draws and a cell keeps its own
    whatever other cells a filter selects."""
    digest = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return int(np.random.SeedSequence([seed, start, digest]).generate_state(2, np.uint64)[0] >> np.uint64(1))

