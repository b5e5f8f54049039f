"""Ray as the dispatcher's worker backend: worker actors, their cells as object refs, and
their engines' health and phase asked on the actors' watch thread without blocking the
driver."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

from hostsweep.config.grid import Cell, EngineSpec
from hostsweep.config.redact import error_line
from hostsweep.measure.results import MeasureOptions
from hostsweep.run.actors import (
    WATCH_GROUP, WorkerHandle, ask_engines_to_close, end_workers_once_closed, new_worker, release_worker,
)
from hostsweep.run.faults import CallFailed, EngineDied, Outcome, WorkerLost, root_cause
from hostsweep.run.worklog import worker_log_path


def _engine_died(exc: BaseException) -> Optional[EngineDied]:
    """The EngineDied a worker raised, unwrapped from Ray's task error."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, EngineDied) else None


# How often a worker's watch thread is asked for its engine's health and its phase. The
# dispatcher polls after every cell: at a hundred quick cells a second, asking each time was
# two actor calls per cell, which the measuring worker's process had to answer too.
WATCH_INTERVAL_S = 0.25


class RayBackend:
    """Workers as Ray actors (run/actors.py); pending cells as object refs. `log_dir`: each
    worker logs to log_dir/<spec>.log (None: its output goes where Ray sends it)."""

    def __init__(self, log_dir: Optional[Path] = None) -> None:
        self.log_dir = log_dir
        self.ready_refs: dict[int, object] = {}
        self.health_refs: dict[int, object] = {}
        self.phase_refs: dict[int, object] = {}
        self.phases: dict[int, str] = {}
        self.asked_at: dict[tuple[str, int], float] = {}  # (what, worker) -> when last asked
        self.ready: set[int] = set()
        self.log_files: dict[int, tuple[Path, float]] = {}  # worker -> (its log, when it was asked for)
        self.nodes_alive: Optional[int] = None
        # Workers whose engines were asked to close, with the answers awaited: the sweep's
        # last close overlaps its recording and figures instead of delaying them.
        self.closing: list[tuple[list[WorkerHandle], object]] = []

    def now(self) -> float:
        return time.monotonic()

    def start(self, spec: EngineSpec, partner: Optional[EngineSpec] = None, partner_first: bool = False) -> WorkerHandle:
        log_file = str(worker_log_path(self.log_dir, spec.label)) if self.log_dir is not None else None
        worker = new_worker(spec, log_file, partner, partner_first)
        # host_info answers once the constructor (the engine start) has finished.
        self.ready_refs[id(worker)] = worker.actor.host_info.remote()
        if log_file is not None:
            self.log_files[id(worker)] = (Path(log_file), time.time())
        return worker

    def placed(self, worker: WorkerHandle) -> Optional[bool]:
        """Told by the worker's log: its constructor's first act writes a header there
        (run/worklog.redirect_output), so a log written since the worker was asked for means
        it runs on its node. None where the log is not on this file system (another node
        without a shared one) or there is none (hydra.verbose)."""
        if id(worker) in self.ready:
            return True
        if id(worker) not in self.log_files:
            return None
        log_file, asked = self.log_files[id(worker)]
        try:
            return log_file.stat().st_mtime >= asked - 1.0  # the file's clock may be a second coarse
        except FileNotFoundError:
            # on a cluster of several nodes, one without the driver's folders logs elsewhere
            return False if self._one_node() else None

    def _one_node(self) -> bool:
        if self.nodes_alive is None:
            import ray

            self.nodes_alive = sum(1 for node in ray.nodes() if node.get("Alive"))
        return self.nodes_alive == 1

    def submit(self, worker: WorkerHandle, cell: Cell, options: MeasureOptions, companions: tuple[Cell, ...] = ()) -> object:
        return worker.actor.measure.remote(cell, options, companions)

    def wait(self, pending: list[object], timeout_s: float) -> list[object]:
        import ray

        done, _ = ray.wait(pending, num_returns=1, timeout=timeout_s)
        return done

    def outcome(self, pending: object) -> Outcome:
        import ray

        try:
            return ray.get(pending)
        except ray.exceptions.RayActorError as exc:
            at_start = bool(getattr(exc, "actor_init_failed", False))
            # An engine that did not start: the error vLLM raised, not Ray's wrapper line.
            reason = root_cause(str(exc)) if at_start else error_line(exc)
            return WorkerLost(reason or type(exc).__name__, at_start=at_start)
        except ray.exceptions.RayError as exc:
            died = _engine_died(exc)
            if died is not None:
                return WorkerLost(f"engine died: {died}")
            return CallFailed(f"{type(exc).__name__}: {exc}")

    def started(self, worker: WorkerHandle) -> bool:
        import ray

        key = id(worker)
        if key in self.ready:
            return True
        ref = self.ready_refs.get(key)
        if ref is not None and ray.wait([ref], timeout=0)[0]:
            self.ready.add(key)
            del self.ready_refs[key]
            return True
        return False

    def engine_fault(self, worker: WorkerHandle) -> Optional[str]:
        """Asked on the actor's watch thread; the answer is read at the next poll, so a
        wedged worker never blocks the driver."""
        import ray

        key = id(worker)
        ref = self.health_refs.get(key)
        if ref is None:
            if self._due("health", key):
                self.health_refs[key] = worker.actor.engine_health.options(concurrency_group=WATCH_GROUP).remote()
            return None
        if not ray.wait([ref], timeout=0)[0]:
            return None
        del self.health_refs[key]
        try:
            return ray.get(ref)
        except ray.exceptions.RayError:
            return None  # the worker itself died: its cell's ref says so

    def phase(self, worker: WorkerHandle) -> Optional[str]:
        """The worker's phase as of the last poll; asked again on its watch thread."""
        import ray

        key = id(worker)
        ref = self.phase_refs.get(key)
        if ref is not None and ray.wait([ref], timeout=0)[0]:
            del self.phase_refs[key]
            try:
                self.phases[key] = ray.get(ref)
            except ray.exceptions.RayError:
                pass  # the worker died: its cell's ref says so
        if key not in self.phase_refs and self._due("phase", key):
            self.phase_refs[key] = worker.actor.phase.options(concurrency_group=WATCH_GROUP).remote()
        return self.phases.get(key)

    def _due(self, what: str, key: int) -> bool:
        """Whether a worker may be asked `what` again (WATCH_INTERVAL_S since last time)."""
        now = self.now()
        if now - self.asked_at.get((what, key), -WATCH_INTERVAL_S) < WATCH_INTERVAL_S:
            return False
        self.asked_at[(what, key)] = now
        return True

    def _forget(self, worker: WorkerHandle) -> bool:
        key = id(worker)
        self.ready_refs.pop(key, None)
        self.health_refs.pop(key, None)
        self.phase_refs.pop(key, None)
        self.phases.pop(key, None)
        self.asked_at.pop(("health", key), None)
        self.asked_at.pop(("phase", key), None)
        started = key in self.ready
        self.ready.discard(key)
        return started

    def release(self, worker: WorkerHandle) -> None:
        release_worker(worker, engine_started=self._forget(worker))

    def close(self, workers: list[WorkerHandle]) -> None:
        started = [w for w in workers if self.started(w) and self._forget(w)]
        if started:
            self.closing.append((started, ask_engines_to_close(started)))
        for worker in workers:
            if not any(worker is s for s in started):
                self._forget(worker)
                release_worker(worker, engine_started=False)

    def finish_closing(self) -> None:
        while self.closing:
            workers, answers = self.closing.pop(0)
            end_workers_once_closed(workers, answers)
