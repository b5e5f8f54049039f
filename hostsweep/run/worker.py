"""The worker: owns one started engine and measures every cell of its engine spec.

A plain class, so it runs in-process in tests; actors.py wraps it as a Ray actor whose
watch thread answers engine_health, phase and abort while a cell runs. A cell whose engine
died raises EngineDied (the driver retries it elsewhere) instead of coming back FAILED.
Given a log file, the worker sends its output, and its engine's, there (run/worklog.py).
"""
from __future__ import annotations

import dataclasses
import gzip
import logging
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from hostsweep.engines.base import Engine, start_engine
from hostsweep.config.grid import Cell, EngineSpec
from hostsweep.config.machine import hostname
from hostsweep.measure.protocol import (
    CellMeasurement, RepTiming, Rounds, ci_target_rule, interleaved_rounds, own_text_seeds, prompt_digest,
    random_prompts, time_pair,
)
from hostsweep.measure.group import GroupMeasurement, TimedCell
from hostsweep.measure.results import CellResult, MeasureOptions
from hostsweep.measure.stability import Stability
from hostsweep.run.contention import ContentionProbe, sweep_root_pid
from hostsweep.run.rounds import RoundJournal, round_journal
from hostsweep.run.faults import EngineDied
from hostsweep.run.hygiene import (
    descendant_pids, engine_temp_folder, freeze_long_lived, new_scratch_folder, release_ray_thread_limits,
    release_shared_memory, remove_stale_scratch, restore_affinity, restore_priority, restore_scheduler,
)
from hostsweep.run.liveness import EngineWatch, engine_processes
from hostsweep.run.placement import hand_gpus_to_ranks
from hostsweep.run.pyspy import record_thread_states
from hostsweep.run.worklog import log_tail, redirect_output
from hostsweep.measure.split import LinearityResult, SplitResult, device_split, linearity
from hostsweep.measure.phases import PhaseTotals, cell_phases, over_pairs, phase_totals
from hostsweep.measure.traces import TraceTotals, load_trace, totals

log = logging.getLogger(__name__)

# How long an engine's processes may take to be gone before they are killed, after close
# (vLLM's shutdown SIGKILLs them: engines/vllm_engine.py) and after abort's own SIGKILL
# (with the tracker's stop, within the driver's wait for abort: actors.ABORT_TIMEOUT_S).
ENGINE_EXIT_WAIT_S, KILLED_EXIT_WAIT_S = 10.0, 2.0


def ray_placement(tp_gpus: Optional[list[str]] = None) -> dict[str, str]:
    """The Ray node and the GPU ids the engine was given ('none' outside Ray): the worker's
    own, or for TP-k the GPUs of its placement group's bundles."""
    try:
        import ray
    except ImportError:
        return {"ray_node_id": "none", "ray_gpu_ids": "none"}
    if not ray.is_initialized():
        return {"ray_node_id": "none", "ray_gpu_ids": "none"}
    context = ray.get_runtime_context()
    gpus = tp_gpus if tp_gpus is not None else context.get_accelerator_ids().get("GPU", [])
    return {"ray_node_id": context.get_node_id(), "ray_gpu_ids": ",".join(map(str, gpus)) or "none"}


def prompt_seed(cell: Cell) -> int:
    """Prompts differ across cells but are the same for every rep of one cell."""
    return cell.seed * 1_000_003 + cell.batch * 10_007 + cell.ctx


class SweepWorker:
    def __init__(self, spec: EngineSpec, workdir: Optional[str] = None, log_file: Optional[str] = None,
                 own_process: bool = False) -> None:
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
        started = time.perf_counter()
        try:
            with engine_temp_folder(self.scratch):
                self.engine: Engine = start_engine(spec, folder)
        except BaseException:
            log.exception("the engine for %s did not start", spec.label)  # into the worker's log
            self._remove_scratch()
            raise
        engine_start_s = time.perf_counter() - started
        self.watch = EngineWatch(engine_processes(os.getpid(), before) if self.engine.starts_processes else [])
        self._profile_count = 0
        # Cells measured in a group's rounds that the dispatcher has not asked for yet.
        self._timed_cells: dict[str, TimedCell] = {}
        self.probe = ContentionProbe(os.getpid(), sweep_root_pid())
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
        }
        if self.log_path is not None:
            self.host["worker_log"] = str(self.log_path)
        if own_process:  # a Ray actor: what the engine's start made lives as long as this worker
            freeze_long_lived()
        self._phase = "ready"

    def host_info(self) -> dict[str, str]:
        return dict(self.host)

    def phase(self) -> str:
        """What the worker is doing: 'rep 3 of 12', 'profiling 1 of 1'... (read by the
        driver's progress line from the watch thread)."""
        return self._phase

    def _tell(self, kind: str, k: int, n: int) -> None:
        self._phase = f"{kind} {k} of {n}"

    def engine_health(self) -> Optional[str]:
        """Why the engine is dead (which process, exit code or signal), or None."""
        return self.watch.fault()

    def abort(self) -> None:
        """Kill the engine's processes, unlink their shared memory and drop the scratch
        folder: the driver is about to kill this worker, which would leave all three behind."""
        self.watch.kill()
        try:
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
        if self.watch.processes and not release_shared_memory():
            log.warning("the engine's shared memory may be left in /dev/shm (the resource tracker did not stop)")

    def _remove_scratch(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)

    def _timed_generate(self, prompts: list[list[int]], spec_log: Optional[list[list[dict]]] = None):
        """A generate of the prompts timed in seconds; with speculation, the per-request
        counts of each T-token generate go to spec_log."""
        def timed(tokens: int) -> float:
            start = time.perf_counter()
            lengths = self.engine.generate(prompts, tokens)
            elapsed = time.perf_counter() - start
            # A request that stopped early would shrink wall_T and corrupt the step time.
            if any(n != tokens for n in lengths):
                raise RuntimeError(f"asked for {tokens} tokens per request, engine produced {lengths}")
            stats = self.engine.spec_stats() if tokens > 1 and spec_log is not None else None
            if stats is not None:
                spec_log.append(stats)
            return elapsed

        return timed

    def _profiled(self, prompts: list[list[int]], tokens: int, prefix: str,
                  keep: Optional[dict[str, bytes]],
                  phases: Optional[list[PhaseTotals]] = None) -> tuple[list[TraceTotals], float]:
        """One profiled generate: per-rank kernel totals and its (inflated) wall time; per-rank
        phase totals appended to `phases` when given (the EngineCore's and the front-end's,
        when the engine recorded them, as two more entries). Trace files go into `keep` when given, and are
        deleted either way."""
        self.engine.start_profile(prefix)
        wall = self._timed_generate(prompts)(tokens)
        files = self.engine.stop_profile(prefix)
        # The EngineCore's intervals, then the front-end's, which are read against them
        # (measure/phases.cell_phases).
        core, front = [getattr(self.engine, f"{kind}_trace", lambda _: None)(prefix) if phases is not None else None
                       for kind in ("engine_core", "frontend")]
        processes = [path for path in (core, front if core is not None else None) if path is not None]
        rank_totals = []
        for path in files:
            trace = load_trace(path)
            rank_totals.append(totals(trace))
            if phases is not None:
                phases.append(phase_totals(trace))
        if phases is not None:
            phases.extend(phase_totals(load_trace(path)) for path in processes)
        for path in files + [p for p in (core, front) if p is not None]:  # traces are large: keep only when asked
            if keep is not None:
                data = path.read_bytes()
                gz = path.name.endswith(".gz")
                keep[path.name if gz else path.name + ".gz"] = data if gz else gzip.compress(data, 6)
            path.unlink(missing_ok=True)
        return rank_totals, wall

    def _split(self, cell: Cell, prompts: list[list[int]], measurement: CellMeasurement, opts: MeasureOptions,
               keep: Optional[dict[str, bytes]]) -> SplitResult:
        """Profiled pairs, separate from the timed reps; the median-device pair wins.

        Its cost is logged as split_overhead_s: the wall time of the whole split phase
        (profiler start and stop, the profiled generates, trace export, reading and parsing
        the traces) minus what the same number of unprofiled pairs takes (the timed reps'
        median wall_1 + wall_T per pair), i.e. what profiling adds to the cell."""
        started = time.perf_counter()
        split = self._profiled_pairs(cell, prompts, measurement.step_ms, opts, keep)
        split_s = time.perf_counter() - started
        plain_s = opts.split.reps * (measurement.wall_1_ms + measurement.wall_T_ms) / 1e3
        return dataclasses.replace(split, split_s=split_s, split_overhead_s=split_s - plain_s)

    def _profiled_pairs(self, cell: Cell, prompts: list[list[int]], step_ms: float, opts: MeasureOptions,
                        keep: Optional[dict[str, bytes]]) -> SplitResult:
        splits = []
        for rep in range(opts.split.reps):
            self._tell("profiling", rep + 1, opts.split.reps)
            self._profile_count += 1
            prefix = f"p{self._profile_count}_b{cell.batch}_ctx{cell.ctx}_r{rep}"
            phases_1: Optional[list[PhaseTotals]] = [] if opts.split.phases else None
            phases_T: Optional[list[PhaseTotals]] = [] if opts.split.phases else None
            short, wall_1 = self._profiled(prompts, 1, f"{prefix}_T1", keep, phases_1)
            long, wall_T = self._profiled(prompts, cell.T, f"{prefix}_T{cell.T}", keep, phases_T)
            profiled_step_ms = (wall_T - wall_1) / (cell.T - 1) * 1e3
            split = device_split(short, long, cell.T, step_ms, profiled_step_ms,
                                 opts.split.host_bound_threshold, opts.split.top_ops)
            phases = None if phases_1 is None or phases_T is None else \
                cell_phases(phases_1, phases_T, len(short), split.slowest_rank, cell.T, split.host_ms)
            splits.append(dataclasses.replace(split, phases=phases))
        chosen = sorted(splits, key=lambda s: s.device_ms)[(len(splits) - 1) // 2]
        if len(splits) > 1 and all(s.phases is not None for s in splits):  # medians over the pairs, with CIs
            m = opts.measure
            chosen = dataclasses.replace(chosen, phases=over_pairs([s.phases for s in splits], chosen.host_ms,
                                                                   m.bootstrap_resamples, m.ci_level, cell.seed))
        return chosen

    def _linearity(self, prompts: list[list[int]], opts: MeasureOptions,
                   keep: Optional[dict[str, bytes]]) -> LinearityResult:
        """Median wall (and one profiled kernel total) at each T of a decade-wide sweep."""
        timed = self._timed_generate(prompts)
        tokens, walls, kernels = list(opts.linearity_T), [], []
        for t in tokens:
            self._phase = f"linearity T={t}"
            walls.append(float(np.median([timed(t) for _ in range(opts.linearity.reps)])) * 1e3)
            if self.spec.profile and opts.split.enabled:
                self._profile_count += 1
                rank_totals, _ = self._profiled(prompts, t, f"lin{self._profile_count}_T{t}", keep)
                kernels.append(max(r.kernel_sum_us for r in rank_totals) / 1e3)
        return linearity(tokens, walls, kernels)

    def prompts(self, cell: Cell) -> list[list[int]]:
        """The cell's prompts: random token ids, or (workload=repeat) the model's own greedy
        text grown from a few random tokens to ctx, which it then continues as it did."""
        prompts = random_prompts(cell.batch, cell.ctx, self.engine.vocab_size(), prompt_seed(cell))
        if cell.workload != "repeat":
            return prompts
        self._phase = "writing prompts"
        seeds = own_text_seeds(prompts)
        self.engine.generate(seeds, cell.ctx - len(seeds[0]))
        return [seed + text for seed, text in zip(seeds, self.engine.last_tokens())]

    def _rounds(self, cells: Sequence[Cell], generates: list, options: MeasureOptions, what: str,
                journal: Optional[RoundJournal] = None) -> Rounds:
        """Timed pairs of the cells in interleaved rounds, each pair with its contention record;
        with a journal, continued from the pairs a killed run left and each new pair saved."""
        m = options.measure
        stops = [None if c.target_ci_pct is None else
                 ci_target_rule(c.target_ci_pct, c.min_reps, m.bootstrap_resamples, m.ci_level, c.seed) for c in cells]
        done = [journal.resume(c.key) if journal else () for c in cells]
        for cell, pairs in zip(cells, done):
            if journal:
                journal.start(cell.key, pairs)
            if pairs:  # worth a warning: the cell's pairs then come from two engine starts
                log.warning("%s: continuing from %d timed pair(s) a killed run left", cell.key, len(pairs))

        def pair(i: int, k: int, t1_first: bool) -> RepTiming:
            mark = self.probe.mark()
            timing = time_pair(generates[i], cells[i].T, k, t1_first)
            return dataclasses.replace(timing, contention=self.probe.since(mark))

        def on_round(r: int, active: int) -> None:
            self._phase = f"{what}: round {r} of {max(c.reps for c in cells)}, {active} cell(s)"
            self.probe.refresh()

        save = (lambda i, timing: journal.append(cells[i].key, timing)) if journal else None
        return interleaved_rounds([c.reps for c in cells], pair, cells[0].seed, stops, on_round, done, save)

    def _warm_up(self, cells: Sequence[Cell], generates: list) -> None:
        """Each cell's warm-up pairs, cell by cell and before any timed pair (discarded)."""
        for cell, timed in zip(cells, generates):
            for k in range(cell.warmups):
                self._phase = f"warm-up {k + 1} of {cell.warmups}: b{cell.batch} ctx{cell.ctx}"
                timed(1)
                timed(cell.T)

    def _measure_group(self, cells: Sequence[Cell], options: MeasureOptions) -> dict[str, TimedCell]:
        """Warm-ups, then the group's timed pairs in interleaved rounds; the first cell measured
        again at the end (the replicate); cells judged unstable measured again, up to
        measure.remeasure_unstable times, each attempt kept."""
        group = GroupMeasurement(cells, [self.prompts(cell) for cell in cells], options)
        group.generates = [self._timed_generate(p, log) for p, log in zip(group.prompts, group.spec_logs)]
        self._warm_up(cells, group.generates)
        group.mark_attempt(range(len(cells)))  # the warm-ups' speculation counts are not reported
        journal = round_journal(options.rounds_dir, self.host)
        group.take(range(len(cells)), self._rounds(cells, group.generates, options, "rep", journal).timings)
        if len(cells) > 1 and options.measure.replicate_first:
            group.replicate(self._rounds(cells[:1], group.generates[:1], options, "replicate").timings[0])
        for attempt in range(2, 2 + options.measure.remeasure_unstable):
            redo = group.unstable()
            if not redo:
                break
            log.info("re-measuring %d unstable cell(s) (attempt %d)", len(redo), attempt)
            group.mark_attempt(redo)
            rounds = self._rounds([cells[i] for i in redo], [group.generates[i] for i in redo], options, "re-measure")
            group.take(redo, rounds.timings, attempt)
        if journal:
            for cell in cells:
                journal.close(cell.key)
        return group.timed_cells()

    def _timed_cell(self, cell: Cell, options: MeasureOptions, companions: Sequence[Cell]) -> TimedCell:
        """The cell's timed measurement: kept from its group's rounds, or measured now with the
        companions the dispatcher will ask for next (measure.interleave), which are kept."""
        kept = self._timed_cells.pop(cell.key, None)
        if kept is not None:
            return kept
        group = [cell]
        if options.measure.interleave:
            group += [c for c in companions if c.key not in self._timed_cells and c.key != cell.key]
        measured = self._measure_group(group, options)
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

    def _split_checked(self, cell: Cell, timed: TimedCell, options: MeasureOptions,
                       keep: Optional[dict[str, bytes]]) -> tuple[SplitResult, Stability]:
        """The split, profiled again (up to measure.remeasure_unstable times) while its device
        time is below zero or above the timed step, which no real step can have; still so,
        it is flagged."""
        stability = timed.stability
        for attempt in range(1 + options.measure.remeasure_unstable):
            split = self._split(cell, timed.prompts, timed.measurement, options, keep)
            if split.possible:
                return split, stability
            log.warning("%s: profiled device time %.3f ms is outside the step's 0-%.3f ms (attempt %d)",
                        cell.key, split.device_ms, timed.measurement.step_ms, attempt + 1)
        return split, stability.with_reason("split_impossible")

    def _measure(self, cell: Cell, options: MeasureOptions, companions: Sequence[Cell]) -> CellResult:
        start, started_at = time.perf_counter(), time.time()
        keep: Optional[dict[str, bytes]] = {} if options.split.keep_traces else None
        dead = self.watch.fault()
        if dead is not None:
            raise EngineDied(dead)
        try:
            timed = self._timed_cell(cell, options, companions)
            started_at = min(started_at, timed.started_at)
            prompts, measurement, stability = timed.prompts, timed.measurement, timed.stability
            split = None
            if options.split.enabled and self.spec.profile:
                split, stability = self._split_checked(cell, timed, options, keep)
            lin = self._linearity(prompts, options, keep) if options.linearity_T else None
            self._phase = "py-spy" if options.pyspy_seconds > 0 else self._phase
            states = record_thread_states(os.getpid(), options.pyspy_seconds,
                                          lambda: self._timed_generate(prompts)(cell.T)) \
                if options.pyspy_seconds > 0 else None
        except Exception as exc:  # the sweep goes on; the reason is recorded with the cell
            dead = self.watch.fault()
            if dead is not None:  # not the cell's fault: a new engine should measure it
                raise EngineDied(dead) from exc
            log.error("cell %s failed: %s", cell.key, exc)
            reason = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=5)}"
            sys.stdout.flush()
            sys.stderr.flush()
            return CellResult(key=cell.key, params=cell.params(), status="FAILED", measurement=None, error=reason,
                              host=self.host_info(), duration_s=time.perf_counter() - start, started_at=started_at,
                              ended_at=time.time(), log_tail=log_tail(self.log_path))
        self._phase = "recording"
        host = {**self.host_info(), "prompt_digest": prompt_digest(prompts)}
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
            self.engine.close()
            self._engine_gone(ENGINE_EXIT_WAIT_S)
        finally:
            self._remove_scratch()
