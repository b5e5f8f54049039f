"""The cell CIs cover a known truth as often as they claim, over thousands of simulated
cells: the median CI at n pairs, the CI across k engine starts with a planted between-start
spread, and the CI an adaptive cell reports after stopping. Noise is Gaussian, skewed
(a long right tail), heavy-tailed (t with 3 degrees of freedom) and contaminated (5 % of
pairs 1.5x slower), each multiplicative with median 1. Everything is vectorized over seeds
(benchmarks/gate_calibration.py prints the full tables)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import optimize, stats

from hostsweep.measure.intervals import (
    any_look_misses, between_starts_ci, few_starts_warning, look_level, median_ci_bounds, sequential_coverage, t_interval_bounds,
)
from hostsweep.measure.protocol import (
    RepTiming, adaptive_looks, adaptive_stops, ci_target_rule, summarize,
)

SEEDS = 2000
SCALE = 0.015  # within-start noise, a fraction of the step
NOISES = ("gauss", "skewed", "t3", "mix5")


def noise(rng: np.random.Generator, kind: str, shape: tuple[int, ...], scale: float = SCALE) -> np.ndarray:
    if kind == "skewed":
        return 1.0 + scale * (rng.exponential(1.0, shape) - math.log(2.0))
    if kind == "t3":
        return 1.0 + scale * rng.standard_t(3, shape) / math.sqrt(3.0)
    x = 1.0 + scale * rng.standard_normal(shape)
    return np.where(rng.random(shape) < 0.05, 1.5 * x, x) if kind == "mix5" else x


def truth(kind: str, scale: float = SCALE) -> float:
    """The population median of a pair: 1, except the contaminated mixture's."""
    if kind != "mix5":
        return 1.0
    cdf = lambda x: 0.95 * stats.norm.cdf((x - 1) / scale) + 0.05 * stats.norm.cdf((x / 1.5 - 1) / scale)
    return float(optimize.brentq(lambda x: cdf(x) - 0.5, 0.5, 2.0))


def tolerance(p: float, seeds: int = SEEDS) -> float:
    """3.5 standard errors of a rate measured over `seeds` independent cells."""
    return 3.5 * math.sqrt(p * (1 - p) / seeds)


@pytest.mark.parametrize("kind", NOISES)
@pytest.mark.parametrize("n", [8, 12, 24])
def test_the_median_ci_covers_at_its_exact_level_whatever_the_noise(n, kind):
    x = noise(np.random.default_rng([n, NOISES.index(kind)]), kind, (SEEDS, n))
    low, high, exact = median_ci_bounds(x, 0.95)
    covered = np.mean((low <= truth(kind)) & (truth(kind) <= high))
    assert exact >= 0.95 and abs(covered - exact) <= tolerance(exact)


def test_five_pairs_fall_short_of_95_percent_and_are_flagged_not_claimed():
    x = noise(np.random.default_rng(5), "gauss", (SEEDS, 5))
    low, high, exact = median_ci_bounds(x, 0.95)
    assert exact == pytest.approx(1 - 2 / 32) and exact < 0.95
    assert abs(np.mean((low <= 1) & (1 <= high)) - exact) <= tolerance(exact)


@pytest.mark.parametrize("kind", ["gauss", "skewed", "t3"])
@pytest.mark.parametrize("spread", [0.0, 0.01, 0.03])
@pytest.mark.parametrize("k", [2, 3, 5])
def test_the_ci_across_engine_starts_covers_within_93_to_97_percent(k, spread, kind):
    rng = np.random.default_rng([k, int(spread * 100), len(kind)])
    shifts = 1.0 + spread * rng.standard_normal((SEEDS, k, 1))  # each start moves the step
    medians = np.median(noise(rng, kind, (SEEDS, k, 12)) * shifts, axis=-1)
    _, low, high = t_interval_bounds(medians, 0.95)
    assert 0.93 <= np.mean((low <= 1) & (1 <= high)) <= 0.97


@pytest.mark.parametrize("alternative", ["greater", "less"])
def test_the_one_sided_bound_across_starts_covers_within_93_to_97_percent(alternative):
    rng = np.random.default_rng(len(alternative))
    medians = np.median(noise(rng, "skewed", (SEEDS, 3, 12)) * (1 + 0.02 * rng.standard_normal((SEEDS, 3, 1))), -1)
    _, low, high = t_interval_bounds(medians, 0.95, alternative)
    assert np.all(np.isinf(high if alternative == "greater" else low))
    assert 0.93 <= np.mean((low <= 1) & (1 <= high)) <= 0.97


def test_between_starts_ci_weighs_each_start_the_same_whatever_its_pair_count():
    point, low, high = between_starts_ci([[1.0] * 30 + [1.1], [2.0, 2.1, 1.9], [3.0]], 0.95)
    assert point == pytest.approx(2.0)  # the mean of the medians 1, 2, 3, not the pooled median
    t = stats.t.ppf(0.975, 2)
    assert (low, high) == pytest.approx((2.0 - t * 1 / math.sqrt(3), 2.0 + t * 1 / math.sqrt(3)))
    with pytest.raises(ValueError, match="groups"):
        between_starts_ci([[1.0, 2.0]], 0.95)


def test_fewer_than_three_starts_come_with_a_warning():
    assert few_starts_warning(3) is None
    assert "1 degree(s) of freedom" in few_starts_warning(2) and "one engine start" in few_starts_warning(1)


@pytest.mark.parametrize("kind", NOISES)
@pytest.mark.parametrize("target", [1.0, 2.0, 4.0])
def test_the_ci_an_adaptive_cell_reports_after_stopping_keeps_its_coverage(target, kind):
    looks = adaptive_looks(target, 8, 48)
    x = noise(np.random.default_rng([int(target), NOISES.index(kind)]), kind, (SEEDS, 48))
    used, low, high = adaptive_stops(x, looks, target, look_level(0.95, looks))
    assert used.min() >= 8 and set(np.unique(used)) <= set(looks)
    assert np.mean((low <= truth(kind)) & (truth(kind) <= high)) >= 0.95 - tolerance(0.95)
    assert sequential_coverage(looks, 0.95) >= 0.95  # the guarantee the cell records


def test_the_vectorized_stop_rule_is_the_worker_s():
    looks = adaptive_looks(2.0, 8, 48)
    x = noise(np.random.default_rng(0), "gauss", (40, 48), 0.03)
    used, low, high = adaptive_stops(x, looks, 2.0, look_level(0.95, looks))
    rule = ci_target_rule(2.0, 8, 48, 0.95)
    for row, n, lo, hi in zip(x, used, low, high):
        pairs = [RepTiming(k, k % 2 == 0, 0.01, 0.01 + 32 * s / 1e3, s / 1e3) for k, s in enumerate(row)]
        stop = next(m for m in range(1, 49) if rule(pairs[:m]) or m == 48)
        m = summarize(pairs[:stop], 0.95, looks)
        assert stop == n and (m.step_ci_low_ms, m.step_ci_high_ms) == pytest.approx((lo, hi))
    assert 8 < used.mean() < 48  # the targets met and missed both occur


def test_the_looks_level_is_the_lowest_that_keeps_any_looks_miss_within_the_error():
    # Taken at the plain 95 %, the looks' CIs would miss somewhere with a chance well above
    # 5 %: a rule that stops on the first narrow one can report any of them.
    looks = adaptive_looks(2.0, 8, 48)
    each = look_level(0.95, looks)
    assert any_look_misses(looks, 0.95) > 0.10
    assert any_look_misses(looks, each) <= 0.05 < any_look_misses(looks, each - 0.002)
    assert 0.95 < each < 1 - 0.05 / len(looks)  # stricter than plain, looser than Bonferroni


def test_the_chance_some_look_misses_matches_a_simulation_of_the_walk():
    looks, each = (8, 12, 16), 0.97
    x = np.random.default_rng(1).standard_normal((20000, 16))
    missed = np.zeros(len(x), bool)
    for n in looks:
        low, high, coverage = median_ci_bounds(x[:, :n], each)
        if coverage >= each or n == looks[-1]:
            missed |= (low > 0) | (high < 0)
    assert abs(missed.mean() - any_look_misses(looks, each)) <= tolerance(any_look_misses(looks, each), 20000)
