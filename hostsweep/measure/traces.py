"""Profiler trace → kernel-time totals: sum, interval union, copies, top ops (pure).

Reads the chrome traces torch.profiler writes (one per rank, from vLLM's engine
processes). What counts as a "kernel":

- **cuda**: events with cat "kernel". Memcpy ("gpu_memcpy") and memset ("gpu_memset")
  are kept apart: they are copies, not compute, and are reported on their own.
- **cpu-ops** (the vLLM CPU build, where the "device" is the CPU): compute ops among
  the "cpu_op" events, by this rule:
    * vLLM's compiled kernels (`_C::…`, e.g. `_C::onednn_mm`,
      `_C::cpu_attention_with_kv_cache`) and aten ops that touch tensor data count;
    * aten ops that only make views or read metadata (view, slice, reshape, to, item…)
      do not, nor do wrapper ops (`vllm::…` custom ops that hold Python attention
      bookkeeping around a `_C` kernel): their compute children still count;
    * a compute op nested inside another compute op on the same thread is part of its
      parent and is not counted again.
  On a GPU those non-counted ops are host work (no kernel launch), which is why they are
  left on the host side of the split here too.

**All-reduce in situ**: the tensor-parallel all-reduces among the counted kernels, by name
(ALLREDUCE_CPU_OPS, ALLREDUCE_CUDA_KERNELS). On a GPU the all-reduce is kernels (NCCL's, or
vLLM's custom all-reduce), device time like any other; the CPU build's all-reduce ops do the
reduction on the rank's own cores, so they count as its compute ops too. Either way the
all-reduce is a part of the kernel sum, never beside it: device compute = kernels −
all-reduce. The host ops around it (`vllm::all_reduce`, and on a GPU `c10d::allreduce_`, whose
CPU time is the enqueue, not the reduction) are not the all-reduce's time. Where the CPU build
reduces through gloo (its kernels built without the shared-memory op: a CPU without AVX-512),
`c10d::allreduce_` is the enqueue too, and the reduction runs on gloo's thread while the caller
waits outside any op: the all-reduce is counted from the op's start to the end of its
`gloo:all_reduce` run (gloo_completions_us), what the caller paid.
"""
from __future__ import annotations

import gzip
import json
from array import array
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

# aten ops that create views or read metadata: no arithmetic on tensor data.
CPU_METADATA_OPS = frozenset({
    "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::_unsafe_view", "aten::slice",
    "aten::as_strided", "aten::select", "aten::narrow", "aten::split", "aten::split_with_sizes",
    "aten::chunk", "aten::unsqueeze", "aten::squeeze", "aten::flatten", "aten::unflatten",
    "aten::permute", "aten::transpose", "aten::t", "aten::expand", "aten::detach", "aten::alias",
    "aten::empty", "aten::empty_strided", "aten::new_empty", "aten::empty_like",
    "aten::result_type", "aten::item", "aten::_local_scalar_dense", "aten::to", "aten::lift_fresh",
    "aten::is_nonzero", "aten::unbind", "aten::contiguous", "aten::resolve_conj", "aten::resolve_neg",
})
# Wrapper namespaces: their own time is host bookkeeping; kernels inside still count.
CPU_WRAPPER_PREFIXES = ("vllm::",)
# The CPU build's all-reduce ops: vLLM's shared-memory all-reduce (CpuCommunicator ->
# torch.ops._C.shm_allreduce), and torch.distributed's gloo path it falls back to.
ALLREDUCE_CPU_OPS = frozenset({"_C::shm_allreduce", "shm_allreduce", "c10d::allreduce_", "gloo:all_reduce"})
# gloo's all-reduce in two events: the caller's op (the enqueue) and the reduction on gloo's
# thread (a user annotation). The all-reduce the caller pays runs from the one's start to the
# other's end (gloo_completions_us).
GLOO_ALLREDUCE_OP, GLOO_ALLREDUCE_RUN = "c10d::allreduce_", "gloo:all_reduce"
# CUDA all-reduce kernels, by a part of their (templated) names: NCCL's, vLLM's custom
# all-reduce (csrc/custom_all_reduce.cuh) and torch's symmetric-memory ones.
ALLREDUCE_CUDA_KERNELS = ("ncclDevKernel_AllReduce", "ncclKernel_AllReduce", "cross_device_reduce_1stage",
                          "cross_device_reduce_2stage", "multimem_all_reduce", "one_shot_all_reduce",
                          "two_shot_all_reduce")
GPU_COPY_CATEGORIES = ("gpu_memcpy", "gpu_memset")
# Host-side CUDA API events; the ones whose name holds "Launch" (cudaLaunchKernel,
# cuLaunchKernelEx, cudaGraphLaunch…) are the host's launches: a replayed CUDA graph is one.
CUDA_API_CATEGORIES = ("cuda_runtime", "cuda_driver")


@dataclass(frozen=True)
class Interval:
    start_us: float
    end_us: float
    name: str


@dataclass
class TraceTotals:
    """Kernel-time totals of one trace (one rank, one profiled generate), in microseconds."""

    kernel_source: str  # "cuda" or "cpu-ops"
    kernel_sum_us: float
    kernel_union_us: float
    kernel_count: int
    copy_us: float = 0.0
    copy_bytes: float = 0.0
    by_name_us: Counter = field(default_factory=Counter)
    launch_count: int = 0  # host launch calls (cuda traces only)
    allreduce_us: float = 0.0  # the all-reduce kernels / ops among the counted ones (is_allreduce)
    allreduce_count: int = 0
    # Every kernel's duration, ascending (float32: 4 bytes a kernel), for the physical floor of
    # a step's device time (split.device_floor_ms).
    durations_us: array = field(default_factory=lambda: array("f"), compare=False, repr=False)


def load_trace(path: Path) -> dict[str, Any]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as handle:  # type: ignore[operator]
        return json.load(handle)


def kernel_source(events: Iterable[dict[str, Any]]) -> str:
    """'cuda' when the trace holds CUDA kernels, else 'cpu-ops'."""
    return "cuda" if any(e.get("cat") == "kernel" for e in events) else "cpu-ops"


def interval_union_us(intervals: Iterable[Interval]) -> float:
    """Total time covered by at least one interval (overlaps counted once)."""
    total, current_start, current_end = 0.0, None, None
    for iv in sorted(intervals, key=lambda i: i.start_us):
        if current_end is None or iv.start_us > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = iv.start_us, iv.end_us
        else:
            current_end = max(current_end, iv.end_us)
    if current_end is not None:
        total += current_end - current_start
    return total


def is_allreduce(name: str, source: str) -> bool:
    """Whether a counted kernel (cuda) or compute op (cpu-ops) is a tensor-parallel all-reduce."""
    if source == "cuda":
        return any(part in name for part in ALLREDUCE_CUDA_KERNELS)
    return name in ALLREDUCE_CPU_OPS


def is_cpu_compute_op(name: str) -> bool:
    if name in ALLREDUCE_CPU_OPS:  # the reduction runs on the rank's cores: its compute, as NCCL's kernels are a GPU's
        return True
    if name in CPU_METADATA_OPS or name.startswith(CPU_WRAPPER_PREFIXES):
        return False
    return name.startswith("aten::") or name.startswith("_C")


def gloo_completions_us(events: Iterable[dict[str, Any]]) -> dict[int, float]:
    """For each gloo `c10d::allreduce_` op (by its index in `events`), the time its reduction
    ended. gloo's op only enqueues: the reduction runs on gloo's own thread (a
    `gloo:all_reduce` annotation) while the caller waits in `work.wait()`, outside any op.
    Each op is paired with the first annotation of its process that starts after it and
    before the process's next all-reduce op (the caller blocks, so they come in order)."""
    ops: dict[Any, list[tuple[float, int]]] = {}
    runs: dict[Any, list[tuple[float, float]]] = {}
    for index, e in enumerate(events):
        if e.get("ph") != "X":
            continue
        if e.get("name") == GLOO_ALLREDUCE_OP and e.get("cat") == "cpu_op":
            ops.setdefault(e.get("pid"), []).append((float(e["ts"]), index))
        elif e.get("name") == GLOO_ALLREDUCE_RUN:
            start = float(e["ts"])
            runs.setdefault(e.get("pid"), []).append((start, start + float(e.get("dur", 0.0))))
    ends: dict[int, float] = {}
    for pid, calls in ops.items():
        calls.sort()
        pending = sorted(runs.get(pid, []))
        cursor = 0
        for k, (start, index) in enumerate(calls):
            next_start = calls[k + 1][0] if k + 1 < len(calls) else float("inf")
            while cursor < len(pending) and pending[cursor][0] < start:
                cursor += 1
            if cursor < len(pending) and pending[cursor][0] < next_start:
                ends[index] = pending[cursor][1]
                cursor += 1
    return ends


def outermost_compute_ops(events: Iterable[dict[str, Any]]) -> list[Interval]:
    """CPU compute ops not nested inside another compute op of the same thread; a gloo
    all-reduce op lasts until its reduction ended (gloo_completions_us)."""
    events = list(events)
    completions = gloo_completions_us(events)
    by_thread: dict[tuple[Any, Any], list[Interval]] = {}
    for index, e in enumerate(events):
        if e.get("cat") == "cpu_op" and e.get("ph") == "X" and is_cpu_compute_op(e["name"]):
            end = float(e["ts"]) + float(e.get("dur", 0.0))
            iv = Interval(float(e["ts"]), max(end, completions.get(index, end)), e["name"])
            by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(iv)
    kept: list[Interval] = []
    for intervals in by_thread.values():
        # Longest first at equal starts, so a parent precedes the children it encloses.
        intervals.sort(key=lambda i: (i.start_us, -i.end_us))
        enclosing_end = float("-inf")
        for iv in intervals:
            if iv.end_us <= enclosing_end:
                continue  # nested in a counted op: its time is already in the parent
            kept.append(iv)
            enclosing_end = iv.end_us
    return kept


def cuda_kernels(events: Iterable[dict[str, Any]]) -> list[Interval]:
    return [Interval(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e["name"])
            for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"]


def copy_totals(events: Iterable[dict[str, Any]]) -> tuple[float, float]:
    """(time in us, bytes) of host<->device copies and memsets."""
    time_us, nbytes = 0.0, 0.0
    for e in events:
        if e.get("cat") in GPU_COPY_CATEGORIES and e.get("ph") == "X":
            time_us += float(e.get("dur", 0.0))
            nbytes += float(e.get("args", {}).get("bytes", 0.0))
    return time_us, nbytes


def launch_count(events: Iterable[dict[str, Any]]) -> int:
    """Host launch calls (kernel and graph launches) of a CUDA trace."""
    return sum(1 for e in events if e.get("cat") in CUDA_API_CATEGORIES and "Launch" in str(e.get("name", "")))


def totals(trace: dict[str, Any]) -> TraceTotals:
    """Kernel sum, union, count, copies and per-name time of one trace."""
    events = trace.get("traceEvents", [])
    source = kernel_source(events)
    kernels = cuda_kernels(events) if source == "cuda" else outermost_compute_ops(events)
    by_name: Counter = Counter()
    for iv in kernels:
        by_name[iv.name] += iv.end_us - iv.start_us
    copy_us, copy_bytes = copy_totals(events) if source == "cuda" else (0.0, 0.0)
    allreduces = [iv.end_us - iv.start_us for iv in kernels if is_allreduce(iv.name, source)]
    return TraceTotals(
        kernel_source=source,
        kernel_sum_us=sum(iv.end_us - iv.start_us for iv in kernels),
        kernel_union_us=interval_union_us(kernels),
        kernel_count=len(kernels),
        copy_us=copy_us,
        copy_bytes=copy_bytes,
        by_name_us=by_name,
        launch_count=launch_count(events) if source == "cuda" else 0,
        allreduce_us=sum(allreduces),
        allreduce_count=len(allreduces),
        durations_us=array("f", sorted(iv.end_us - iv.start_us for iv in kernels)),
    )
