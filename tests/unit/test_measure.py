"""Differencing, the interleaved protocol, and the cell's median CI (order statistics) and
the percentile bootstrap kept for derived quantities, on synthetic timings."""
from __future__ import annotations

import math

import numpy as np
import pytest

from hostsweep.measure.intervals import median_ci, median_ci_ranks
from hostsweep.measure.protocol import (
    RepTiming, bootstrap_median_ci, random_prompts, run_protocol, step_time, summarize,
)


@pytest.mark.parametrize("wall_1,wall_T,T,expected", [
    (0.100, 0.420, 33, 0.010),
    (0.050, 0.050 + 511 * 0.012, 512, 0.012),
    (1.0, 1.5, 2, 0.5),
])
def test_step_time_is_the_difference_over_T_minus_one(wall_1, wall_T, T, expected):
    assert step_time(wall_1, wall_T, T) == pytest.approx(expected)


def test_step_time_rejects_T_below_two():
    with pytest.raises(ValueError):
        step_time(0.1, 0.2, 1)


class LinearClock:
    """wall(T) = fixed + step * T + drift * call_index: a known answer with slow drift."""

    def __init__(self, fixed: float, step: float, drift: float = 0.0) -> None:
        self.fixed, self.step, self.drift = fixed, step, drift
        self.calls: list[int] = []

    def __call__(self, tokens: int) -> float:
        self.calls.append(tokens)
        return self.fixed + self.step * tokens + self.drift * len(self.calls)


def test_protocol_recovers_the_step_and_cancels_the_fixed_cost():
    clock = LinearClock(fixed=0.250, step=0.004)
    reps = run_protocol(clock, T=33, warmups=2, reps=12)
    assert len(reps) == 12
    assert all(r.step_s == pytest.approx(0.004) for r in reps)


def test_protocol_runs_warmups_first_then_alternates_pair_order():
    clock = LinearClock(fixed=0.1, step=0.001)
    run_protocol(clock, T=9, warmups=2, reps=4)
    assert clock.calls == [1, 9, 1, 9,  1, 9,  9, 1,  1, 9,  9, 1]


def test_alternating_order_cancels_linear_drift_in_the_median():
    # Drift of 1 ms per generate would bias every pair the same way if the order were fixed.
    clock = LinearClock(fixed=0.1, step=0.002, drift=0.001)
    reps = run_protocol(clock, T=33, warmups=0, reps=12)
    steps = np.array([r.step_s for r in reps])
    assert np.mean(steps) == pytest.approx(0.002, rel=1e-9)


def test_summary_reports_median_and_a_ci_that_brackets_it():
    rng = np.random.default_rng(1)
    clock_steps = 0.005 + rng.normal(0, 0.0005, size=12)
    long_walls = iter(0.2 + 32 * s for s in clock_steps)
    reps = run_protocol(lambda tokens: 0.2 if tokens == 1 else next(long_walls), T=33, warmups=0, reps=12)
    m = summarize(reps, level=0.95)
    assert m.step_ms == pytest.approx(np.median(clock_steps) * 1e3)
    assert m.step_ci_low_ms <= m.step_ms <= m.step_ci_high_ms
    assert m.step_ci_low_ms < m.step_ci_high_ms
    assert m.wall_1_ms == pytest.approx(200.0)


@pytest.mark.parametrize("n,ranks,coverage", [(6, (1, 6), 1 - 2 / 64), (8, (1, 8), 1 - 2 / 256),
                                              (12, (3, 10), 1 - 2 * (1 + 12 + 66) / 4096)])
def test_the_median_ci_is_the_narrowest_equal_tailed_order_statistic_pair_reaching_the_level(n, ranks, coverage):
    low_rank, high_rank, exact = median_ci_ranks(n, 0.95)
    assert (low_rank, high_rank) == ranks and exact == pytest.approx(coverage) and exact >= 0.95
    assert median_ci_ranks(n, 0.90)[2] <= exact  # a lower level never needs a wider pair
    values = np.random.default_rng(n).normal(size=n)
    ci = median_ci(values, 0.95)
    assert (ci.low, ci.high) == (np.sort(values)[ranks[0] - 1], np.sort(values)[ranks[1] - 1])
    assert not ci.below_level


def test_five_pairs_cannot_reach_95_percent_and_the_cell_says_so():
    steps = [3.0, 3.1, 2.9, 3.05, 2.95]
    ci = median_ci(steps, 0.95)
    assert (ci.low, ci.high) == (2.9, 3.1) and ci.coverage == pytest.approx(1 - 2 / 32) and ci.below_level
    m = summarize([RepTiming(k, k % 2 == 0, 0.01, 0.01 + 32 * s / 1e3, s / 1e3) for k, s in enumerate(steps)])
    assert m.ci_coverage == pytest.approx(0.9375)


def test_the_median_ci_refuses_no_values_and_a_level_outside_0_1():
    with pytest.raises(ValueError, match="values"):
        median_ci([], 0.95)
    with pytest.raises(ValueError, match="level"):
        median_ci_ranks(12, 1.0)


def test_the_median_ci_narrows_with_more_reps():
    rng = np.random.default_rng(3)
    small, large = median_ci(rng.normal(0, 1, 12), 0.95), median_ci(rng.normal(0, 1, 400), 0.95)
    assert (large.high - large.low) < (small.high - small.low) / 2


def test_bootstrap_ci_covers_the_true_median_near_its_nominal_level():
    rng = np.random.default_rng(7)
    true_median, trials, covered = 5.0, 300, 0
    for _ in range(trials):
        sample = rng.normal(true_median, 1.0, size=25)
        low, high = bootstrap_median_ci(sample, 1000, 0.95, rng)
        covered += low <= true_median <= high
    assert 0.88 <= covered / trials <= 0.995


def test_bootstrap_ci_narrows_with_more_reps():
    rng = np.random.default_rng(3)
    small = bootstrap_median_ci(rng.normal(0, 1, 12), 2000, 0.95, np.random.default_rng(0))
    large = bootstrap_median_ci(rng.normal(0, 1, 400), 2000, 0.95, np.random.default_rng(0))
    assert (large[1] - large[0]) < (small[1] - small[0]) / 2


def test_prompts_are_distinct_sized_and_reproducible():
    prompts = random_prompts(batch=8, ctx=16, vocab_size=50, seed=3)
    assert len(prompts) == 8 and all(len(p) == 16 for p in prompts)
    assert len({tuple(p) for p in prompts}) == 8
    assert all(0 <= t < 50 for p in prompts for t in p)
    assert prompts == random_prompts(batch=8, ctx=16, vocab_size=50, seed=3)
    assert prompts != random_prompts(batch=8, ctx=16, vocab_size=50, seed=4)


def test_prompts_stay_distinct_when_collisions_are_likely():
    prompts = random_prompts(batch=4, ctx=1, vocab_size=4, seed=0)
    assert sorted(p[0] for p in prompts) == [0, 1, 2, 3]


def test_linear_percentiles_equal_numpys_percentile_bit_for_bit():
    from hostsweep.measure.results import linear_percentiles

    rng = np.random.default_rng(11)
    for i in range(3000):
        values = rng.normal(size=int(rng.integers(1, 40))) * rng.choice([1e-3, 1.0, 250.0])
        if i % 3 == 0:
            values = np.round(values, 1)  # ties
        percents = [0, 10, 25, 50, 75, 90, 100, *rng.uniform(0, 100, size=4)]
        assert linear_percentiles(list(values), percents) == list(np.percentile(values, percents)), (values, percents)
    assert all(math.isnan(v) for v in linear_percentiles([1.0, float("nan"), 2.0], [10, 90]))
