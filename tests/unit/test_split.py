"""Kernel-sum differencing, the host residual and the linearity check, with known answers."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from hostsweep.measure.split import device_floor_ms, device_split, linear_fit, linearity, pooled_split
from hostsweep.measure.split_stats import TimedStep
from hostsweep.measure.traces import TraceTotals, totals


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


def test_the_device_floor_is_the_sum_of_the_steps_count_of_the_shortest_kernels_per_step():
    durations = (5.0, 5.0, 20.0, 20.0, 50.0, 50.0, 1000.0)
    assert device_floor_ms(3, durations, steps=2) == pytest.approx((5 + 5 + 20 + 20 + 50 + 50) / 2 / 1e3)
    assert device_floor_ms(2, durations, steps=2) == pytest.approx((5 + 5 + 20 + 20) / 2 / 1e3)
    assert device_floor_ms(0, durations, 2) == 0.0 and device_floor_ms(3, (), 2) == 0.0
    assert device_floor_ms(-1.5, durations, 2) == 0.0  # more kernels in the short generate: no floor


STEP_OPS = (("gemm", 50.0), ("add", 5.0), ("attention", 20.0))  # one decode step's kernels, us


def synthesized_trace(style: str, steps: int, prefill_us: float) -> dict:
    """A chrome trace of a generate: one prefill kernel, then `steps` decode steps of STEP_OPS,
    as CUDA kernels (GPU) or as the CPU build's compute ops."""
    names = {"cuda": {"gemm": "sm90_gemm", "add": "elementwise_add", "attention": "flash_fwd"},
             "cpu-ops": {"gemm": "_C::onednn_mm", "add": "aten::add", "attention": "_C::cpu_attention_with_kv_cache"}}
    cat = "kernel" if style == "cuda" else "cpu_op"
    events, t = [{"ph": "X", "cat": cat, "name": names[style]["gemm"], "pid": 1, "tid": 1, "ts": 0.0,
                  "dur": prefill_us}], prefill_us + 10
    for _ in range(steps):
        for op, dur in STEP_OPS:
            events.append({"ph": "X", "cat": cat, "name": names[style][op], "pid": 1, "tid": 1, "ts": t, "dur": dur})
            t += dur + 10
    return {"traceEvents": events}


def pair_split(style: str, prefill_1_us: float, T: int = 9, step_ms: float = 0.5, profiled_ms: float = 0.6):
    short = totals(synthesized_trace(style, 1, prefill_1_us))
    long = totals(synthesized_trace(style, T, 1000.0))
    return device_split([short], [long], T, step_ms, profiled_ms, 0.5)


@pytest.mark.parametrize("style", ["cuda", "cpu-ops"])
def test_a_clean_pair_lies_at_its_floor_and_passes_the_checks(style):
    split = pair_split(style, prefill_1_us=1000.0)
    assert split.kernel_source == style and split.kernels_per_step == pytest.approx(3)
    # The 24 shortest of the long trace (27 step kernels, 1 prefill): every step kernel but 3 gemms.
    assert split.device_ms == pytest.approx(0.075) and split.device_floor_ms == pytest.approx((525 / 8) / 1e3)
    pooled = pooled_split([split] * 3, TimedStep(0.5, 0.48, 0.52, 12, 0.95), 0.5, (0.9, 3.0))
    assert pooled.implausible == () and pooled.pairs == 3 and pooled.device_ci == pytest.approx((0.075, 0.075))


@pytest.mark.parametrize("style", ["cuda", "cpu-ops"])
def test_a_planted_impossible_split_below_the_floor_is_flagged(style):
    # The T=1 generate's prefill ran 0.5 ms slower: the difference eats most of the steps'
    # device time, leaving 0.0125 ms per step for 3 kernels that take at least 0.066 ms.
    splits = [pair_split(style, prefill_1_us=1000.0 + slow) for slow in (480.0, 500.0, 520.0)]
    assert all(s.device_ms < s.device_floor_ms for s in splits)
    pooled = pooled_split(splits, TimedStep(0.5, 0.48, 0.52, 12, 0.95), 0.5, (0.9, 3.0))
    assert pooled.possible and pooled.implausible == ("device_below_floor",)


def test_a_pooled_split_takes_the_pairs_means_and_the_median_pairs_details():
    splits = [pair_split("cuda", prefill_1_us=1000.0 + slow, profiled_ms=p) for slow, p in ((0, 0.6), (40, 0.7), (-40, 0.65))]
    pooled = pooled_split(splits, TimedStep(0.5, 0.45, 0.55, 12, 0.95), 0.5, (0.9, 3.0))
    assert pooled.device_ms == pytest.approx(np.mean([s.device_ms for s in splits]))
    assert pooled.profiled_step_ms == pytest.approx(0.65) and pooled.profiler_overhead == pytest.approx(1.3)
    assert pooled.host_frac == pytest.approx(1 - pooled.device_ms / 0.5) and pooled.host_frac_ci is not None
    assert pooled.top_ops == splits[0].top_ops  # the median-device pair's
    with pytest.raises(ValueError, match="no profiled pairs"):
        pooled_split([], TimedStep(0.5, 0.45, 0.55, 12, 0.95), 0.5, (0.9, 3.0))
