"""The worker: owns one started engine and measures every cell of its engine spec.

A plain class, so it runs in-process in tests; cluster.py wraps it as a Ray actor.
"""
from __future__ import annotations

import logging
import os
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from hostsweep.engines.base import Engine, start_engine
from hostsweep.grid import Cell, EngineSpec
from hostsweep.measure import CellMeasurement, random_prompts, run_protocol, summarize
from hostsweep.provenance import hostname

log = logging.getLogger(__name__)

# Ray exports OMP_NUM_THREADS=<num_cpus> into actors it schedules. The engine's compute
# threads must be sized as in a plain process, or the harness changes what it measures
# (seen here: 2.9 -> 4.5 ms per step with num_cpus=1).
RAY_THREAD_ENV = ("OMP_NUM_THREADS",)


@dataclass(frozen=True)
class CellResult:
    key: str
    params: dict[str, object]
    status: str  # "FINISHED" or "FAILED"
    measurement: Optional[CellMeasurement]
    error: Optional[str]
    host: dict[str, str] = field(default_factory=dict)
    duration_s: float = 0.0


def release_ray_thread_limits(environ: dict[str, str]) -> dict[str, str]:
    """Drop the thread caps Ray sets for actors; return what was dropped, for the record."""
    return {key: environ.pop(key) for key in RAY_THREAD_ENV if key in environ}


def prompt_seed(cell: Cell) -> int:
    """Prompts differ across cells but are the same for every rep of one cell."""
    return cell.seed * 1_000_003 + cell.batch * 10_007 + cell.ctx


class SweepWorker:
    def __init__(self, spec: EngineSpec, workdir: Optional[str] = None) -> None:
        dropped = release_ray_thread_limits(os.environ)  # type: ignore[arg-type]
        self.spec = spec
        # On a remote node the driver's folders do not exist: default to a local temp dir.
        folder = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="hostsweep-"))
        self.engine: Engine = start_engine(spec, folder)
        self.host = {
            "hostname": hostname(),
            **self.engine.describe(),
            "cpu_affinity": str(len(os.sched_getaffinity(0))),
            "dropped_env": ",".join(f"{k}={v}" for k, v in dropped.items()) or "none",
        }

    def host_info(self) -> dict[str, str]:
        return dict(self.host)

    def _timed_generate(self, prompts: list[list[int]]):
        def timed(tokens: int) -> float:
            start = time.perf_counter()
            lengths = self.engine.generate(prompts, tokens)
            elapsed = time.perf_counter() - start
            # A request that stopped early would shrink wall_T and corrupt the step time.
            if any(n != tokens for n in lengths):
                raise RuntimeError(f"asked for {tokens} tokens per request, engine produced {lengths}")
            return elapsed

        return timed

    def measure(self, cell: Cell, resamples: int, ci_level: float) -> CellResult:
        """Run the differencing protocol on one cell; failures become FAILED results."""
        start = time.perf_counter()
        try:
            prompts = random_prompts(cell.batch, cell.ctx, self.engine.vocab_size(), prompt_seed(cell))
            timings = run_protocol(self._timed_generate(prompts), cell.T, cell.warmups, cell.reps)
            measurement = summarize(timings, resamples, ci_level, cell.seed)
        except Exception as exc:  # the sweep goes on; the reason is recorded with the cell
            log.error("cell %s failed: %s", cell.key, exc)
            reason = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=5)}"
            return CellResult(cell.key, cell.params(), "FAILED", None, reason, self.host_info(),
                              time.perf_counter() - start)
        return CellResult(cell.key, cell.params(), "FINISHED", measurement, None, self.host_info(),
                          time.perf_counter() - start)

    def close(self) -> None:
        self.engine.close()
