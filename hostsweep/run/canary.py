"""The speed canary: a fixed workload the worker times beside every timed pair, so each
pair carries how fast the machine itself was when it ran.

A cloud VM changes speed by tens of percent between minutes while /proc shows nothing:
the hypervisor, not a neighbour process. The contention record (run/contention.py) cannot
see that; a fixed workload timed in the same breath can. The canary does the same work
every time and touches no engine: a pure-Python loop (the interpreter's speed, what a
decode step's host half runs on) and, where the engine has loaded torch, small matrix
products (the CPU's arithmetic). It runs between generates, never inside a timed one,
and takes about a millisecond or two.

Where the worker sees a CUDA device, a fixed kernel is timed too, recorded apart
(`gpu_canary_ms`): half-precision matrix products on the worker's first visible GPU, timed
with CUDA events, so a GPU's own clocks (power or thermal capping, a shared device) are told
from the host's speed. Its tensors are made on the first timing, after the engine has
started, so the engine's memory profiling never sees them.
"""
from __future__ import annotations

import sys
import time
from typing import Callable, Optional

# Sized for about 1 ms of each part on a 2-core cloud VM: long enough to be timed well
# by perf_counter, short enough to cost under 1 % of a pair.
PYTHON_LOOP = 20_000
MATMUL_SIZE, MATMUL_REPEATS = 64, 8
# The GPU kernel: 2048 x 2048 half-precision products, about 17 GFLOP each: tens of µs on
# an H100 or H200, so eight of them are long beside the launch and event overhead and
# still well under a millisecond.
GPU_MATMUL_SIZE, GPU_MATMUL_REPEATS = 2048, 8


def python_loop() -> int:
    """The canary's interpreter part: PYTHON_LOOP iterations of a bytecode loop (public: the
    candidates benchmark times it alone)."""
    total = 0
    for i in range(PYTHON_LOOP):
        total += i * i % 7
    return total


def _torch_part() -> Optional[Callable[[], None]]:
    """The matrix-product part, where the engine already imported torch (vLLM does); None
    otherwise (the fake engine): importing torch here would add seconds to a worker's start."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    a = torch.ones((MATMUL_SIZE, MATMUL_SIZE))
    b = torch.ones((MATMUL_SIZE, MATMUL_SIZE))

    def run() -> None:
        for _ in range(MATMUL_REPEATS):  # small enough that BLAS stays on one thread
            torch.mm(a, b)

    return run


def _cuda_of(torch) -> Optional[object]:
    """torch.cuda where the loaded torch sees a CUDA device, else None (the CPU build)."""
    cuda = getattr(torch, "cuda", None) if torch is not None else None
    try:
        return cuda if cuda is not None and cuda.is_available() and cuda.device_count() > 0 else None
    except RuntimeError:  # a driver that cannot be reached counts as no device
        return None


class GpuKernel:
    """The fixed GPU kernel, timed with CUDA events on the current device; its tensors are
    allocated on the first timing (after the engine's start), and that first timing, which
    pays for the allocation and the kernel's first launch, is not a measurement."""

    def __init__(self, torch, cuda) -> None:
        self._torch, self._cuda = torch, cuda
        self._operands = None

    def time_ms(self) -> float:
        if self._operands is None:
            shape = (GPU_MATMUL_SIZE, GPU_MATMUL_SIZE)
            self._operands = tuple(self._torch.ones(shape, dtype=self._torch.float16, device="cuda")
                                   for _ in range(2))
            self._run()
        return self._run()

    def _run(self) -> float:
        a, b = self._operands
        start, end = self._cuda.Event(enable_timing=True), self._cuda.Event(enable_timing=True)
        start.record()
        for _ in range(GPU_MATMUL_REPEATS):
            self._torch.mm(a, b)
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end))  # CUDA events answer in milliseconds


class Canary:
    """Times the fixed workload; `time_ms()` is one measurement in milliseconds, and
    `time_gpu_ms()` the GPU kernel's (None without a CUDA device)."""

    def __init__(self) -> None:
        self._torch = _torch_part()
        torch = sys.modules.get("torch")
        cuda = _cuda_of(torch)
        self._gpu = GpuKernel(torch, cuda) if cuda is not None else None
        self.time_ms()  # the first run pays for imports and allocation: not a measurement

    @property
    def parts(self) -> str:
        return ("python+torch" if self._torch is not None else "python") + ("+cuda" if self._gpu is not None else "")

    def time_gpu_ms(self) -> Optional[float]:
        return self._gpu.time_ms() if self._gpu is not None else None

    def time_ms(self) -> float:
        start = time.perf_counter()
        python_loop()
        if self._torch is not None:
            self._torch()
        return (time.perf_counter() - start) * 1e3
