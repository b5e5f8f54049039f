"""The speed canary: a fixed workload the worker times beside every timed pair, so each
pair carries how fast the machine itself was when it ran.

A cloud VM changes speed by tens of percent between minutes while /proc shows nothing:
the hypervisor, not a neighbour process. The contention record (run/contention.py) cannot
see that; a fixed workload timed in the same breath can. The canary does the same work
every time and touches no engine: a pure-Python loop (the interpreter's speed, what a
decode step's host half runs on) and, where the engine has loaded torch, small matrix
products (the CPU's arithmetic). It runs between generates, never inside a timed one,
and takes about a millisecond or two.
"""
from __future__ import annotations

import sys
import time
from typing import Callable, Optional

# Sized for about 1 ms of each part on a 2-core cloud VM: long enough to be timed well
# by perf_counter, short enough to cost under 1 % of a pair.
PYTHON_LOOP = 20_000
MATMUL_SIZE, MATMUL_REPEATS = 64, 8


def _python_part() -> int:
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


class Canary:
    """Times the fixed workload; `time_ms()` is one measurement in milliseconds."""

    def __init__(self) -> None:
        self._torch = _torch_part()
        self.time_ms()  # the first run pays for imports and allocation: not a measurement

    @property
    def parts(self) -> str:
        return "python+torch" if self._torch is not None else "python"

    def time_ms(self) -> float:
        start = time.perf_counter()
        _python_part()
        if self._torch is not None:
            self._torch()
        return (time.perf_counter() - start) * 1e3
