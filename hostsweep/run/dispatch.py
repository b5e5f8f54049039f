"""Dispatch cells to workers and stream results back, surviving faults.

One worker per engine spec, fed one cell at a time (so the driver knows what each worker
is measuring and for how long). Results are handed to `on_result` as each cell ends,
once its worker has been given its next cell (recording a result, a journal write and a
log line, then overlaps the next measurement instead of leaving the worker idle):
- a cell that raises inside the worker comes back FAILED with its reason;
- a worker lost mid-cell (its process killed, its node gone, its engine process dead)
  or a cell past its timeout: the worker is replaced and the cell retried up to
  `max_retries` times, each attempt's reason kept with the result;
- a worker whose engine cannot start (or does not within engine_start_timeout_s) fails
  its spec's cells with that reason instead of retrying forever;
- `should_stop` (e.g. tracking down too long) ends the sweep cleanly: cells in flight
  are abandoned, not reported, and the workers released.
A cell is reported at most once. The state machine talks to workers only through a
WorkerBackend: Ray's (run/backend.py) in a sweep, an in-process fake in tests. A cell
that fails carries its worker's log file and the log's end (run/worklog.py).
"""
from __future__ import annotations

import logging
from collections import Counter, defaultdict, deque
from itertools import chain, islice, zip_longest
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional, Protocol

from hostsweep.config.grid import Cell, EngineSpec, group_by_engine, partner_specs, rounds_partners
from hostsweep.measure.replicates import merge_starts
from hostsweep.measure.results import CellResult, MeasureOptions, stability_rules_of
from hostsweep.run import signals
from hostsweep.run.faults import CallFailed, FaultPolicy, Outcome, WorkerLost, first_exception
from hostsweep.run.progress import ProgressReporter
from hostsweep.run.worklog import last_start, log_tail, worker_log_path

log = logging.getLogger(__name__)


class WorkerBackend(Protocol):
    """Where workers run. Handles are opaque to the dispatcher."""

    def now(self) -> float:
        """Seconds on a monotonic clock."""

    def start(self, spec: EngineSpec, partner: Optional[EngineSpec] = None, partner_first: bool = False) -> object:
        """A new worker; its engine starts in the background (and `partner`'s beside it, in the
        same worker: a paired study's side b, measured in paired rounds; its engine first with
        partner_first, pair.start_first=b)."""

    def submit(self, worker: object, cell: Cell, options: MeasureOptions, companions: tuple[Cell, ...] = ()) -> object:
        """Ask the worker to measure a cell (with `companions`, the cells it will be asked for
        next, in interleaved rounds); a pending handle."""

    def wait(self, pending: list[object], timeout_s: float) -> list[object]:
        """The pending handles that are done, waiting up to timeout_s for the first."""

    def outcome(self, pending: object) -> Outcome:
        """What a done handle brought back."""

    def started(self, worker: object) -> bool:
        """Whether the worker's engine is up (or its start has failed)."""

    def placed(self, worker: object) -> Optional[bool]:
        """Whether the worker runs on its node (its engine starting), False while it is still
        queued for one, None where that cannot be told."""

    def engine_fault(self, worker: object) -> Optional[str]:
        """Why the worker's engine is dead, or None while it is alive (or not yet known)."""

    def phase(self, worker: object) -> Optional[str]:
        """What a started worker is doing ('rep: round 3 of 12, 6 cell(s)'), or None while not yet known."""

    def release(self, worker: object) -> None:
        """Kill the worker and its engine now; free what it holds."""

    def close(self, workers: list[object]) -> None:
        """Begin closing engines cleanly; the workers are released in finish_closing, which
        the dispatcher calls at once while other cells remain (a closing worker may hold what
        the next one needs: a CPU node, GPUs) and the sweep calls once it has recorded."""

    def finish_closing(self) -> None:
        """Wait for the engines close() began (a bounded time), then release their workers."""


def failed_result(cell: Cell, reason: str, log_file: Optional[Path] = None) -> CellResult:
    """A cell that failed outside its worker's measure (lost worker, engine start, Ray):
    with the worker's log and its end when the log is on this machine."""
    if log_file is None or not log_file.is_file():
        return CellResult(key=cell.key, params=cell.params(), status="FAILED", measurement=None, error=reason)
    return CellResult(key=cell.key, params=cell.params(), status="FAILED", measurement=None, error=reason,
                      host={"worker_log": str(log_file)}, log_tail=log_tail(log_file))


WAITING = "waiting for Ray to place its worker"
# Ray launches a free node's worker in a few seconds (more under load); a wait this long is a
# queue behind another worker, which the ready line then counts apart.
QUEUE_WORTH_SAYING_S = 30.0


class Dispatcher:
    def __init__(self, cells: list[Cell], options: MeasureOptions, on_result: Callable[[CellResult], None],
                 backend: WorkerBackend, policy: FaultPolicy = FaultPolicy(),
                 progress: Optional[ProgressReporter] = None,
                 should_stop: Callable[[], Optional[str]] = lambda: None, log_dir: Optional[Path] = None,
                 prestarted: Optional[dict[EngineSpec, tuple[object, float]]] = None,
                 partner_first: bool = False) -> None:
        self.partner_first = partner_first  # paired rounds: side b's engine starts before side a's
        self.queues = {spec: deque(group) for spec, group in group_by_engine(cells).items()}
        # Paired rounds (pair.design=rounds): side b's engine starts in side a's worker, which
        # times a cell's two sides back to back in every round; the pair is one queue (a1 b1
        # a2 b2 ...), so a cell and its partner go to that worker in one group of companions.
        self.rounds_partner = rounds_partners(cells)
        for a, b in self.rounds_partner.items():
            both = zip_longest(self.queues[a], self.queues.pop(b))
            self.queues[a] = deque(cell for cell in chain.from_iterable(both) if cell is not None)
        self.worker_spec = {b: a for a, b in self.rounds_partner.items()}
        # measure.replicates: each spec's cells again in fresh engine starts; a cell's results
        # are held until its last start, then merged (measure/replicates.py) and reported.
        self.replicates = max((cell.replicates for cell in cells), default=1)
        self.spec_cells = {spec: tuple(queue) for spec, queue in self.queues.items()} if self.replicates > 1 else {}
        self.start_number = {spec: 1 for spec in self.queues}
        # A paired study (pair.against): each engine group and its partner take turns, one
        # engine start at a time, A B, B A, A B ... (ABBA: drift that is linear over a pair
        # of pairs lands on both sides alike); the turns of each pair, keyed by its side a.
        self.partner = {spec: other for spec, other in partner_specs(cells).items()
                        if spec in self.queues and other in self.queues}
        self.turns: dict[EngineSpec, deque[EngineSpec]] = {
            a: deque(spec for i in range(self.replicates) for spec in ((a, b) if i % 2 == 0 else (b, a)))
            for a, b in self.partner.items() if a.side == "a"}
        self.held: dict[str, list[CellResult]] = defaultdict(list)
        self.log_dir = log_dir  # where workers log (workers/<spec>.log), None: not to files
        self.options, self.on_result, self.policy = options, on_result, policy
        self.backend, self.progress, self.should_stop = backend, progress, should_stop
        self.workers: dict[EngineSpec, object] = {}
        # Per spec: the keys of cells its current worker was sent as companions and has not
        # been asked for yet. Such a cell was timed in an earlier cell's rounds, which the
        # worker keeps: it is sent alone, not with its own 63 companions pickled again.
        # Specs whose worker returned a failed cell: its rounds may be lost with it, so each
        # cell goes with its companions again (the worker uses those it keeps, times the
        # rest) until a new worker starts.
        self.given: dict[EngineSpec, set[str]] = defaultdict(set)
        self.unsure: set[EngineSpec] = set()
        self.started_at: dict[EngineSpec, float] = {}
        # A not yet ready worker's placement as last asked (backend.placed: None where it cannot
        # be told), and when it was first seen on its node.
        self.placement: dict[EngineSpec, Optional[bool]] = {}
        self.placed_at: dict[EngineSpec, float] = {}
        # When each worker's engine was ready: cell timeouts count from then, so a slow
        # engine start is not charged to its first cell.
        self.ready_at: dict[EngineSpec, float] = {}
        self.inflight: dict[object, tuple[EngineSpec, Cell, float]] = {}
        # Per pending cell: the seconds it may take once its engine is ready, and the cells
        # its worker times with it (their time counts).
        self.limits: dict[object, tuple[float, int]] = {}
        # Per pending cell: how many cells its measurement times (itself and its companions;
        # 0 for a cell an earlier cell's rounds timed, handed over at once): the ETA's count.
        self.covers: dict[object, int] = {}
        # Lost attempts and their reasons, per cell key, for the cells not yet reported.
        self.attempts: Counter = Counter()
        self.reasons: dict[str, list[str]] = defaultdict(list)
        # Results ready to hand on: a worker's next cell is submitted before its last result
        # is recorded (_hand_on), so the driver's recording and the worker's measuring overlap.
        self.outbox: deque[CellResult] = deque()
        self.done = 0
        self.stopped: Optional[str] = None  # why the sweep stopped early, if it did
        # Seconds the finished cells took once their engine was ready (for the ETA, which
        # leaves engine starts out) and the cells that time measured: their sum and count,
        # not a list, for huge sweeps. A group timed together in rounds counts as its cells,
        # not as one cell that took the whole group's time (an ETA of hours after its first).
        self.measured_s, self.measured_n = 0.0, 0
        # Workers the sweep started while it still planned (worker, when it was started).
        for spec, (worker, started_at) in (prestarted or {}).items():
            self.workers[spec], self.started_at[spec] = worker, started_at

    def _report(self, result: CellResult, lost_last: bool = False) -> None:
        """Hand a cell's final result on, with its attempts: the lost ones, plus the one that
        produced this result unless it was lost too (retries exhausted). With replicates, a
        measured cell's result waits for its other engine starts and is merged with them."""
        self.done += 1
        key = result.key
        if self.replicates > 1 and result.status == "FINISHED":
            self.held[key].append(result)
            if len(self.held[key]) < self.replicates:
                return
            result = merge_starts(self.held.pop(key), stability_rules_of(self.options), self.options.split.host_bound_threshold)
        elif self.replicates > 1:  # failed in this start: reported failed, measured no more
            self.done += self.replicates - 1 - len(self.held.pop(key, []))
        # A reported cell is done with: nothing of it stays here (10,000-cell sweeps).
        attempt = self.attempts.pop(key, 0) + (0 if lost_last else 1)
        self.outbox.append(replace(result, attempt=attempt, retry_reasons=tuple(self.reasons.pop(key, ()))))

    def _hand_on(self) -> None:
        """Record the results reported so far; each leaves the outbox before it is handed on,
        so one that cannot be recorded is not handed on twice."""
        while self.outbox:
            with signals.deferred():  # a stop waits until the result is journaled, tabled and queued
                self.on_result(self.outbox.popleft())

    def _log_file(self, spec: EngineSpec) -> Optional[Path]:
        return worker_log_path(self.log_dir, spec.label) if self.log_dir is not None else None

    def _failed(self, cell: Cell, reason: str) -> CellResult:
        return failed_result(cell, reason, self._log_file(self.worker_spec.get(cell.engine, cell.engine)))

    def _start_cause(self, spec: EngineSpec, reason: str) -> str:
        """Why an engine did not start: the first error its worker's log shows since that
        worker began (vLLM's processes print the root cause there before the worker's own
        exception, which Ray reports, says 'initialization failed'), else Ray's reason."""
        return first_exception(last_start(self._log_file(spec))) or reason

    def _next_start(self, spec: EngineSpec) -> None:
        """Queue the spec's cells for their next engine start (measure.replicates), those
        that still await one; their current worker is retired and a new one started."""
        if self.start_number[spec] >= self.replicates:
            return
        self.start_number[spec] += 1
        again = [cell for cell in self.spec_cells[spec] if cell.key in self.held]
        if again:
            log.info("%s: engine start %d of %d for %d cell(s)", spec.label, self.start_number[spec],
                     self.replicates, len(again))
            self.queues[spec].extend(again)

    def _turns(self, spec: EngineSpec) -> Optional[deque[EngineSpec]]:
        """The turns of a paired spec's pair (None when unpaired)."""
        if spec not in self.partner:
            return None
        return self.turns[spec if spec.side == "a" else self.partner[spec]]

    def _my_turn(self, spec: EngineSpec) -> bool:
        turns = self._turns(spec)
        return turns is None or (bool(turns) and turns[0] == spec)

    def _pass_turn(self, spec: EngineSpec) -> None:
        """A paired spec's engine start is over: its partner (or, ABBA, itself) starts next."""
        turns = self._turns(spec)
        if turns and turns[0] == spec:
            turns.popleft()
            if turns:
                self._submit_next(turns[0])

    def _submit_next(self, spec: EngineSpec) -> None:
        if not self._my_turn(spec):
            return  # its partner's engine start is on; the turn comes back through _pass_turn
        if not self.queues[spec] and not self.stopped:
            self._hand_on()  # nothing to overlap: recorded before a close can keep it waiting
            ended = not any(s == spec for s, _, _ in self.inflight.values())
            if ended:
                self._next_start(spec)
            self._retire(spec)
            if ended and spec in self.partner:
                self._pass_turn(spec)
                return
        if not self.queues[spec] or self.stopped:
            return
        if spec not in self.workers:
            partner = self.rounds_partner.get(spec)
            self.workers[spec] = self.backend.start(spec, partner, self.partner_first and partner is not None)
            self.started_at[spec] = self.backend.now()
            self.ready_at.pop(spec, None)
            self.given[spec].clear()  # a new worker keeps nothing
            self.unsure.discard(spec)
        cell = self.queues[spec].popleft()
        held = self._timed_already(spec, cell)
        companions = self._companions(spec, cell)
        pending = self.backend.submit(self.workers[spec], cell, self.options, companions)
        self.inflight[pending] = (spec, cell, self.backend.now())
        self.limits[pending] = (self.policy.timeout_for(cell, self.options, companions), 1 + len(companions))
        self.covers[pending] = 0 if held else 1 + len(companions)

    def _companions(self, spec: EngineSpec, cell: Cell) -> tuple[Cell, ...]:
        """The cells this spec's worker will be asked for next, which it times together with
        `cell` (measure.interleave); none when `cell` was itself a companion of an earlier
        cell, whose rounds timed it (the worker uses them, whatever companions came)."""
        m = self.options.measure
        if not m.interleave:
            return ()
        given = self.given[spec]
        if self._timed_already(spec, cell):
            given.discard(cell.key)
            return ()
        companions = tuple(islice(self.queues[spec], m.interleave_max_cells - 1))
        given.clear()
        given.update(c.key for c in companions)
        return companions

    def _timed_already(self, spec: EngineSpec, cell: Cell) -> bool:
        """Whether `cell` was given to its worker as a companion of an earlier cell, whose
        rounds timed it (the worker hands it over at once), and that worker is to be trusted."""
        return self.options.measure.interleave and cell.key in self.given[spec] and spec not in self.unsure

    def _retire(self, spec: EngineSpec) -> None:
        """Close the engine of a spec with no cells left, so its resources go to the next
        spec's worker (a CPU worker holds a whole node: two specs there run in turn). The
        sweep's last close is left to finish while the sweep records (finish_closing)."""
        if spec in self.workers and not any(s == spec for s, _, _ in self.inflight.values()):
            self.backend.close([self.workers.pop(spec)])
            self.ready_at.pop(spec, None)
            if self.inflight or any(self.queues.values()):
                self.backend.finish_closing()

    def _replace_worker(self, spec: EngineSpec) -> None:
        worker = self.workers.pop(spec, None)
        self.ready_at.pop(spec, None)
        if worker is not None:
            self.backend.release(worker)

    def _retry_or_fail(self, spec: EngineSpec, cell: Cell, reason: str) -> None:
        self.attempts[cell.key] += 1
        self.reasons[cell.key].append(reason)
        tries = self.attempts[cell.key]
        if tries <= self.policy.max_retries:
            log.warning("%s: %s; retrying on a new worker (retry %d of %d)", cell.key, reason, tries,
                        self.policy.max_retries)
            self.queues[spec].appendleft(cell)
        else:
            self._report(self._failed(cell, f"{reason} (attempt {tries} of {self.policy.max_retries + 1}, "
                                            "faults.max_retries exhausted)"), lost_last=True)

    def _fail_spec(self, spec: EngineSpec, cell: Cell, reason: str) -> None:
        """The engine cannot start: retrying repeats it, so every cell of the spec fails."""
        for doomed in [cell, *self.queues[spec]]:
            self._report(self._failed(doomed, reason))
        self.queues[spec].clear()

    def _lose(self, pending: object, reason: str) -> None:
        """The worker measuring `pending` is lost (or gave up): replace it, retry the cell."""
        spec, cell, _ = self.inflight.pop(pending)
        self.limits.pop(pending, None)
        self.covers.pop(pending, None)
        self._replace_worker(spec)
        self._retry_or_fail(spec, cell, reason)
        self._submit_next(spec)

    def _collect(self, pending: object) -> None:
        spec, cell, _ = self.inflight[pending]
        outcome = self.backend.outcome(pending)
        if isinstance(outcome, WorkerLost) and outcome.at_start:
            del self.inflight[pending]
            self.limits.pop(pending, None)
            self.covers.pop(pending, None)
            self._replace_worker(spec)
            cause = self._start_cause(spec, outcome.reason)
            self._fail_spec(spec, cell, f"worker for {spec.label} failed to start: {cause}")
        elif isinstance(outcome, WorkerLost):
            self._lose(pending, outcome.reason)
            return
        else:
            _, _, submitted = self.inflight.pop(pending)
            self.limits.pop(pending, None)
            self._note_measured(spec, submitted, self.covers.pop(pending, 1))
            if isinstance(outcome, CallFailed):
                self._report(self._failed(cell, outcome.reason))
            else:
                self._report(outcome)
            if isinstance(outcome, CallFailed) or outcome.status != "FINISHED":
                self.unsure.add(spec)  # its rounds may have failed with it
        self._submit_next(spec)

    def _note_measured(self, spec: EngineSpec, submitted: float, cells: int) -> None:
        if spec in self.ready_at:
            self.measured_s += self.backend.now() - max(submitted, self.ready_at[spec])
            self.measured_n += cells

    def _watch(self) -> None:
        """Engine starts, engine deaths and timeouts of the cells in flight."""
        now = self.backend.now()
        for pending, (spec, cell, submitted) in list(self.inflight.items()):
            worker = self.workers[spec]
            if spec not in self.ready_at:
                self._note_placement(spec, worker, now)
                if self.backend.started(worker):
                    self.ready_at[spec] = now
                    queued = self.placed_at[spec] - self.started_at[spec] if spec in self.placed_at else 0.0
                    # the queue is the node's (another worker still holds it), not the engine's start
                    log.info("%s: engine ready %.1f s after its worker was asked for%s", spec.label,
                             now - self.started_at[spec],
                             f" ({queued:.1f} s of it waiting for Ray to place the worker)"
                             if queued >= QUEUE_WORTH_SAYING_S else "")
                elif now - self.started_at[spec] > self.policy.engine_start_timeout_s:
                    del self.inflight[pending]
                    self.limits.pop(pending, None)
                    self.covers.pop(pending, None)
                    self._replace_worker(spec)
                    self._fail_spec(spec, cell, f"worker for {spec.label} failed to start: engine not ready after "
                                                f"{self.policy.engine_start_timeout_s:.0f} s (faults.engine_start_timeout_s)")
                continue
            fault = self.backend.engine_fault(worker)
            limit, timed_together = self.limits[pending]
            if fault is not None:
                self._lose(pending, f"engine died: {fault}")
            elif now - max(submitted, self.ready_at[spec]) > limit:
                together = f" for {timed_together} cells timed together" if timed_together > 1 else ""
                self._lose(pending, f"timed out after {limit:.0f} s{together} (faults.cell_timeout_s)")

    def _current(self) -> dict[str, str]:
        """Per worker: its cell and what it is doing ('b2 ctx512: rep: round 3 of 12, 6 cell(s)')."""
        current = {}
        for spec, cell, _ in self.inflight.values():
            phase = self.backend.phase(self.workers[spec]) if spec in self.ready_at else self._starting(spec)
            current[spec.label] = f"b{cell.batch} ctx{cell.ctx}" + (f": {phase}" if phase else "")
        return current

    def _note_placement(self, spec: EngineSpec, worker: object, now: float) -> None:
        """Asked on every poll until the worker is seen on its node: the ready line counts the
        wait for Ray apart from the engine's start, whether or not progress is shown."""
        if spec not in self.placed_at:
            self.placement[spec] = self.backend.placed(worker)
            if self.placement[spec]:
                self.placed_at[spec] = now

    def _starting(self, spec: EngineSpec) -> str:
        """A not yet ready worker's phase: waiting for Ray to place it (queued while another
        worker holds its node, or its process being launched) or starting its engine; both
        where the backend cannot tell."""
        self._note_placement(spec, self.workers[spec], self.backend.now())
        if spec in self.placed_at:
            return "starting engine"
        return WAITING if self.placement.get(spec) is False else f"starting engine (or {WAITING})"

    def _update_progress(self) -> None:
        """The progress line: the ETA extrapolates the time cells took once their engine
        was ready, spread over the workers measuring now; engine starts are counted apart."""
        if self.progress is None:
            return
        measuring = {spec for spec, _, _ in self.inflight.values() if spec in self.ready_at}
        starts = sum(1 for spec, queue in self.queues.items() if queue and spec not in self.workers)
        starts += sum(1 for spec in {s for s, _, _ in self.inflight.values()} if spec not in self.ready_at)
        per_cell = self.measured_s / self.measured_n if self.measured_n else None
        self.progress.update(self.done, self._current(), per_cell, max(1, len(measuring)), starts)

    def _stop(self, reason: str) -> None:
        self.stopped = reason
        log.error("stopping the sweep: %s; %d cell(s) in flight abandoned", reason, len(self.inflight))
        self.inflight.clear()
        self.limits.clear()
        self.covers.clear()
        for spec in list(self.workers):
            self._replace_worker(spec)

    def run(self) -> None:
        try:
            for spec in self.queues:
                self._submit_next(spec)
            while self.inflight:
                self._update_progress()
                reason = self.should_stop()
                if reason:
                    self._stop(reason)
                    break
                for pending in self.backend.wait(list(self.inflight), self.policy.poll_s):
                    if pending in self.inflight:
                        self._collect(pending)
                        self._hand_on()
                self._watch()
                self._hand_on()
            if self.progress:
                self.progress.update(self.done, {})
        except BaseException:  # interrupted: kill the engines now rather than wait for their cells
            for spec in list(self.workers):
                self._replace_worker(spec)
            raise
        finally:
            try:
                self._hand_on()  # what was measured is recorded, whatever ended the loop
            finally:
                if self.progress:
                    self.progress.close()
                self.backend.close(list(self.workers.values()))
                self.workers.clear()
