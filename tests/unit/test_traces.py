"""The trace parser on small synthesized traces, GPU and CPU, with known answers."""
from __future__ import annotations

import gzip
import json

import pytest

from hostsweep.measure.traces import interval_union_us, is_cpu_compute_op, load_trace, outermost_compute_ops, totals
from hostsweep.measure.traces import Interval


def kernel(name, ts, dur, stream):
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur}


def cpu_op(name, ts, dur, tid=1):
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur}


def test_gpu_kernels_on_two_overlapping_streams_sum_exceeds_union():
    events = [
        kernel("gemm", 0, 100, stream=7),
        kernel("allreduce", 50, 100, stream=13),   # overlaps gemm by 50 us
        kernel("norm", 200, 10, stream=7),
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 160, "dur": 4, "args": {"bytes": 4096}},
        {"ph": "X", "cat": "gpu_memset", "name": "Memset", "ts": 170, "dur": 1, "args": {"bytes": 64}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0, "dur": 5},
    ]
    t = totals({"traceEvents": events})
    assert t.kernel_source == "cuda"
    assert t.kernel_sum_us == 210 and t.kernel_union_us == 160 and t.kernel_count == 3
    assert t.copy_us == 5 and t.copy_bytes == 4096 + 64
    assert t.by_name_us["allreduce"] == 100


def test_cpu_op_tree_counts_each_compute_op_once():
    events = [
        cpu_op("aten::linear", 0, 100),
        cpu_op("aten::t", 1, 2),            # metadata inside a compute op
        cpu_op("aten::addmm", 5, 90),       # nested compute: inside linear's time
        cpu_op("aten::copy_", 10, 20),      # nested two deep
        cpu_op("vllm::unified_attention_with_output", 200, 100),  # wrapper: host bookkeeping
        cpu_op("_C::cpu_attention_with_kv_cache", 250, 30),       # kernel inside the wrapper
        cpu_op("aten::slice", 400, 10),     # view op: not compute
        cpu_op("aten::reshape", 500, 40),   # metadata wrapper ...
        cpu_op("aten::clone", 505, 25),     # ... whose copy is compute
    ]
    t = totals({"traceEvents": events})
    assert t.kernel_source == "cpu-ops"
    assert t.kernel_sum_us == 100 + 30 + 25
    assert t.kernel_union_us == t.kernel_sum_us
    assert dict(t.by_name_us) == {"aten::linear": 100, "_C::cpu_attention_with_kv_cache": 30, "aten::clone": 25}


def test_cpu_ops_on_two_threads_are_both_counted_and_may_overlap():
    events = [cpu_op("aten::mm", 0, 100, tid=1), cpu_op("aten::mm", 40, 100, tid=2)]
    t = totals({"traceEvents": events})
    assert t.kernel_sum_us == 200 and t.kernel_union_us == 140


def test_equal_start_parent_encloses_child():
    kept = outermost_compute_ops([cpu_op("aten::addmm", 0, 10), cpu_op("aten::linear", 0, 50)])
    assert [iv.name for iv in kept] == ["aten::linear"]


@pytest.mark.parametrize("name,counts", [
    ("_C::onednn_mm", True), ("aten::mm", True), ("aten::silu", True), ("aten::_to_copy", True),
    ("aten::view", False), ("aten::to", False), ("aten::item", False), ("vllm::unified_kv_cache_update", False),
    ("python_thing", False),
])
def test_cpu_compute_rule(name, counts):
    assert is_cpu_compute_op(name) is counts


@pytest.mark.parametrize("spans,union", [
    ([], 0), ([(0, 10)], 10), ([(0, 10), (5, 15)], 15), ([(0, 10), (20, 30)], 20), ([(0, 30), (5, 10)], 30),
])
def test_interval_union(spans, union):
    assert interval_union_us(Interval(a, b, "k") for a, b in spans) == union


def test_gzipped_and_plain_traces_load_alike(tmp_path):
    trace = {"traceEvents": [kernel("k", 0, 5, 7)]}
    (tmp_path / "a.json").write_text(json.dumps(trace))
    with gzip.open(tmp_path / "b.json.gz", "wt") as handle:
        json.dump(trace, handle)
    assert load_trace(tmp_path / "a.json") == load_trace(tmp_path / "b.json.gz") == trace


def test_host_launches_count_kernel_and_graph_launches_on_cuda_traces_only():
    def api(name, ts):
        return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": 2.0, "pid": 1, "tid": 1}

    kernel = {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0.0, "dur": 5.0, "pid": 0, "tid": 7}
    events = [kernel, api("cudaLaunchKernel", 0), api("cuLaunchKernelEx", 3), api("cudaGraphLaunch", 6),
              api("cudaMemcpyAsync", 9), api("cudaStreamSynchronize", 12)]
    assert totals({"traceEvents": events}).launch_count == 3
    cpu = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 5.0, "pid": 1, "tid": 1}]
    assert totals({"traceEvents": cpu}).launch_count == 0


def test_split_reports_kernels_and_launches_per_step():
    from hostsweep.measure.split import device_split
    from hostsweep.measure.traces import TraceTotals

    short = TraceTotals("cuda", 100.0, 100.0, kernel_count=40, launch_count=40)
    long = TraceTotals("cuda", 1700.0, 1700.0, kernel_count=360, launch_count=56)  # graph replays: 1 launch/step
    split = device_split([short], [long], 17, step_ms=0.2, profiled_step_ms=0.21, host_bound_threshold=0.5)
    assert split.kernels_per_step == 20.0 and split.launches_per_step == 1.0


def gloo_run(ts, dur, tid=9):
    """gloo's reduction on its own thread: a user annotation, not an op."""
    return {"ph": "X", "cat": "user_annotation", "name": "gloo:all_reduce", "pid": 7, "tid": tid, "ts": ts, "dur": dur}


@pytest.mark.parametrize("enqueue_us", [5, 40, 900])
def test_a_gloo_allreduce_lasts_from_its_enqueue_to_the_end_of_its_reduction(enqueue_us):
    # two all-reduces of known length (the caller waits in work.wait(), outside any op), a
    # matmul between them; the enqueue may end before or after gloo's thread starts the run
    events = [
        cpu_op("c10d::allreduce_", 0, enqueue_us), gloo_run(20, 1000),
        cpu_op("aten::mm", 1100, 50),
        cpu_op("c10d::allreduce_", 2000, enqueue_us), gloo_run(2030, 700, tid=10),
    ]
    t = totals({"traceEvents": events})
    assert t.allreduce_count == 2
    assert t.allreduce_us == pytest.approx(max(1020, enqueue_us) + max(730, enqueue_us))
    assert t.kernel_sum_us == pytest.approx(t.allreduce_us + 50)


def test_a_gloo_run_is_paired_with_its_own_op_and_never_with_a_later_or_another_processes():
    events = [
        cpu_op("c10d::allreduce_", 0, 10),                 # its run is missing from the trace
        cpu_op("c10d::allreduce_", 500, 10), gloo_run(520, 200),
        {**gloo_run(100, 5000), "pid": 8},                 # another rank's run: not this process's
    ]
    t = totals({"traceEvents": events})
    assert t.allreduce_us == pytest.approx(10 + 220)
