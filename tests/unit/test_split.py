"""Kernel-sum differencing, the host residual and the linearity check, with known answers."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from hostsweep.measure.split import device_split, linear_fit, linearity
from hostsweep.measure.traces import TraceTotals


def rank_totals(prefill_us: float, step_us: float, tokens: int, overlap_us_per_step: float = 0.0,
                copy_us_per_step: float = 0.0) -> TraceTotals:
    total = prefill_us + step_us * tokens
    return TraceTotals("cuda", total, total - overlap_us_per_step * tokens, 10 * tokens,
                       copy_us=copy_us_per_step * tokens, copy_bytes=1000.0 * tokens,
                       by_name_us=Counter({"gemm": 0.75 * total, "norm": 0.25 * total}))


def test_differenced_kernel_sums_give_device_and_host_per_step():
    T = 33
    split = device_split([rank_totals(5000, 6410, 1)], [rank_totals(5000, 6410, T)], T,
                         step_ms=12.19, profiled_step_ms=13.0, host_bound_threshold=0.5)
    assert split.device_ms == pytest.approx(6.41)
    assert split.host_ms == pytest.approx(5.78)
    assert split.host_frac == pytest.approx(5.78 / 12.19)
    assert split.regime == "device-bound"  # 47% < 50%
    assert split.profiler_overhead == pytest.approx(13.0 / 12.19)
    assert split.copy_bytes == pytest.approx(1000.0)
    assert split.top_ops[0][0] == "gemm" and split.top_ops[0][1] == pytest.approx(0.75 * 6.41)


def test_overlap_gap_is_sum_minus_union_per_step():
    split = device_split([rank_totals(0, 1000, 1, overlap_us_per_step=40)],
                         [rank_totals(0, 1000, 9, overlap_us_per_step=40)], 9, 2.0, 2.0, 0.5)
    assert split.overlap_gap_ms == pytest.approx(0.040)


def test_slowest_rank_sets_device_time():
    short = [rank_totals(0, 3000, 1), rank_totals(0, 4000, 1)]
    long = [rank_totals(0, 3000, 17), rank_totals(0, 4000, 17)]
    split = device_split(short, long, 17, step_ms=5.0, profiled_step_ms=5.0, host_bound_threshold=0.5)
    assert split.per_rank_device_ms == pytest.approx((3.0, 4.0))
    assert split.device_ms == pytest.approx(4.0)
    assert split.regime == "device-bound"


def test_host_bound_when_host_fraction_reaches_the_threshold():
    split = device_split([rank_totals(0, 1000, 1)], [rank_totals(0, 1000, 5)], 5, 4.0, 4.0, 0.5)
    assert split.host_frac == pytest.approx(0.75) and split.regime == "host-bound"


def test_mismatched_rank_counts_are_rejected():
    with pytest.raises(ValueError):
        device_split([rank_totals(0, 1, 1)], [], 5, 1.0, 1.0, 0.5)


def test_linear_fit_recovers_slope_intercept():
    slope, intercept, r2 = linear_fit([1, 2, 3, 4], [5, 7, 9, 11])
    assert (slope, intercept, r2) == pytest.approx((2.0, 3.0, 1.0))


def test_linearity_of_an_exact_line_has_r2_one_and_no_disagreement():
    tokens = [8, 16, 32, 64, 128, 256, 512]
    walls = [40.0 + 12.19 * t for t in tokens]
    lin = linearity(tokens, walls, [20.0 + 6.41 * t for t in tokens])
    assert lin.r2_wall == pytest.approx(1.0) and lin.r2_kernel == pytest.approx(1.0)
    assert lin.slope_fit_ms == pytest.approx(12.19)
    assert lin.slope_disagreement == pytest.approx(0.0, abs=1e-12)


def test_linearity_flags_curvature_and_noise():
    tokens = np.array([8, 16, 32, 64, 128, 256, 512])
    curved = 40.0 + 10.0 * tokens + 0.02 * tokens ** 2
    lin = linearity(list(tokens), list(curved))
    assert lin.slope_disagreement > 0.01 and np.isnan(lin.r2_kernel)
    noisy = 40.0 + 10.0 * tokens + np.random.default_rng(0).normal(0, 50, tokens.size)
    assert linearity(list(tokens), list(noisy)).r2_wall < 1.0


def test_linearity_needs_three_points():
    with pytest.raises(ValueError):
        linearity([8, 16], [1.0, 2.0])
