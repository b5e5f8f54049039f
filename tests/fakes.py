"""A hand-written worker backend for the dispatcher: workers in-process, on a fake clock.

Each worker is a real SweepWorker over the fake engine (so results are real CellResults),
but time is simulated: an engine takes `start_s` to start and a cell `cell_s` to measure,
and `wait` jumps the clock to the next event. Faults are scripted per cell key, one
fate per attempt, so a test states exactly what happens and when:

    "ok"            the cell is measured
    "raises"        the cell's own code fails: a FAILED result
    "worker-dies"   the worker process dies mid-cell (Ray: RayActorError)
    "engine-dies"   the engine's EngineCore is killed mid-cell and generate blocks forever
    "engine-raises" the engine dies and the worker sees it (EngineDied)
    "hangs"         the cell never returns, the engine stays alive
    "call-fails"    Ray cannot return the result
Engines of specs in `start_fails` die while starting. A worker's phase is read off the
fake clock: 'rep k of n' while a cell is in flight (k from the share of `cell_s` gone by),
'idle' between cells, as a real worker reports them.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from hostsweep.config.grid import Cell, EngineSpec
from hostsweep.measure.results import CellResult, MeasureOptions
from hostsweep.run.faults import CallFailed, Outcome, WorkerLost
from hostsweep.run.worker import SweepWorker

ENGINE_KILLED = "VLLM::EngineCore (pid 4242) killed by signal 9 (SIGKILL)"


@dataclass(eq=False)
class FakeWorker:
    spec: EngineSpec
    number: int
    ready_at: float
    real: Optional[SweepWorker]
    engine_dead_at: Optional[float] = None
    released: bool = False


@dataclass(eq=False)
class FakePending:
    worker: FakeWorker
    cell: Cell
    done_at: Optional[float]  # None: never returns
    outcome: Optional[Outcome] = None
    begins: float = 0.0  # when the worker starts measuring it


@dataclass
class FakeBackend:
    workdir: Path
    fates: dict[str, list[str]] = field(default_factory=dict)
    start_fails: frozenset[str] = frozenset()  # spec labels whose engine cannot start
    start_s: float = 5.0
    cell_s: float = 1.0
    clock: float = 0.0
    workers: list[FakeWorker] = field(default_factory=list)
    closed: list[FakeWorker] = field(default_factory=list)  # asked to close cleanly (not killed)
    closing: list[FakeWorker] = field(default_factory=list)  # asked to close, not yet ended
    events: list[str] = field(default_factory=list)  # 'start/close/end <spec label>', in order
    measured: list[str] = field(default_factory=list)  # cell keys a worker really measured
    pending: list[FakePending] = field(default_factory=list)  # every submitted cell
    phases_asked: list[str] = field(default_factory=list)  # what phase() answered, in order
    on_measure: Optional[object] = None  # called with each cell as it is measured (for tests)
    # (cell, companions) -> seconds the call takes, instead of cell_s for every call: a worker
    # timing a group in rounds answers its first cell after the group's time, the rest at once
    call_s: Optional[Callable[[Cell, tuple[Cell, ...]], float]] = None

    def __post_init__(self) -> None:
        self._numbers = itertools.count(1)

    def now(self) -> float:
        return self.clock

    def start(self, spec: EngineSpec, partner: Optional[EngineSpec] = None, partner_first: bool = False) -> FakeWorker:
        self.events.append(f"start {spec.label}" + (f" with {partner.label}" if partner is not None else "")
                           + (" (b first)" if partner_first else ""))
        real = None if spec.label in self.start_fails else SweepWorker(spec, str(self.workdir), partner=partner,
                                                                       partner_first=partner_first)
        worker = FakeWorker(spec, next(self._numbers), self.clock + self.start_s, real)
        self.workers.append(worker)
        return worker

    def _fate(self, cell: Cell) -> str:
        fates = self.fates.get(cell.key, [])
        return fates.pop(0) if fates else "ok"

    def submit(self, worker: FakeWorker, cell: Cell, options: MeasureOptions,
               companions: tuple[Cell, ...] = ()) -> FakePending:
        pending = self._submit(worker, cell, options, companions)
        pending.begins = max(self.clock, worker.ready_at)
        self.pending.append(pending)
        return pending

    def _submit(self, worker: FakeWorker, cell: Cell, options: MeasureOptions,
                companions: tuple[Cell, ...]) -> FakePending:
        begins = max(self.clock, worker.ready_at)
        if worker.real is None:
            return FakePending(worker, cell, worker.ready_at, WorkerLost("engine failed to start", at_start=True))
        fate, midway = self._fate(cell), begins + self.cell_s / 2
        if fate == "ok":
            if callable(self.on_measure):
                self.on_measure(cell)
            self.measured.append(cell.key)
            took = self.cell_s if self.call_s is None else self.call_s(cell, companions)
            return FakePending(worker, cell, begins + took, worker.real.measure(cell, options, companions))
        if fate == "raises":
            return FakePending(worker, cell, begins + self.cell_s,
                               CellResult(cell.key, cell.params(), "FAILED", None, "RuntimeError: boom"))
        if fate == "worker-dies":
            return FakePending(worker, cell, midway, WorkerLost("The actor died unexpectedly before finishing this task."))
        if fate in ("engine-dies", "engine-raises"):
            worker.engine_dead_at = midway
            lost = WorkerLost(f"engine died: {ENGINE_KILLED}")
            return FakePending(worker, cell, midway if fate == "engine-raises" else None, lost)
        if fate == "hangs":
            return FakePending(worker, cell, None)
        if fate == "call-fails":
            return FakePending(worker, cell, begins + self.cell_s, CallFailed("RaySystemError: object lost"))
        raise ValueError(fate)

    def wait(self, pending: list[FakePending], timeout_s: float) -> list[FakePending]:
        times = [p.done_at for p in pending if p.done_at is not None and not p.worker.released]
        soonest = min(times, default=None)
        if soonest is not None and soonest <= self.clock + timeout_s:
            self.clock = max(self.clock, soonest)
            return [p for p in pending if p.done_at is not None and p.done_at <= self.clock]
        self.clock += timeout_s
        return []

    def outcome(self, pending: FakePending) -> Outcome:
        assert pending.outcome is not None
        return pending.outcome

    def started(self, worker: FakeWorker) -> bool:
        return self.clock >= worker.ready_at

    def placed(self, worker: FakeWorker) -> Optional[bool]:
        return True  # a fake worker starts its engine at once

    def engine_fault(self, worker: FakeWorker) -> Optional[str]:
        dead = worker.engine_dead_at is not None and self.clock >= worker.engine_dead_at
        return ENGINE_KILLED if dead else None

    def phase(self, worker: FakeWorker) -> Optional[str]:
        running = [p for p in self.pending if p.worker is worker and p.begins <= self.clock
                   and (p.done_at is None or self.clock < p.done_at)]
        if not running:
            answer = "idle"
        else:
            reps = running[-1].cell.reps
            k = min(reps, 1 + int((self.clock - running[-1].begins) / self.cell_s * reps))
            answer = f"rep {k} of {reps}"
        self.phases_asked.append(answer)
        return answer

    def release(self, worker: FakeWorker) -> None:
        worker.released = True

    def close(self, workers: list[FakeWorker]) -> None:
        for worker in workers:
            self.closed.append(worker)
            self.closing.append(worker)
            self.events.append(f"close {worker.spec.label}")

    def finish_closing(self) -> None:
        for worker in self.closing:
            worker.released = True
            self.events.append(f"end {worker.spec.label}")
        self.closing.clear()


class VirtualClock:
    """A worker's clock (its `time` module), advanced only by the modelled work a test adds
    to `now`: timings with a known answer however busy the machine running the test is."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    @staticmethod
    def time() -> float:
        return time.time()

    @staticmethod
    def time_ns() -> int:
        return time.time_ns()
