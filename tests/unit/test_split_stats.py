"""The split over several profiled pairs: CI coverage on synthetic pairs with known truth, the
three-valued regime at the threshold, and the physical checks on planted impossible splits."""
from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from hostsweep.measure.intervals import median_ci_bounds
from hostsweep.measure.split_stats import (
    DEVICE_BOUND, HOST_BOUND, UNDETERMINED, SplitStats, TimedStep, fieller_ratio_ci, host_frac_ci_arrays,
    implausible_checks, regime_of, split_stats,
)

SEEDS = 4000  # simulated cells per case: the coverage's Monte-Carlo SE is about 0.0035
TIMED_PAIRS = 12  # the default measure.reps


def simulated_coverage(pairs: int, device_noise: str, seed: int) -> float:
    """Share of simulated cells whose host_frac CI holds the truth 1 - 2/5 = 0.6: device per
    pair 2 ms with 20 % noise (normal, or right-skewed lognormal), the timed step 5 ms with
    16 % noise over TIMED_PAIRS pairs, reported as the cells are: median with its
    order-statistic CI."""
    rng = np.random.default_rng(seed)
    if device_noise == "normal":
        device = rng.normal(2.0, 0.4, (SEEDS, pairs))
    else:  # lognormal with mean 2: the truth is the mean the t-interval aims at
        sigma = 0.2
        device = 2.0 * rng.lognormal(-sigma ** 2 / 2, sigma, (SEEDS, pairs))
    steps = rng.normal(5.0, 0.8, (SEEDS, TIMED_PAIRS))
    step = np.median(steps, axis=1)
    low, high, _ = median_ci_bounds(steps, 0.95)
    step_se = (high - low) / 2 / stats.norm.ppf(0.975)
    device_se = device.std(axis=1, ddof=1) / np.sqrt(pairs)
    frac_low, frac_high = host_frac_ci_arrays(device.mean(axis=1), device_se, pairs - 1, step, step_se,
                                              TIMED_PAIRS - 1, 0.95)
    return float(np.mean((frac_low <= 0.6) & (0.6 <= frac_high)))


@pytest.mark.parametrize("pairs", [3, 5])
@pytest.mark.parametrize("device_noise", ["normal", "lognormal"])
def test_host_frac_ci_covers_the_truth_at_its_level_from_three_pairs(pairs, device_noise):
    # Measured over seeds 0-2: 0.972-0.979 (3 pairs), 0.974-0.980 (5), normal or lognormal:
    # conservative, never below the level (a Welch df gave 0.936-0.944 at 3 pairs).
    assert simulated_coverage(pairs, device_noise, seed=pairs) >= 0.95


def test_fieller_without_step_noise_is_the_t_interval_of_the_device_over_the_step():
    q = stats.t.ppf(0.975, 4)
    low, high = fieller_ratio_ci(2.0, 0.1, 5.0, 0.0, q, 2.2)
    assert (low, high) == pytest.approx(((2.0 - q * 0.1) / 5.0, (2.0 + q * 0.1) / 5.0))


def test_fieller_is_unbounded_when_the_step_is_not_clearly_above_zero():
    low, high = fieller_ratio_ci(2.0, 0.1, 0.5, 0.4, 2.0, 2.0)
    assert np.isnan(low) and np.isnan(high)


def step(ms: float = 5.0, half: float = 0.2) -> TimedStep:
    return TimedStep(ms, ms - half, ms + half, TIMED_PAIRS, 0.95)


def test_three_pairs_give_cis_that_hold_their_points():
    s = split_stats([2.0, 2.2, 1.9], [6.5, 6.6, 6.4], step(), 0.5)
    assert s.pairs == 3 and s.device_ms == pytest.approx(2.0333, abs=1e-4)
    assert s.host_ms == pytest.approx(5.0 - s.device_ms) and s.host_frac == pytest.approx(1 - s.device_ms / 5.0)
    for point, ci in ((s.device_ms, s.device_ci), (s.host_ms, s.host_ci), (s.host_frac, s.host_frac_ci),
                      (s.profiled_step_ms, s.profiled_step_ci)):
        assert ci[0] < point < ci[1]
    assert s.profiler_overhead == pytest.approx(6.5 / 5.0) and s.regime == HOST_BOUND


def test_fewer_than_three_pairs_give_no_ci_and_no_regime():
    s = split_stats([1.0, 1.1], [6.0, 6.1], step(), 0.5)
    assert s.device_ci is s.host_ci is s.host_frac_ci is s.profiled_step_ci is None
    assert s.host_frac == pytest.approx(1 - 1.05 / 5.0) and s.regime == UNDETERMINED


@pytest.mark.parametrize("ci, regime", [
    ((0.50, 0.60), HOST_BOUND),  # at the threshold counts as host-bound, as the point rule did
    ((0.51, 0.70), HOST_BOUND),
    ((0.30, 0.49), DEVICE_BOUND),
    ((0.45, 0.55), UNDETERMINED),  # straddles
    ((0.30, 0.50), UNDETERMINED),  # reaches it
    (None, UNDETERMINED),
    ((float("nan"), float("nan")), UNDETERMINED),
])
def test_the_regime_is_three_valued_at_the_threshold(ci, regime):
    assert regime_of(ci, 0.5) == regime


def test_a_cell_near_the_threshold_is_undetermined_and_one_far_from_it_is_not():
    near = split_stats([2.4, 2.6, 2.5, 2.3, 2.7], [6.0] * 5, step(), 0.5)  # host_frac 0.5
    far = split_stats([1.0, 1.05, 0.95], [6.0] * 3, step(), 0.5)  # host_frac 0.8
    assert near.regime == UNDETERMINED and far.regime == HOST_BOUND
    assert split_stats([4.0, 4.1, 3.9], [6.0] * 3, step(), 0.5).regime == DEVICE_BOUND


def test_bad_input_names_the_field():
    with pytest.raises(ValueError, match="one device and one profiled step per pair"):
        split_stats([1.0], [], step(), 0.5)


def test_a_step_at_or_below_zero_gives_no_fraction_and_no_regime_rather_than_an_error():
    s = split_stats([1.0, 1.1, 0.9], [1.0] * 3, TimedStep(-0.3, -0.5, 0.1, 12, 0.95), 0.5)
    assert s.host_ms == pytest.approx(-1.3) and np.isnan(s.host_frac) and s.host_frac_ci is None
    assert s.regime == UNDETERMINED


def checks(s: SplitStats, floor: float = 0.5, forward=None, band=(0.9, 3.0)) -> tuple[str, ...]:
    return implausible_checks(s, step(), floor, forward, band)


def test_a_plausible_split_fails_no_check():
    s = split_stats([2.0, 2.1, 1.9], [6.4, 6.5, 6.6], step(), 0.5)
    assert checks(s, forward=(1.9, (1.7, 2.1))) == ()


@pytest.mark.parametrize("device, profiled, floor, forward, failed", [
    # 0.05 ms of device on a 5 ms step, below the floor of its 162 ops (the planted case)
    ([0.05, 0.06, 0.04], [6.5] * 3, 0.3, None, ("device_below_floor",)),
    ([2.0, 2.1, 1.9], [6.5] * 3, 0.5, (-0.21, (-0.3, -0.1)), ("forward_compute_negative",)),
    ([2.0], [6.5], 0.5, (-0.21, None), ("forward_compute_negative",)),  # one pair: the point
    # a profiled step faster than the timed one beyond both CIs, overhead 0.77
    ([2.0, 2.1, 1.9], [3.8, 3.9, 3.85], 0.5, None, ("profiled_faster", "profiler_overhead")),
    ([2.0, 2.1, 1.9], [16.0, 16.1, 15.9], 0.5, None, ("profiler_overhead",)),  # 3.2x: outside the band
])
def test_planted_impossible_splits_are_caught(device, profiled, floor, forward, failed):
    assert checks(split_stats(device, profiled, step(), 0.5), floor, forward) == failed


def test_noise_around_the_floor_or_zero_is_not_flagged():
    # device CI reaches above the floor; forward's CI holds 0; profiled CI overlaps the step's
    s = split_stats([0.2, 0.5, 0.35], [4.7, 5.6, 5.2], step(), 0.5)
    assert checks(s, floor=0.4, forward=(-0.01, (-0.05, 0.03))) == ()


def test_engine_starts_merge_into_one_split_with_a_between_start_ci():
    import dataclasses

    from hostsweep.measure.protocol import CellMeasurement
    from hostsweep.measure.replicates import merged_split
    from hostsweep.measure.results import CellResult
    from hostsweep.measure.split import SplitResult

    def start(device: float) -> CellResult:
        split = SplitResult("cpu-ops", device, 5.0 - device, 1 - device / 5.0, 0.0, 0.0, 0.0, 6.5, 1.3,
                            HOST_BOUND, (device,), (), pairs=3, host_frac_ci=(0.5, 0.9))
        return CellResult("k", {}, "FINISHED", None, None, {}, 1.0, split)

    merged_step = CellMeasurement(5.0, 4.8, 5.2, 20.0, 180.0, ())
    starts = [start(d) for d in (1.0, 1.2, 1.1)]
    merged = merged_split(starts, merged_step, 0.5, 0.95)
    assert merged.device_ms == pytest.approx(1.1) and merged.pairs == 9
    low, high = merged.host_frac_ci
    assert low < 1 - 1.1 / 5.0 < high and merged.regime == HOST_BOUND
    two = merged_split(starts[:2], merged_step, 0.5, 0.95)  # two starts: no between-start CI
    assert two.host_frac_ci is None and two.regime == UNDETERMINED
    assert merged_split(starts[:1], merged_step, 0.5, 0.95) is starts[0].split
    assert merged_split([dataclasses.replace(starts[0], split=None)], merged_step, 0.5, 0.95) is None


def test_a_host_frac_ci_never_leaves_zero_to_one():
    """Three device pairs scattered by a machine that changed speed: Fieller's interval for
    device / step reaches far past the step, but a host fraction lies in [0, 1]."""
    import numpy as np

    from hostsweep.measure.split_stats import host_frac_ci_arrays

    low, high = host_frac_ci_arrays(4.156, 0.9, 2.0, 4.699, 0.07, 11.0, 0.95)
    assert float(low) == 0.0 and 0.0 < float(high) < 1.0  # uncut, the low end is far below zero
    low, high = host_frac_ci_arrays(np.array([2.0]), np.array([0.05]), np.array([2.0]), np.array([5.0]),
                                    np.array([0.05]), np.array([11.0]), 0.95)
    assert 0.5 < float(low[0]) < 0.6 < float(high[0]) < 0.7  # a tight interval is left as it is
