"""The worker: owns one started engine and measures every cell of its engine spec.

A plain class, so it runs in-process in tests; actors.py wraps it as a Ray actor whose
watch thread answers engine_health, phase and abort while a cell runs. A cell whose engine
died raises EngineDied (the driver retries it elsewhere) instead of coming back FAILED.
Given a log file, the worker sends its output, and its engine's, there (run/worklog.py).
Its profiling half (the split's pairs in the rounds, the split, linearity) is
run/profiling.py.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from hostsweep.engines.base import Engine, start_engine
from hostsweep.config.grid import Cell, EngineSpec
from hostsweep.config.machine import hostname
from hostsweep.measure.protocol import (
    RepTiming, Rounds, ci_target_rule, interleaved_rounds, own_text_seeds, prompt_digest, prompt_seed,
    random_prompts, side_a_first, time_pair,
)
from hostsweep.measure.detectable import stop_target
from hostsweep.measure.group import GroupMeasurement, TimedCell
from hostsweep.measure.results import CellResult, MeasureOptions
from hostsweep.measure.warmup import warmed_up
from hostsweep.run.canary import Canary
from hostsweep.run.contention import ContentionProbe, sweep_root_pid
from hostsweep.run.rounds import RoundJournal, round_journal
from hostsweep.run.sides import WorkerSide, needs_own_worker, partner_log, start_partner, worker_side
from hostsweep.run.faults import EngineDied
from hostsweep.run.hygiene import (
    descendant_pids, engine_temp_folder, freeze_long_lived, new_scratch_folder, release_ray_thread_limits,
    release_shared_memory, remove_engine_temp_folder, remove_stale_scratch, restore_affinity, restore_priority,
    restore_scheduler,
)
from hostsweep.run.liveness import EngineWatch, engine_processes
from hostsweep.run.placement import hand_gpus_to_ranks, ray_placement
from hostsweep.run.profiling import SplitProfiling
from hostsweep.run.pyspy import record_thread_states
from hostsweep.run.worklog import log_tail, redirect_output

log = logging.getLogger(__name__)

# How long an engine's processes may take to be gone before they are killed, after close
# (vLLM's shutdown SIGKILLs them: engines/vllm_engine.py) and after abort's own SIGKILL
# (with the tracker's stop, within the driver's wait for abort: actors.ABORT_TIMEOUT_S).
ENGINE_EXIT_WAIT_S, KILLED_EXIT_WAIT_S = 10.0, 2.0
WARMUP_CANARIES = 3  # canary timings a warm-up round (their median): ~5 ms, one pair's noise halved


@dataclasses.dataclass
class _SideRounds:
    """A side's cells in the paired rounds under way: prepared, and their pairs so far."""

    group: GroupMeasurement
    cells: dict[str, tuple[Cell, Callable[[int], float]]]  # by key: the cell and its timed generate
    canary: bool
    timings: dict[str, list[RepTiming]] = dataclasses.field(default_factory=dict)


class SweepWorker(SplitProfiling):
    def __init__(self, spec: EngineSpec, workdir: Optional[str] = None, log_file: Optional[str] = None,
                 own_process: bool = False, partner: Optional[EngineSpec] = None, partner_first: bool = False
                 ) -> None:
        """`partner`: side b of paired rounds, its engine started in this worker beside side a's
        (partner_first: before it), or, where it needs another Python or TP degree
        (sides.needs_own_worker), in a partner worker on this node that this worker starts,
        owns and times in the same rounds (run/sides.py)."""
        # First, so the engine's processes inherit the redirected fds.
        self.log_path = redirect_output(Path(log_file), f"worker for {spec.label}") if log_file else None
        self._phase = "starting engine"
        dropped = release_ray_thread_limits(os.environ)  # type: ignore[arg-type]
        niceness = restore_priority()
        scheduler = restore_scheduler()
        restore_affinity()
        self.spec = spec
        # A local temp dir, removed when this worker ends (or by the next worker, if this
        # one is killed): vLLM's IPC sockets and rendezvous files, and on a remote node,
        # where the driver's folders do not exist, the engine's working folder.
        remove_stale_scratch()
        self.scratch = new_scratch_folder()
        folder = Path(workdir) if workdir else self.scratch
        tp_gpus = None
        if spec.accelerator_type is not None and spec.tp > 1:
            tp_gpus = hand_gpus_to_ranks(spec.tp_executor, os.environ)
        before = descendant_pids(os.getpid())
        self.partner = partner
        apart = partner is not None and needs_own_worker(spec, partner)
        self.partner_worker: Optional[object] = None  # the partner worker, where side b has one
        self._partner_side: Optional[WorkerSide] = None
        self.engines: dict[EngineSpec, Engine] = {}
        start_s: dict[EngineSpec, float] = {}
        try:
            with engine_temp_folder(self.scratch):
                # paired rounds: side b's engine beside side a's, in a folder of its own; started
                # first with partner_first (pair.start_first=b), so repeated A/As can alternate
                # which instance meets a fresh machine
                order = ((spec, folder), (partner, folder / "side-b"))
                for which, where in (order[::-1] if partner_first else order):
                    if which is None:
                        continue
                    self._phase = f"starting the engine for {which.label}"
                    where.mkdir(parents=True, exist_ok=True)
                    started = time.perf_counter()
                    if which is partner and apart:
                        self.partner_worker, self._partner_side = start_partner(
                            partner, str(where), partner_log(log_file), as_actor=own_process)
                    else:
                        self.engines[which] = start_engine(which, where)
                    start_s[which] = time.perf_counter() - started
        except BaseException:
            log.exception("the engine for %s did not start", self._phase[len("starting the engine for "):])
            for engine in self.engines.values():  # side a's, when side b's did not start
                engine.close()
            self._end_partner()
            self._remove_scratch()
            raise
        self.engine: Engine = self.engines[spec]
        own = worker_side(self)
        self.sides: dict[EngineSpec, WorkerSide] = {which: own for which in self.engines}
        if partner is not None and self._partner_side is not None:
            self.sides[partner] = self._partner_side
        self._sides_in_rounds: dict[EngineSpec, _SideRounds] = {}
        engine_start_s = start_s[spec]
        self.watch = EngineWatch(engine_processes(os.getpid(), before) if self.engine.starts_processes else [])
        self._profile_count = 0
        # Cells measured in a group's rounds that the dispatcher has not asked for yet.
        self._timed_cells: dict[str, TimedCell] = {}
        self.probe = ContentionProbe(os.getpid(), sweep_root_pid())
        self.canary = Canary()
        # the speed canary of the round in progress (_timed_pair): (host ms, GPU ms), None until timed
        self._round_canary: Optional[tuple[float, Optional[float]]] = None
        log.info("contention: the engine is the tree of pid %d, the sweep that of pid %d; others are foreign",
                 self.probe.engine_root, self.probe.sweep_root)
        self.host = {
            "hostname": hostname(),
            **self.engine.describe(),
            "cpu_affinity": str(len(os.sched_getaffinity(0))),
            "dropped_env": ",".join(f"{k}={v}" for k, v in dropped.items()) or "none",
            "niceness": niceness,
            "sched_policy": scheduler,
            **ray_placement(tp_gpus),
            "engine_start_s": f"{engine_start_s:.1f}",
            "canary": self.canary.parts,
        }
        if self.log_path is not None:
            self.host["worker_log"] = str(self.log_path)
        # Each side's provenance is its own engine's; the machine's is the worker's.
        self.hosts = {spec: self.host}
        if partner is not None and self._partner_side is not None:
            self.hosts[partner] = self._partner_side.host()  # its own Python, engine and start
        elif partner is not None:
            self.hosts[partner] = {**self.host, **self.engines[partner].describe(),
                                   "engine_start_s": f"{start_s[partner]:.1f}"}
        if own_process:  # a Ray actor: what the engine's start made lives as long as this worker
            freeze_long_lived()
        self._phase = "ready"

    def host_info(self) -> dict[str, str]:
        return dict(self.host)

    def phase(self) -> str:
        """What the worker is doing: 'rep: round 3 of 12, 6 cell(s)', 'profiling 1 of 3'... (read by the
        driver's progress line from the watch thread)."""
        return self._phase

    def engine_health(self) -> Optional[str]:
        """Why the engine is dead (which process, exit code or signal), or None; a partner
        worker's engine counts as this worker's (its cells are measured here)."""
        fault = self.watch.fault()
        if fault is None and self._partner_side is not None:
            fault = self._partner_side.health()
        return fault

    def _end_partner(self, abort: bool = False) -> None:
        if self._partner_side is not None:
            self._partner_side.end(abort)
            self._partner_side = None

    def abort(self) -> None:
        """Kill the engine's processes, unlink their shared memory and drop the scratch
        folder: the driver is about to kill this worker, which would leave all three behind."""
        self.watch.kill()
        try:
            self._end_partner(abort=True)
            self._engine_gone(KILLED_EXIT_WAIT_S)
        finally:
            self._remove_scratch()

    def _engine_gone(self, wait_s: float) -> None:
        """Return once the engine's processes are gone (killed after wait_s), and have the
        resource tracker unlink the shared memory they left (hygiene.release_shared_memory)."""
        left = self.watch.wait_gone(wait_s)
        if left:
            log.warning("engine processes still there %.0f s after they were stopped, killed: %s",
                        wait_s, ", ".join(left))
        if self.watch.processes:
            # the tracker's "There appear to be N leaked shared_memory objects" that follows in
            # this log is this release: vLLM's message queues, unlinked here, not left behind
            log.info("the closed engine's shared memory (vLLM's message queues) goes back through the resource "
                     "tracker, which calls it leaked as it unlinks it")
        if self.watch.processes and not release_shared_memory():
            log.warning("the engine's shared memory may be left in /dev/shm (the resource tracker did not stop)")

    def _remove_scratch(self) -> None:
        remove_engine_temp_folder(self.scratch)

    def _timed_generate(self, prompts: list[list[int]], spec_log: Optional[list[list[dict]]] = None,
                        engine: Optional[Engine] = None):
        """A generate of the prompts timed in seconds (on `engine`, else the worker's); with
        speculation, the per-request counts of each T-token generate go to spec_log."""
        engine = engine if engine is not None else self.engine

        def timed(tokens: int) -> float:
            start = time.perf_counter()
            lengths = engine.generate(prompts, tokens)
            elapsed = time.perf_counter() - start
            # A request that stopped early would shrink wall_T and corrupt the step time.
            if any(n != tokens for n in lengths):
                raise RuntimeError(f"asked for {tokens} tokens per request, engine produced {lengths}")
            stats = engine.spec_stats() if tokens > 1 and spec_log is not None else None
            if stats is not None:
                spec_log.append(stats)
            return elapsed

        return timed

    def engine_of(self, cell: Cell) -> Engine:
        """The engine that serves the cell: the worker's, or in paired rounds its side's."""
        return self.engines.get(cell.engine, self.engine)

    def prompts(self, cell: Cell) -> list[list[int]]:
        """The cell's prompts: random token ids, or (workload=repeat) the model's own greedy
        text grown from a few random tokens to ctx, which it then continues as it did."""
        engine = self.engine_of(cell)
        prompts = random_prompts(cell.batch, cell.ctx, engine.vocab_size(), prompt_seed(cell))
        if cell.workload != "repeat":
            return prompts
        self._phase = "writing prompts"
        seeds = own_text_seeds(prompts)
        engine.generate(seeds, cell.ctx - len(seeds[0]))
        return [seed + text for seed, text in zip(seeds, engine.last_tokens())]

    def _timed_pair(self, generate: Callable[[int], float], T: int, k: int, t1_first: bool,
                    canary: bool) -> RepTiming:
        """One timed pair with its contention record and, when asked, the speed canary of its
        round: timed right after the round's first pair (outside the record: the canary's CPU
        is not the pair's) and carried by every pair of the round. Once a round, not once a
        pair: a round of a few cells lasts seconds, the machine's speed moves over tens, and
        a 64-cell group of instant cells spent most of its time in canaries."""
        mark = self.probe.mark()
        timing = time_pair(generate, T, k, t1_first)
        contention = self.probe.since(mark)
        if canary and self._round_canary is None:
            self._round_canary = (self.canary.time_ms(), self.canary.time_gpu_ms())
        canary_ms, gpu_canary_ms = self._round_canary if canary else (None, None)
        return dataclasses.replace(timing, contention=contention, canary_ms=canary_ms, gpu_canary_ms=gpu_canary_ms)

    def _rounds(self, cells: Sequence[Cell], generates: list, options: MeasureOptions, what: str,
                journal: Optional[RoundJournal] = None,
                after_pair: Optional[Callable[[int, RepTiming], None]] = None) -> Rounds:
        """Timed pairs of the cells in interleaved rounds, each pair with its contention record
        and the speed canary timed after it; with a journal, continued from the pairs a killed
        run left and each new pair saved. `after_pair(i, pair)` runs between pairs (the
        split's profiled pairs: measure/periods.profiled_rounds), outside any pair's record."""
        m = options.measure
        stops = [ci_target_rule(stop_target(c, m.ci_level), c.min_reps, c.reps, m.ci_level) if c.adaptive else None
                 for c in cells]
        done = [journal.resume(c.key) if journal else () for c in cells]
        for cell, pairs in zip(cells, done):
            if journal:
                journal.start(cell.key, pairs)
            if pairs:  # worth a warning: the cell's pairs then come from two engine starts
                log.warning("%s: continuing from %d timed pair(s) a killed run left", cell.key, len(pairs))

        def pair(i: int, k: int, t1_first: bool) -> RepTiming:
            return self._timed_pair(generates[i], cells[i].T, k, t1_first, m.canary)

        def on_round(r: int, active: int) -> None:
            self._phase = f"{what}: round {r} of {max(c.reps for c in cells)}, {active} cell(s)"
            self._round_canary = None
            self.probe.refresh()

        def on_pair(i: int, timing: RepTiming) -> None:
            if journal:
                journal.append(cells[i].key, timing)
            if after_pair is not None:
                after_pair(i, timing)

        return interleaved_rounds([c.reps for c in cells], pair, cells[0].seed, stops, on_round, done, on_pair)

    def _warm_up(self, cells: Sequence[Cell], generates: list, options: MeasureOptions) -> int:
        """The group's untimed warm-up rounds before any timed pair: every cell's pair in each
        round, then (measure.canary) the canary three times, at least measure.warmups rounds,
        then more while the engine still got faster from round to round or the canary had
        not come down to the machine's speed (measure/warmup.py); the rounds taken."""
        m, steps, canaries = options.measure, [], []
        minimum = max((c.warmups for c in cells), default=0)
        while not warmed_up(steps, minimum, m.warmup_settle_pct, max(m.warmup_max_rounds, minimum), canaries):
            self._phase = f"warm-up round {len(steps) + 1} (at least {minimum}, at most {m.warmup_max_rounds})"
            steps.append([time_pair(timed, cell.T, len(steps), True).step_s for cell, timed in zip(cells, generates)])
            if m.canary:
                canaries.append(float(np.median([self.canary.time_ms() for _ in range(WARMUP_CANARIES)])))
        return len(steps)

    def _measure_group(self, cells: Sequence[Cell], options: MeasureOptions) -> dict[str, TimedCell]:
        """Warm-ups, then the group's timed pairs in interleaved rounds (period 0); with
        measure.replicate_first, the first cell timed again at the end (a check of the host);
        while a cell is unstable for what a new period can cure (GroupMeasurement.
        needs_another_period), the whole group timed again in a new period, up to
        measure.remeasure_unstable times (measure/group.py pools the periods)."""
        group = GroupMeasurement(cells, [self.prompts(cell) for cell in cells], options)
        group.generates = [self._timed_generate(p, log) for p, log in zip(group.prompts, group.spec_logs)]
        group.warmup_rounds = self._warm_up(cells, group.generates, options)
        group.mark_attempt(range(len(cells)))  # the warm-ups' speculation counts are not reported
        journal = round_journal(options.rounds_dir, self.host)
        profile = self._profiling_in_rounds(group, options)
        group.take_period(self._rounds(cells, group.generates, options, "rep", journal, profile).timings)
        if profile is not None:
            self._profile_the_rest(group, options)
        if len(cells) > 1 and options.measure.replicate_first:  # its speculation counts are not the cell's
            again = self._rounds(cells[:1], [self._timed_generate(group.prompts[0])], options, "replicate")
            group.replicate(again.timings[0])
        for period in range(1, 1 + options.measure.remeasure_unstable):
            if not group.needs_another_period():
                break
            why = group.note_remeasure()
            log.warning("re-measuring the group's %d cell(s) together (period %d) for %s: %s", len(cells),
                        period + 1, why, group.remeasure_detail())
            group.take_period(self._rounds(cells, group.generates, options, f"period {period + 1}").timings)
        if too_wide := group.too_wide_to_cure():
            named = ", ".join(f"b{c.batch} ctx{c.ctx} ±{h:.1f} %, about {n} pairs a period would"
                              for c, h, n in too_wide[:4])
            why = ("the periods measure.remeasure_unstable allows would not bring their CI"
                   if options.measure.remeasure_ci_width else
                   "no period is taken for a CI (measure.remeasure_ci_width=false): their CI is not")
            log.warning("left flagged ci_width: %s within measure.max_ci_pct=%g (%s%s)", why,
                        options.measure.max_ci_pct, named, ", …" if len(too_wide) > 4 else "")
        if profile is not None:
            self._reprofile_together(group, options)
        if journal:
            for cell in cells:
                journal.close(cell.key)
        return group.timed_cells()

    def _measure_paired_group(self, cells: Sequence[Cell], options: MeasureOptions) -> dict[str, TimedCell]:
        """Paired rounds (pair.design=rounds): each cell of side a and its partner of side b
        (same batch, ctx, workload) are one slot of the group's rounds, their two pairs timed
        back to back in it, side a first in two rounds of every four, counterbalanced with the
        T order (protocol.side_a_first: each side first as often, and after the other engine
        in its T=1 and its T generate alike), each pair with its contention record and canary. Both pairs of a
        slot's round carry its id (RepTiming.pair_round), which the paired diff matches them
        by: drift slower than a round's two pairs lands on both sides alike. A cell whose
        partner is not in the group (its partner reported earlier, a retry) is timed in the
        rounds alone and carries no partner's round. Each side is a WorkerSide: its engine in
        this worker, or in a partner worker on the same node (run/sides.py), which prepares and
        times its own pairs in its own process. The rounds are not journaled: a killed paired
        sweep measures the group again."""
        slots: list[list[Cell]] = []
        partners = {(c.batch, c.ctx, c.workload): c for c in cells if c.engine != self.spec}
        for cell in cells:
            if cell.engine == self.spec:
                slots.append([cell, *([p] if (p := partners.pop((cell.batch, cell.ctx, cell.workload), None)) else [])])
        slots += [[alone] for alone in partners.values()]
        sides = {spec: [c for slot in slots for c in slot if c.engine == spec] for spec in self.sides}
        active = {spec: self.sides[spec] for spec, side_cells in sides.items() if side_cells}
        for spec, side in active.items():
            side.prepare(spec, sides[spec], options)
        where = {"round": 0}
        rounds_id = f"{os.getpid()}-{time.time_ns() % 10**12}"  # unique per group: a retry's rounds never match

        def pair(i: int, k: int, t1_first: bool) -> RepTiming:
            slot, r = slots[i], where["round"]
            order = slot if side_a_first(k, i) else slot[::-1]  # counterbalanced with the T order
            timed = {cell.key: self.sides[cell.engine].time(cell.engine, cell.key, k, t1_first, f"{rounds_id}:{r}", r)
                     for cell in order}
            return timed[slot[0].key]

        def on_round(r: int, active_slots: int) -> None:
            where["round"] = r - 1
            for side in {id(side): side for side in active.values()}.values():  # once a worker
                side.new_round()
            self._phase = f"paired rounds: round {r} of {max(c.reps for c in cells)}, {active_slots} slot(s)"

        interleaved_rounds([slot[0].reps for slot in slots], pair, cells[0].seed, None, on_round)
        return {key: timed_cell for spec, side in active.items() for key, timed_cell in side.finish(spec).items()}

    # The side of paired rounds this worker's own engines are (run/sides.py's worker_side calls
    # these; a partner worker answers them as actor methods for the coordinating worker).

    def side_prepare(self, spec: EngineSpec, cells: Sequence[Cell], options: MeasureOptions) -> None:
        """The side's cells ready to time: prompts, timed generates on its engine, warm-up rounds."""
        self._engine_alive()
        engine = self.engines[spec]
        group = GroupMeasurement(cells, [self.prompts(c) for c in cells], options)
        group.generates = [self._timed_generate(p, log, engine) for p, log in zip(group.prompts, group.spec_logs)]
        group.warmup_rounds = self._warm_up(group.cells, group.generates, options)
        group.mark_attempt(range(len(group.cells)))
        self._sides_in_rounds[spec] = _SideRounds(group, {c.key: (c, g) for c, g in zip(cells, group.generates)},
                                                  options.measure.canary)

    def side_new_round(self) -> None:
        """A new round begins: the speed canary is timed again, the foreign processes looked up again."""
        self._round_canary = None
        self.probe.refresh()

    def side_time(self, spec: EngineSpec, key: str, k: int, t1_first: bool, round_id: str, r: int) -> RepTiming:
        """One timed pair of the side's cell in round r, kept with the side and returned."""
        side = self._sides_in_rounds[spec]
        cell, generate = side.cells[key]
        self._engine_alive()
        try:
            timing = self._timed_pair(generate, cell.T, k, t1_first, side.canary)
        except Exception:
            self._engine_alive()  # a generate that failed because the engine died: EngineDied
            raise
        timing = dataclasses.replace(timing, pair_round=round_id, rep=k, round=r)
        side.timings.setdefault(key, []).append(timing)
        return timing

    def _engine_alive(self) -> None:
        dead = self.watch.fault()
        if dead is not None:
            raise EngineDied(dead)

    def side_finish(self, spec: EngineSpec) -> dict[str, TimedCell]:
        """The side's cells measured: their pairs of the rounds as one period."""
        side = self._sides_in_rounds.pop(spec)
        side.group.take_period([side.timings.get(c.key, []) for c in side.group.cells])
        return side.group.timed_cells()

    def _timed_cell(self, cell: Cell, options: MeasureOptions, companions: Sequence[Cell]) -> TimedCell:
        """The cell's timed measurement: kept from its group's rounds, or measured now with the
        companions the dispatcher will ask for next (measure.interleave), which are kept."""
        kept = self._timed_cells.pop(cell.key, None)
        if kept is not None:
            return kept
        group = [cell]
        if options.measure.interleave or self.partner is not None:  # paired rounds time partners together
            group += [c for c in companions if c.key not in self._timed_cells and c.key != cell.key]
        measured = self._measure_paired_group(group, options) if self.partner is not None \
            else self._measure_group(group, options)
        kept = measured.pop(cell.key)
        self._timed_cells.update(measured)
        return kept

    def measure(self, cell: Cell, options: MeasureOptions, companions: Sequence[Cell] = ()) -> CellResult:
        """Run the differencing protocol on one cell; failures become FAILED results.
        `companions`: the cells the dispatcher will ask this worker for next, measured with
        this one in interleaved rounds when measure.interleave is on."""
        try:
            return self._measure(cell, options, companions)
        finally:
            self._phase = "idle"

    def _measure(self, cell: Cell, options: MeasureOptions, companions: Sequence[Cell]) -> CellResult:
        start, started_at = time.perf_counter(), time.time()
        keep: Optional[dict[str, bytes]] = {} if options.split.keep_traces else None
        dead = self.watch.fault()
        if dead is not None:
            raise EngineDied(dead)
        try:
            timed = self._timed_cell(cell, options, companions)
            keep = None if keep is None else {**(timed.traces or {})}
            started_at = min(started_at, timed.started_at)
            prompts, measurement, stability = timed.prompts, timed.measurement, timed.stability
            split = None
            if options.split.enabled and self.spec.profile:
                split, stability = self._split_checked(cell, timed, options, keep)
            lin = self._linearity(prompts, options, keep) if options.linearity_T else None
            self._phase = "py-spy" if options.pyspy_seconds > 0 else self._phase
            # a partner worker's engine runs in its own process, which py-spy here does not see
            states = record_thread_states(os.getpid(), options.pyspy_seconds,
                                          lambda: self._timed_generate(prompts, engine=self.engine_of(cell))(cell.T)) \
                if options.pyspy_seconds > 0 and cell.engine in self.engines else None
        except EngineDied:  # a partner worker's engine (run/sides.py): the group is retried
            raise
        except Exception as exc:  # the sweep goes on; the reason is recorded with the cell
            dead = self.watch.fault()
            if dead is not None:  # not the cell's fault: a new engine should measure it
                raise EngineDied(dead) from exc
            log.error("cell %s failed: %s", cell.key, exc)
            reason = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=5)}"
            sys.stdout.flush()
            sys.stderr.flush()
            return CellResult(key=cell.key, params=cell.params(), status="FAILED", measurement=None, error=reason,
                              host=dict(self.hosts.get(cell.engine, self.host)), duration_s=time.perf_counter() - start, started_at=started_at,
                              ended_at=time.time(), log_tail=log_tail(self.log_path))
        self._phase = "recording"
        host = {**self.hosts.get(cell.engine, self.host), "prompt_digest": prompt_digest(prompts)}
        journal = round_journal(options.rounds_dir, self.host)
        if journal:  # its pairs travel with the result now; the driver journals it at once
            journal.done(cell.key)
        ended_at = time.time()
        return CellResult(key=cell.key, params=cell.params(), status="FINISHED", measurement=measurement,
                          error=None, host=host, duration_s=ended_at - started_at, split=split, linearity=lin,
                          traces=keep or {}, thread_states=states, spec=timed.spec, started_at=started_at,
                          ended_at=ended_at, stability=stability, earlier_timings=timed.earlier)

    def close(self) -> None:
        """Stop the engine and return once its processes are gone: the next engine on this
        node (and its GPUs) must not start beside a dying one."""
        self.watch.closing = True
        try:
            for engine in self.engines.values():
                engine.close()
            self._end_partner()
            self._engine_gone(ENGINE_EXIT_WAIT_S)
        finally:
            self._remove_scratch()
