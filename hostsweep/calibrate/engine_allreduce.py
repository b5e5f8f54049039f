"""The all-reduce on the engine's own path: T_ar measured through the communicator vLLM's
tensor-parallel group uses, at the decode message sizes of a study's models, with a CI per
size.

Why not a standalone torch.distributed all-reduce (allreduce_bench.py, the TP study's [2]
method): the engine never runs it. vLLM's CPU build reduces through shared memory
(`CpuCommunicator` -> `torch.ops._C.shm_allreduce`) where its kernels for this CPU carry that
op (AVX-512), else through gloo on the TP group (cpu_engine_path), and on GPUs vLLM picks its custom
all-reduce kernels for small messages where P2P allows, else NCCL (or symmetric memory).
A bound built from another path's latency can falsify the model by construction.

So each rank here initializes vLLM's distributed state exactly as a vLLM worker does
(`init_worker_distributed_environment` under a VllmConfig with the engine's TP degree and
custom-all-reduce setting; on the CPU build the shared-memory group name the CPU worker
sets) and times `get_tp_group().all_reduce`, the call the model's row-parallel layers make.
Which path ran is not assumed: a profiled pass records the op (CPU) or kernel (GPU) names of
every size, named by `path_from_op_names`.

On GPUs the same function runs on a node of the SKU (calibrate/microbench.run_on_sku); it
cannot be run on a CPU-only machine, and its GPU-specific choices (device, synchronization)
are in `rank_device`, tested with fakes.
"""
from __future__ import annotations

import logging
import os
import socket
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import pandas as pd

from hostsweep.measure.intervals import median_ci
from hostsweep.measure.traces import ALLREDUCE_CPU_OPS, ALLREDUCE_CUDA_KERNELS

CI_LEVEL = 0.95
WARMUPS = 5
INNER_MAX = 20  # back-to-back all-reduces per timed sample for the smallest messages
INNER_BYTES = 4e6  # ... fewer as messages grow: about this many bytes per sample
METHOD = "vllm get_tp_group().all_reduce"  # what the calibration records as its method
# Path names, from the op or kernel names a profiled all-reduce leaves
CPU_SHM, GLOO, CUSTOM, NCCL, SYMM_MEM, UNKNOWN = ("cpu_shm", "gloo", "custom_allreduce", "nccl", "symm_mem",
                                                  "unknown")
_KERNEL_PATHS = (("cross_device_reduce", CUSTOM), ("AllReduce", NCCL), ("multimem_all_reduce", SYMM_MEM),
                 ("one_shot_all_reduce", SYMM_MEM), ("two_shot_all_reduce", SYMM_MEM))


def path_from_op_names(names: Iterable[str]) -> str:
    """The all-reduce path a profiled call took, from its trace's op and kernel names: the
    CPU build's shared-memory op, gloo's op, vLLM's custom all-reduce kernels, NCCL's or the
    symmetric-memory ones (the names measure/traces.py counts in situ). Several paths joined
    with '+' (a GPU all-reduce that also ran a CPU fallback would show both)."""
    found: list[str] = []
    for name in names:
        if name in ALLREDUCE_CPU_OPS:
            found.append(CPU_SHM if "shm" in name else GLOO)
        elif any(part in name for part in ALLREDUCE_CUDA_KERNELS):
            found.append(next((path for part, path in _KERNEL_PATHS if part in name), UNKNOWN))
    return "+".join(sorted(set(found))) or UNKNOWN


def cpu_engine_path() -> str:
    """The all-reduce path vLLM's CPU build takes on this machine, by vLLM's own selection
    (CpuCommunicator): its shared-memory op where the kernels vLLM loads for this CPU carry it,
    else torch.distributed's gloo. vLLM loads `_C` (AVX-512 with BF16), `_C_AVX512` or
    `_C_AVX2` (vllm/platforms/cpu.py import_kernels); the AVX2 build has no shm_allreduce, so
    on a CPU without AVX-512 the engine's ranks reduce through gloo."""
    import torch
    from vllm.platforms import current_platform
    from vllm.platforms.interface import CpuArchEnum

    current_platform.import_kernels()
    shm_arch = current_platform.get_cpu_architecture() in (CpuArchEnum.X86, CpuArchEnum.ARM, CpuArchEnum.POWERPC,
                                                           CpuArchEnum.S390X)
    return CPU_SHM if shm_arch and hasattr(torch.ops._C, "init_shm_manager") else GLOO


@dataclass(frozen=True)
class RankDevice:
    """Where a rank's tensors live and how to wait for its device."""

    device: str  # "cpu" or "cuda:<local rank>"
    gpu: bool

    def synchronize(self) -> Callable[[], None]:
        if not self.gpu:
            return lambda: None
        import torch

        return torch.cuda.synchronize


def rank_device(device_type: str, local_rank: int) -> RankDevice:
    """The rank's device as vLLM's platform names it ("cuda" on NVIDIA GPUs, "cpu" on the CPU
    build): one GPU per rank, as vLLM's workers bind them."""
    if device_type == "cuda":
        return RankDevice(f"cuda:{local_rank}", True)
    if device_type == "cpu":
        return RankDevice("cpu", False)
    raise ValueError(f"the engine-path all-reduce supports vLLM's cuda and cpu platforms, not {device_type!r}")


def inner_count(nbytes: int) -> int:
    """All-reduces per timed sample: one small all-reduce is microseconds, below a shared
    machine's timer and scheduling jitter, so a sample averages several (as nccl-tests)."""
    return max(1, min(INNER_MAX, int(INNER_BYTES // max(nbytes, 1))))


def summarize_samples(nbytes: int, samples: np.ndarray) -> dict[str, Any]:
    """One size's row: median seconds per all-reduce with its order-statistic CI. `samples`
    is (reps, ranks): a collective ends when its slowest rank does, so a sample is the
    slowest rank's time from the common barrier."""
    per_sample = np.asarray(samples, float).max(axis=1)
    ci = median_ci(per_sample, CI_LEVEL)
    return {"bytes": int(nbytes), "seconds": float(np.median(per_sample)), "ci_low_s": ci.low, "ci_high_s": ci.high,
            "ci_coverage": ci.coverage, "reps": int(per_sample.size)}


@contextmanager
def rank_environment(world: int) -> Iterator[Callable[[int], Any]]:
    """Start each rank as vLLM's multiprocessing executor starts an engine's TP workers:
    VLLM_CPU_OMP_THREADS_BIND as the engine gets it (engines/vllm_engine.cpu_thread_binding)
    and, around each rank's start, vLLM's own OMPProcessManager environment (OMP_NUM_THREADS,
    OMP_PLACES, OMP_PROC_BIND), which binds the rank's OpenMP threads and nothing else. gloo's
    threads stay free to run on any core, as the engine's do: binding the whole rank process
    to its core (as this calibration once did) put gloo's threads on the caller's core and
    timed the all-reduce at twice what the engine paid. Yields `rank_env(rank)`, a context
    around that rank's start; on GPUs vLLM's manager sets nothing."""
    from vllm.config import ParallelConfig, VllmConfig
    from vllm.platforms import current_platform
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    from hostsweep.engines.vllm_engine import cpu_thread_binding

    saved = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    if current_platform.is_cpu() and saved is None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(sorted(os.sched_getaffinity(0)), world)
    try:
        # its binding table (logged at INFO) is the engine's worker log's business, not the console's
        quiet = logging.getLogger(OMPProcessManager.__module__)
        level, quiet.level = quiet.level, logging.WARNING
        try:
            manager = OMPProcessManager(VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=world)))
        finally:
            quiet.setLevel(level)
        yield lambda rank: manager.configure_omp_envs(rank, rank)
    finally:
        if saved is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)


def _timed_sizes(group: Any, device: RankDevice, sizes: list[int], reps: int, dtype: Any) -> list[list[float]]:
    import torch
    import torch.distributed as dist

    sync = device.synchronize()
    per_size = []
    for nbytes in sizes:
        # zeros stay zeros however often they are summed in place (ones would overflow bf16)
        tensor = torch.zeros(max(1, nbytes // torch.tensor([], dtype=dtype).element_size()), dtype=dtype,
                             device=device.device)
        for _ in range(WARMUPS):
            group.all_reduce(tensor)
        sync()
        inner, times = inner_count(nbytes), []
        for _ in range(reps):
            dist.barrier(group=group.cpu_group)
            start = time.perf_counter()
            for _ in range(inner):
                group.all_reduce(tensor)
            sync()
            times.append((time.perf_counter() - start) / inner)
        per_size.append(times)
    return per_size


@contextmanager
def native_output_silenced() -> Iterator[None]:
    """fds 1 and 2 on /dev/null while the block runs: the profiler's native library writes a
    line to them at each start and stop ('USDT: ... profiler_start'), and a rank's fds are the
    user's console. Python errors still travel: the rank's exception goes to its parent."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
        os.close(null)


def _profiled_paths(group: Any, device: RankDevice, sizes: list[int], dtype: Any) -> list[str]:
    """Per size, the path one all-reduce took, read from the torch profiler's names."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.gpu else [])
    paths = []
    for nbytes in sizes:
        tensor = torch.zeros(max(1, nbytes // torch.tensor([], dtype=dtype).element_size()), dtype=dtype,
                             device=device.device)
        with native_output_silenced(), profile(activities=activities) as prof:
            group.all_reduce(tensor)
            device.synchronize()()
        paths.append(path_from_op_names(event.name for event in prof.events()))
    return paths


def _rank_main(rank: int, world: int, port: int, sizes: list[int], reps: int, dtype_name: str,
               disable_custom_all_reduce: bool, queue: Any) -> None:
    import torch
    import torch.distributed as dist
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import (destroy_distributed_environment, destroy_model_parallel,
                                                 get_tp_group)
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

    device = rank_device(current_platform.device_type, rank)
    init_method = f"tcp://127.0.0.1:{port}"
    if device.gpu:
        torch.cuda.set_device(rank)
    else:
        # the CPU worker names the shared-memory group after its init method (vllm
        # v1/worker/cpu_worker.py): CpuCommunicator falls back to gloo without it
        os.environ["VLLM_DIST_IDENT"] = init_method.split(":")[-1]
    # the CPU worker forces disable_custom_all_reduce; on GPUs it is the engine's setting
    config = VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=world,
                                                       disable_custom_all_reduce=disable_custom_all_reduce))
    dtype = getattr(torch, dtype_name)
    with set_current_vllm_config(config):
        init_worker_distributed_environment(config, rank, init_method, rank, current_platform.dist_backend)
        group = get_tp_group()
        times = _timed_sizes(group, device, sizes, reps, dtype)
        paths = _profiled_paths(group, device, sizes, dtype)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, times, group=group.cpu_group)
        communicator = type(group.device_communicator).__name__ if group.device_communicator else "none"
        if rank == 0:
            rows = [{**summarize_samples(nbytes, np.array([g[i] for g in gathered]).T), "path": paths[i]}
                    for i, nbytes in enumerate(sizes)]
            queue.put((rows, communicator))
        destroy_model_parallel()
        destroy_distributed_environment()


def _rank_entry(rank: int, failures: Any, *args: Any) -> None:
    """A rank's process: its error travels to the parent, whose console the user reads."""
    try:
        _rank_main(rank, *args)
    except BaseException:
        failures.put((rank, traceback.format_exc()))
        raise


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_engine_allreduce(ranks: int, sizes: np.ndarray, reps: int, dtype: str = "bfloat16",
                         disable_custom_all_reduce: bool = False) -> pd.DataFrame:
    """Per message size (bytes of `dtype`), the median seconds of one all-reduce through
    vLLM's tensor-parallel group of `ranks` local ranks, its CI, and the path it took
    (`path`; `communicator` names vLLM's communicator class)."""
    import multiprocessing as mp

    if ranks < 2:
        raise ValueError(f"an all-reduce needs at least 2 ranks, got {ranks}")
    if not ranks <= len(os.sched_getaffinity(0)):
        raise ValueError(f"{ranks} ranks need at least {ranks} CPU cores, this process has "
                         f"{len(os.sched_getaffinity(0))}")
    from hostsweep.run.hygiene import scratch_for_vllm

    context = mp.get_context("spawn")
    queue, failures = context.SimpleQueue(), context.SimpleQueue()
    args = (ranks, _free_port(), [int(s) for s in sizes], reps, dtype, disable_custom_all_reduce, queue)
    # the ranks' vLLM message queues bind IPC sockets: in a folder of this call's own, as an
    # engine's are (run/hygiene.py), never one a closed engine left named in the environment
    with scratch_for_vllm(), rank_environment(ranks) as rank_env:
        processes = []
        for rank in range(ranks):
            with rank_env(rank):  # read by the rank's OpenMP runtime when it loads: set before the start
                process = context.Process(target=_rank_entry, args=(rank, failures, *args), daemon=True)
                process.start()
            processes.append(process)
        for process in processes:
            process.join()
    if not failures.empty():
        rank, text = failures.get()
        raise RuntimeError(f"all-reduce calibration rank {rank} failed:\n{text}")
    if any(process.exitcode != 0 for process in processes):
        raise RuntimeError("all-reduce calibration: a rank exited with "
                           f"{[process.exitcode for process in processes]} and said nothing")
    rows, communicator = queue.get()
    frame = pd.DataFrame(rows)
    frame["communicator"], frame["ranks"], frame["dtype"] = communicator, ranks, dtype
    return frame


def describe_paths(frame: pd.DataFrame) -> str:
    """The path(s) a sweep took, for the calibration's `method`: e.g. 'CpuCommunicator: cpu_shm'."""
    paths = ", ".join(dict.fromkeys(str(p) for p in frame["path"]))
    return f"{METHOD} ({frame['communicator'].iloc[0]}: {paths}; {int(frame['ranks'].iloc[0])} ranks, " \
           f"{frame['dtype'].iloc[0]})"
