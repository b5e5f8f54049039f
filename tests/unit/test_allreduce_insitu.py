"""The all-reduce in situ: each rank's all-reduce ops (CPU build) or kernels (CUDA) summed
from synthesized profiler traces with known all-reduce time, differenced over the T − 1
steps of a profiled pair like every kernel total, pooled over pairs, and shown as metrics and
on the console's cell line."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hostsweep.measure.results import allreduce_metrics
from hostsweep.measure.split import device_split, pooled_split
from hostsweep.measure.split_stats import TimedStep
from hostsweep.measure.traces import is_allreduce, totals
from hostsweep.record.recorder import allreduce_note

LAYERS = 3


def op(name: str, ts: float, dur: float, cat: str = "cpu_op", tid: int = 1) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur}


def cpu_generate(steps: int, allreduce_us: float, gemm_us: float = 40.0) -> dict:
    """A CPU-build rank's trace: a prefill, then `steps` decode steps of LAYERS layers, each
    two GEMMs and two shared-memory all-reduces inside vLLM's wrapper op."""
    events, t = [op("_C::onednn_mm", 0.0, 900.0)], 1000.0
    events += [op("vllm::all_reduce", t, allreduce_us * 3 + 10), op("_C::shm_allreduce", t + 5, allreduce_us * 3)]
    t += allreduce_us * 3 + 20
    for _ in range(steps):
        for _ in range(2 * LAYERS):
            events.append(op("_C::onednn_mm", t, gemm_us))
            events.append(op("aten::view", t + gemm_us + 1, 1.0))  # metadata: not counted
            t += gemm_us + 3
            events.append(op("vllm::all_reduce", t, allreduce_us + 8))  # wrapper: host bookkeeping
            events.append(op("_C::shm_allreduce", t + 4, allreduce_us))
            t += allreduce_us + 10
    return {"traceEvents": events}


NCCL = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
CUSTOM = "void vllm::cross_device_reduce_1stage<__nv_bfloat16, 2>(vllm::RankData*, vllm::RankSignals, int)"


def cuda_generate(steps: int, allreduce_us: float, kernel_name: str, gemm_us: float = 12.0) -> dict:
    """A GPU rank's trace: GEMM kernels and all-reduce kernels on the stream, with the host's
    `vllm::all_reduce` op and a launch per kernel (host time, never the all-reduce's)."""
    events, t = [], 0.0
    for _ in range(steps):
        for _ in range(2 * LAYERS):
            events.append(op("ampere_bf16_s16816gemm", t, gemm_us, cat="kernel", tid=7))
            events.append(op("cudaLaunchKernel", t - 3, 2.0, cat="cuda_runtime"))
            t += gemm_us + 1
            events.append(op("vllm::all_reduce", t - 5, 30.0))  # the enqueue on the host
            events.append(op(kernel_name, t, allreduce_us, cat="kernel", tid=7))
            t += allreduce_us + 1
    return {"traceEvents": events}


def pair(make, T: int, per_rank_allreduce_us: list[float], **kwargs):
    return ([totals(make(1, us, **kwargs)) for us in per_rank_allreduce_us],
            [totals(make(T, us, **kwargs)) for us in per_rank_allreduce_us])


@pytest.mark.parametrize("name, source, counts", [
    ("_C::shm_allreduce", "cpu-ops", True), ("c10d::allreduce_", "cpu-ops", True),
    ("vllm::all_reduce", "cpu-ops", False), ("_C::onednn_mm", "cpu-ops", False),
    (NCCL, "cuda", True), (CUSTOM, "cuda", True), ("ncclKernel_AllReduce_RING_LL_Sum_half", "cuda", True),
    ("ncclDevKernel_AllGather_RING_LL", "cuda", False), ("ampere_bf16_s16816gemm", "cuda", False),
])
def test_all_reduce_is_recognised_by_the_op_and_kernel_names_of_each_build(name, source, counts):
    assert is_allreduce(name, source) is counts


def test_cpu_build_all_reduce_per_step_is_recovered_per_rank_from_shm_allreduce_ops():
    T = 17
    short, long = pair(cpu_generate, T, [55.0, 80.0])
    split = device_split(short, long, T, step_ms=2.0, profiled_step_ms=2.1, host_bound_threshold=0.5)
    assert split.kernel_source == "cpu-ops"
    # 2 all-reduces a layer; the prefill's cancel in the difference; the wrapper's time is not counted
    assert split.per_rank_allreduce_ms == pytest.approx((2 * LAYERS * 55.0 / 1e3, 2 * LAYERS * 80.0 / 1e3))
    assert split.allreduce_insitu_ms == pytest.approx(2 * LAYERS * 0.055)
    assert split.allreduces_per_step == pytest.approx(2 * LAYERS)
    # the all-reduce is a part of each rank's device time: device = GEMMs + all-reduce
    assert split.per_rank_device_ms[0] == pytest.approx(2 * LAYERS * (40.0 + 55.0) / 1e3)


@pytest.mark.parametrize("kernel_name", [NCCL, CUSTOM])
def test_cuda_all_reduce_per_step_is_recovered_from_nccl_and_custom_all_reduce_kernels(kernel_name):
    T = 9
    short, long = pair(cuda_generate, T, [20.0, 23.0], kernel_name=kernel_name)
    split = device_split(short, long, T, step_ms=1.0, profiled_step_ms=1.05, host_bound_threshold=0.5)
    assert split.kernel_source == "cuda"
    assert split.per_rank_allreduce_ms == pytest.approx((2 * LAYERS * 0.020, 2 * LAYERS * 0.023))
    assert split.per_rank_device_ms[1] == pytest.approx(2 * LAYERS * (12.0 + 23.0) / 1e3)


def test_a_single_rank_has_no_all_reduce_in_situ():
    short, long = pair(cpu_generate, 9, [55.0])
    split = device_split(short, long, 9, step_ms=2.0, profiled_step_ms=2.1, host_bound_threshold=0.5)
    assert split.per_rank_allreduce_ms == () and np.isnan(split.allreduce_insitu_ms)
    assert allreduce_metrics(split) == {} and allreduce_note({"step_ms": 2.0}) == ""


def test_pooled_all_reduce_is_rank_zeros_mean_over_the_pairs_with_its_t_interval():
    T, rank0 = 17, [50.0, 55.0, 60.0, 57.0]
    splits = []
    for us in rank0:
        short, long = pair(cpu_generate, T, [us, us + 30.0])
        splits.append(device_split(short, long, T, step_ms=2.0, profiled_step_ms=2.1, host_bound_threshold=0.5))
    step = TimedStep(2.0, 1.9, 2.1, 12, 0.95)
    pooled = pooled_split(splits, step, 0.5, (0.5, 3.0))
    per_pair = np.array(rank0) * 2 * LAYERS / 1e3
    assert pooled.allreduce_insitu_ms == pytest.approx(per_pair.mean())
    low, high = pooled.allreduce_insitu_ci
    half = 3.182446 * per_pair.std(ddof=1) / 2.0  # t(0.975, 3) · sd / √4
    assert (low, high) == pytest.approx((per_pair.mean() - half, per_pair.mean() + half), rel=1e-4)
    metrics = allreduce_metrics(pooled)
    assert metrics["allreduce_insitu_rank_min_ms"] == pytest.approx(per_pair.mean())
    assert metrics["allreduce_insitu_rank_max_ms"] == pytest.approx(per_pair.mean() + 2 * LAYERS * 0.030)
    assert metrics["allreduces_per_step"] == pytest.approx(2 * LAYERS)
    note = allreduce_note(metrics)
    assert note.startswith(f", all-reduce {per_pair.mean():.3f} ms [") and "(ranks " in note


def test_the_journal_gives_back_the_all_reduce_in_situ():
    from hostsweep.record.journal import decode_result, encode_result
    from tests.unit.test_journal_and_uploader import RESULT

    short, long = pair(cpu_generate, 9, [55.0, 70.0])
    split = dataclasses.replace(device_split(short, long, 9, 2.0, 2.1, 0.5), allreduce_insitu_ci=(0.3, 0.4))
    back = decode_result(encode_result(dataclasses.replace(RESULT, split=split)))
    assert back.split == split and back.split.allreduce_insitu_ci == (0.3, 0.4)
