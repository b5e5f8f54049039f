"""Dispatch cells to worker actors and stream results back, surviving faults.

One actor per engine spec, fed one cell at a time (so the driver knows what each worker
is measuring and for how long). Results are handed to `on_result` as each cell ends:
- a cell that raises inside the worker comes back FAILED with its reason;
- a cell running past `cell_timeout_s` is FAILED, its actor killed and replaced;
- a worker that dies (killed process, lost node) is replaced and its unfinished cell
  retried up to `max_retries` times; a worker whose engine cannot start fails the rest
  of its spec's cells with that reason instead of retrying forever.
A cell is reported exactly once.
"""
from __future__ import annotations

import logging
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable, Optional

from hostsweep.run.actors import WorkerHandle, new_worker, release_worker, stop_workers
from hostsweep.config.grid import Cell, EngineSpec, group_by_engine
from hostsweep.run.progress import ProgressReporter
from hostsweep.measure.results import CellResult, MeasureOptions

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FaultPolicy:
    cell_timeout_s: Optional[float] = None
    max_retries: int = 1
    poll_s: float = 2.0


def failed_result(cell: Cell, reason: str) -> CellResult:
    return CellResult(cell.key, cell.params(), "FAILED", None, reason)


class Dispatcher:
    def __init__(self, cells: list[Cell], options: MeasureOptions, on_result: Callable[[CellResult], None],
                 policy: FaultPolicy = FaultPolicy(), progress: Optional[ProgressReporter] = None,
                 worker_factory: Callable[[EngineSpec], WorkerHandle] = new_worker) -> None:
        self.queues = {spec: deque(group) for spec, group in group_by_engine(cells).items()}
        self.options, self.on_result, self.policy = options, on_result, policy
        self.progress = progress
        self.worker_factory = worker_factory
        self.actors: dict[EngineSpec, WorkerHandle] = {}
        # When each actor's engine finished starting: cell timeouts count from then, not
        # from submission, so a slow engine start is not charged to its first cell.
        self.ready_refs: dict[EngineSpec, object] = {}
        self.ready_at: dict[EngineSpec, float] = {}
        self.inflight: dict[object, tuple[EngineSpec, Cell, float]] = {}
        self.attempts: Counter = Counter()
        self.done = 0

    def _report(self, result: CellResult) -> None:
        self.done += 1
        self.on_result(result)

    def _submit_next(self, spec: EngineSpec) -> None:
        if not self.queues[spec]:
            return
        if spec not in self.actors:
            self.actors[spec] = self.worker_factory(spec)
            self.ready_refs[spec] = self.actors[spec].actor.host_info.remote()
            self.ready_at.pop(spec, None)
        cell = self.queues[spec].popleft()
        ref = self.actors[spec].actor.measure.remote(cell, self.options)
        self.inflight[ref] = (spec, cell, time.monotonic())

    def _replace_actor(self, spec: EngineSpec) -> None:
        worker = self.actors.pop(spec, None)
        self.ready_refs.pop(spec, None)
        self.ready_at.pop(spec, None)
        if worker is not None:
            release_worker(worker)

    def _on_actor_died(self, spec: EngineSpec, cell: Cell, exc: Exception) -> None:
        self._replace_actor(spec)
        if getattr(exc, "actor_init_failed", False):  # the engine cannot start: retrying repeats it
            reason = f"worker for {spec.label} failed to start: {exc}"
            for doomed in [cell, *self.queues[spec]]:
                self._report(failed_result(doomed, reason))
            self.queues[spec].clear()
            return
        self.attempts[cell.key] += 1
        if self.attempts[cell.key] <= self.policy.max_retries:
            log.warning("worker for %s died during %s; retrying (%d/%d)", spec.label, cell.key,
                        self.attempts[cell.key], self.policy.max_retries)
            self.queues[spec].appendleft(cell)
        else:
            self._report(failed_result(cell, f"worker died {self.attempts[cell.key]} times: {exc}"))

    def _collect(self, ref: object) -> None:
        import ray

        spec, cell, _ = self.inflight.pop(ref)
        try:
            result = ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            self._on_actor_died(spec, cell, exc)
        except ray.exceptions.RayError as exc:
            self._report(failed_result(cell, f"{type(exc).__name__}: {exc}"))
        else:
            self._report(result)
        self._submit_next(spec)
        self._release_if_done(spec)

    def _release_if_done(self, spec: EngineSpec) -> None:
        """Close a worker whose cells are all done: a CPU worker holds a whole node, so the
        next engine configuration cannot start until it is gone."""
        if self.queues[spec] or spec not in self.actors or any(s == spec for s, _, _ in self.inflight.values()):
            return
        self.ready_refs.pop(spec, None)
        self.ready_at.pop(spec, None)
        stop_workers([self.actors.pop(spec)])

    def _note_ready_workers(self) -> None:
        import ray

        for spec, ref in list(self.ready_refs.items()):
            if ray.wait([ref], timeout=0)[0]:
                self.ready_at[spec] = time.monotonic()
                del self.ready_refs[spec]

    def _expire_timeouts(self) -> None:
        limit = self.policy.cell_timeout_s
        if limit is None:
            return
        self._note_ready_workers()
        now = time.monotonic()
        for ref, (spec, cell, submitted) in list(self.inflight.items()):
            if spec not in self.ready_at:
                continue  # engine still starting
            if now - max(submitted, self.ready_at[spec]) > limit:
                del self.inflight[ref]
                self._replace_actor(spec)  # the only way to stop a running actor task
                self._report(failed_result(cell, f"timed out after {limit:.0f} s"))
                self._submit_next(spec)

    def _current(self) -> dict[str, str]:
        return {spec.label: f"b{cell.batch} ctx{cell.ctx}" for spec, cell, _ in self.inflight.values()}

    def run(self) -> None:
        import ray

        try:
            for spec in self.queues:
                self._submit_next(spec)
            while self.inflight:
                if self.progress:
                    self.progress.update(self.done, self._current())
                done, _ = ray.wait(list(self.inflight), num_returns=1, timeout=self.policy.poll_s)
                for ref in done:
                    self._collect(ref)
                self._expire_timeouts()
            if self.progress:
                self.progress.update(self.done, {})
        finally:
            stop_workers(list(self.actors.values()))
