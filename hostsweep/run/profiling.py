"""The worker's device/host split: profiled T=1 / T pairs taken inside a group's timed
rounds, what they say of each cell (device time, host time and its phases, with CIs and the
physical checks), and the linearity sweep. A part of SweepWorker (run/worker.py), apart only
because the worker would be too long to read in one piece: it uses the worker's engine,
its timed generate, its phase line and its profile counter.
"""
from __future__ import annotations

import dataclasses
import gzip
import logging
import time
import traceback
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import numpy as np

from hostsweep.config.grid import Cell
from hostsweep.measure.group import GroupMeasurement, TimedCell
from hostsweep.measure.periods import ProfiledPair, profiled_rounds
from hostsweep.measure.phases import PhaseTotals, cell_phases, over_pairs, phase_totals
from hostsweep.measure.protocol import CellMeasurement, RepTiming, round_order
from hostsweep.measure.results import MeasureOptions
from hostsweep.measure.split import LinearityResult, SplitResult, device_split, linearity, pooled_split
from hostsweep.measure.split_stats import TimedStep
from hostsweep.measure.stability import Stability
from hostsweep.measure.traces import TraceTotals, load_trace, totals

if TYPE_CHECKING:
    from hostsweep.config.grid import EngineSpec
    from hostsweep.engines.base import Engine

log = logging.getLogger(__name__)


class SplitProfiling:
    """SweepWorker's profiling half (a mixin: the worker provides what is declared here, and
    _timed_generate)."""

    engine: "Engine"
    spec: "EngineSpec"
    _phase: str
    _profile_count: int

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

    def _profile_pair(self, cell: Cell, prompts: list[list[int]], opts: MeasureOptions,
                      keep: Optional[dict[str, bytes]], round_index: int = -1) -> ProfiledPair:
        """One profiled T=1 / T pair of the cell (its trace files into `keep` when given)."""
        started = time.perf_counter()
        self._profile_count += 1
        prefix = f"p{self._profile_count}_b{cell.batch}_ctx{cell.ctx}_r{round_index}"
        phases_1: Optional[list[PhaseTotals]] = [] if opts.split.phases else None
        phases_T: Optional[list[PhaseTotals]] = [] if opts.split.phases else None
        short, wall_1 = self._profiled(prompts, 1, f"{prefix}_T1", keep, phases_1)
        long, wall_T = self._profiled(prompts, cell.T, f"{prefix}_T{cell.T}", keep, phases_T)
        return ProfiledPair(tuple(short), tuple(long), wall_1, wall_T,
                            None if phases_1 is None else tuple(phases_1), None if phases_T is None else tuple(phases_T),
                            round_index, time.perf_counter() - started)

    def _split(self, cell: Cell, pairs: Sequence[ProfiledPair], measurement: CellMeasurement,
               opts: MeasureOptions) -> SplitResult:
        """The split from the cell's profiled pairs, with CIs over them (measure/split.pooled_split).

        split_s is what taking the pairs cost (profiler start and stop, the profiled
        generates, trace export, reading and parsing the traces), and split_overhead_s that
        minus what as many unprofiled pairs take (the timed pairs' median wall_1 + wall_T),
        i.e. what profiling adds to the cell."""
        split = self._profiled_pairs(cell, pairs, measurement, opts)
        split_s = sum(p.seconds for p in pairs)
        plain_s = len(pairs) * (measurement.wall_1_ms + measurement.wall_T_ms) / 1e3
        return dataclasses.replace(split, split_s=split_s, split_overhead_s=split_s - plain_s)

    def _profiled_pairs(self, cell: Cell, pairs: Sequence[ProfiledPair], measurement: CellMeasurement,
                        opts: MeasureOptions) -> SplitResult:
        """Each pair split against the timed step, then pooled: device, host and host_frac
        with CIs, the phases' means scaled to the timed host time, the physical checks."""
        m, sp = measurement, opts.split
        splits = []
        for pair in pairs:
            split = device_split(pair.short, pair.long, cell.T, m.step_ms, pair.profiled_step_ms(cell.T),
                                 sp.host_bound_threshold, sp.top_ops)
            phases = None if pair.phases_1 is None or pair.phases_T is None else \
                cell_phases(list(pair.phases_1), list(pair.phases_T), len(pair.short), split.slowest_rank, cell.T,
                            split.host_ms)
            splits.append(dataclasses.replace(split, phases=phases))
        step = TimedStep(m.step_ms, m.step_ci_low_ms, m.step_ci_high_ms, len(m.reps), opts.measure.ci_level)
        band = (sp.min_profiler_overhead, sp.max_profiler_overhead)
        pooled = pooled_split(splits, step, sp.host_bound_threshold, band)
        if not all(s.phases is not None for s in splits):
            return pooled
        profiled_host = pooled.profiled_step_ms - pooled.device_ms
        scale = pooled.host_ms / profiled_host if pooled.host_ms > 0 and profiled_host > 0 else 1.0
        phases = over_pairs([s.phases for s in splits], pooled.host_ms, opts.measure.ci_level, scale)
        return pooled_split(splits, step, sp.host_bound_threshold, band, phases)

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

    def _profiling_in_rounds(self, group: GroupMeasurement,
                             options: MeasureOptions) -> Optional[Callable[[int, RepTiming], None]]:
        """With the split on: the hook that profiles a cell right after its timed pair in the
        rounds measure/periods.profiled_rounds picks (the same rounds for every cell)."""
        if not (options.split.enabled and self.spec.profile):
            return None
        plans = [profiled_rounds(cell.reps, options.split.reps) for cell in group.cells]

        def profile(i: int, timing: RepTiming) -> None:
            if timing.round in plans[i] and len(group.profiled[i]) < options.split.reps:
                self._phase = f"profiling {len(group.profiled[i]) + 1} of {options.split.reps}"
                self._take_profile(group, i, options, timing.round)

        return profile

    def _take_profile(self, group: GroupMeasurement, i: int, options: MeasureOptions, round_index: int = -1) -> None:
        """One more profiled pair of the group's cell i; a failure is the cell's alone (kept,
        raised when the cell is asked for), never its companions'."""
        if group.profile_errors[i] is not None:
            return
        try:
            group.profiled[i].append(self._profile_pair(group.cells[i], group.prompts[i], options, group.traces[i],
                                                        round_index))
        except Exception as exc:  # noqa: BLE001 - the cell's failure, reported with it
            group.profile_errors[i] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=5)}"

    def _reprofile_together(self, group: GroupMeasurement, options: MeasureOptions) -> None:
        """Cells whose split comes out impossible or implausible are profiled again (split.reps
        new pairs each) together, pass by pass in a shuffled order, before the group is handed
        over, up to measure.remeasure_unstable times: never one cell alone, later, in another
        period than its companions'. What is still flagged then is flagged (_split_checked)."""
        for attempt in range(options.measure.remeasure_unstable):
            flagged = [i for i, cell in enumerate(group.cells) if group.profile_errors[i] is None
                       and not self._split(cell, group.profiled[i], group.summaries[i], options).sound]
            if not flagged:
                return
            log.warning("profiling %d of the group's %d cell(s) again, together: their split is impossible or "
                        "implausible (attempt %d)", len(flagged), len(group.cells), attempt + 2)
            for i in flagged:
                group.profiled[i] = []
            self._profile_the_rest(group, options, flagged)

    def _profile_the_rest(self, group: GroupMeasurement, options: MeasureOptions,
                          which: Optional[Sequence[int]] = None) -> None:
        """Profiled pairs the rounds did not reach (fewer rounds than split.reps, a cell that
        stopped early, rounds continued from a killed run), of `which` cells (all): after the
        rounds, cell by cell in a shuffled order per pass, as a round would take them."""
        cells = range(len(group.cells)) if which is None else which
        for k in range(options.split.reps):
            missing = [i for i in cells if len(group.profiled[i]) <= k]
            for i in round_order(missing, 1_000_000 + k, group.cells[0].seed):
                self._phase = f"profiling {k + 1} of {options.split.reps} (after the rounds)"
                self._take_profile(group, i, options)

    def _split_checked(self, cell: Cell, timed: TimedCell, options: MeasureOptions,
                       keep: Optional[dict[str, bytes]]) -> tuple[SplitResult, Stability]:
        """The split from the pairs profiled in the group's rounds (profiled again with its
        group when it was impossible or implausible: _reprofile_together); still impossible
        (device time below zero or above the timed step) or implausible (a check of
        split_stats fails), it is flagged split_impossible or split_implausible. A cell whose
        profiling failed fails with that error."""
        if timed.profile_error is not None:
            raise RuntimeError(f"profiling the cell failed: {timed.profile_error}")
        pairs = list(timed.profiled) or [self._profile_pair(cell, timed.prompts, options, keep)
                                         for _ in range(options.split.reps)]
        split = self._split(cell, pairs, timed.measurement, options)
        if split.sound:
            return split, timed.stability
        log.warning("%s: profiled device time %.3f ms (floor %.3f) on a %.3f ms step, profiler overhead %.2f: %s",
                    cell.key, split.device_ms, split.device_floor_ms, timed.measurement.step_ms,
                    split.profiler_overhead, ", ".join(split.implausible) or "outside the step")
        return split, timed.stability.with_reason("split_impossible" if not split.possible else "split_implausible")
