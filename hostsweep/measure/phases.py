"""Profiler trace → host time per named phase of a decode step, differenced like the split (pure).

vLLM V1 marks the phases of a step with named profiler scopes when
VLLM_CUSTOM_SCOPES_FOR_PROFILING=1 (`gpu_model_runner: preprocess / forward / postprocess /
sample / draft / bookkeep / eplb / ModelRunnerOutput` in the model's worker process,
`schedule: …` in the scheduler); hostsweep's vLLM plugin (engines/vllm_plugin.py) adds
`hostsweep: …` scopes around what the EngineCore loop and the worker do per step. The scopes
land in the chrome trace as `user_annotation` events. What counts as a phase's time:

- only `user_annotation` events (the host timeline; a GPU trace's `gpu_user_annotation`
  copies on the device stream are not host time) whose name has a known prefix
  (PHASE_PREFIXES): the profiler's own "PyTorch Profiler (0)" span and user scopes are not
  phases;
- a phase scope nested inside another phase scope of the same thread is part of its parent
  and is not counted again (the outermost-scope rule, as the kernel rule of traces.py);
- a phase's **host** time is its scope time minus the compute ops inside it (on the CPU
  build the compute ops are the split's device time, counted by traces.py's rule; on a GPU
  the host scopes hold no kernels, they run on the device stream, so nothing is subtracted).
  The forward phase is reported as `forward_dispatch` (host: Python, dispatch, launches) with
  its compute ops beside as `forward_compute_ms` (device).

Per step, each total is differenced exactly like the kernel totals:
(total(T) - total(1)) / (T - 1).
"""
from __future__ import annotations

import bisect
import dataclasses
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional

from hostsweep.measure.traces import GLOO_ALLREDUCE_RUN, Interval, kernel_source, outermost_compute_ops

# Scope-name prefixes that mark a phase; the rest of the name is the phase.
PHASE_PREFIXES = ("gpu_model_runner: ", "schedule: ", "hostsweep: ")
PHASE_CATEGORY = "user_annotation"
# Spans hostsweep's plugin marks around whole units (the worker's execute_model/sample_tokens,
# the EngineCore's step and loop): they enclose phases, so they are summed apart.
SPAN_PREFIX = "hostsweep span: "
# The phases in the order a step runs them (what figures stack); unknown phases follow.
PHASE_ORDER = ("schedule", "engine_worker_ipc", "preprocess", "forward_dispatch", "postprocess", "sample",
               "draft", "bookkeep", "eplb", "model_runner_output", "update_from_output", "other_engine_loop",
               "frontend_exposed")


def phase_name(scope: str) -> Optional[str]:
    """'gpu_model_runner: ModelRunnerOutput' -> 'model_runner_output'; None for non-phases.
    Scheduler scopes keep their prefix ('schedule: allocate_slots' -> 'schedule_allocate_slots')."""
    for prefix in PHASE_PREFIXES:
        if scope.startswith(prefix):
            rest = scope[len(prefix):]
            if prefix == "schedule: ":
                rest = "schedule_" + rest
            snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", rest).lower()
            return re.sub(r"[^a-z0-9]+", "_", snake).strip("_") or None
    return None


@dataclass
class PhaseTotals:
    """Per phase of one trace (one rank, one profiled generate), in microseconds: scope time
    (outermost scopes only) and the compute ops inside those scopes."""

    scope_us: Counter = field(default_factory=Counter)
    compute_us: Counter = field(default_factory=Counter)
    count: Counter = field(default_factory=Counter)
    span_us: Counter = field(default_factory=Counter)  # `hostsweep span: …` markers, not phases
    span_end_us: dict[str, float] = field(default_factory=dict)  # each span's latest end (the trace's clock)
    compute_total_us: float = 0.0  # every counted compute op of the trace, in a phase or not


def outermost_phase_scopes(events: Iterable[dict[str, Any]]) -> list[tuple[Any, Interval]]:
    """(thread, interval named by its phase) of phase scopes not nested in another phase scope
    of the same thread."""
    by_thread: dict[Any, list[Interval]] = {}
    for e in events:
        if e.get("cat") != PHASE_CATEGORY or e.get("ph") != "X":
            continue
        name = phase_name(str(e.get("name", "")))
        if name is None:
            continue
        start = float(e["ts"])
        by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(
            Interval(start, start + float(e.get("dur", 0.0)), name))
    kept: list[tuple[Any, Interval]] = []
    for thread, intervals in by_thread.items():
        intervals.sort(key=lambda i: (i.start_us, -i.end_us))  # a parent before its children
        enclosing_end = float("-inf")
        for iv in intervals:
            if iv.end_us <= enclosing_end:
                continue
            kept.append((thread, iv))
            enclosing_end = iv.end_us
    return kept


def _overlap_us(scope: Interval, ops: list[Interval], ends: list[float]) -> float:
    """Compute time of `ops` inside `scope`: the outermost ops of one thread do not overlap, so
    sorted by start they are sorted by end too, and only those from the first ending after
    the scope's start are looked at."""
    total = 0.0
    for op in ops[bisect.bisect_right(ends, scope.start_us):]:
        if op.start_us >= scope.end_us:
            break
        total += min(scope.end_us, op.end_us) - max(scope.start_us, op.start_us)
    return total


def phase_totals(trace: Mapping[str, Any]) -> PhaseTotals:
    """Scope time, and compute time inside the scopes, per phase of one trace."""
    events = trace.get("traceEvents", [])
    scopes = outermost_phase_scopes(events)
    out = PhaseTotals()
    for e in events:
        name = str(e.get("name", ""))
        if e.get("cat") == PHASE_CATEGORY and e.get("ph") == "X" and name.startswith(SPAN_PREFIX):
            span, end = name[len(SPAN_PREFIX):], float(e.get("ts", 0.0)) + float(e.get("dur", 0.0))
            out.span_us[span] += float(e.get("dur", 0.0))
            out.span_end_us[span] = max(end, out.span_end_us.get(span, end))
    if not scopes:
        return out
    # On a GPU the host scopes hold no device time (kernels run on the stream, apart).
    ops_by_thread: dict[Any, list[Interval]] = {}
    if kernel_source(events) != "cuda":
        cpu_by_thread: dict[Any, list[dict[str, Any]]] = {}
        gloo_runs: dict[Any, list[dict[str, Any]]] = {}  # by process: gloo's thread reduces for the caller's
        for e in events:
            if e.get("cat") == "cpu_op":
                cpu_by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
            elif e.get("name") == GLOO_ALLREDUCE_RUN:
                gloo_runs.setdefault(e.get("pid"), []).append(e)
        # a gloo all-reduce lasts until its run on gloo's thread ends, in the phases as in the totals
        ops_by_thread = {thread: sorted(outermost_compute_ops(ops + gloo_runs.get(thread[0], [])),
                                        key=lambda i: i.start_us)
                         for thread, ops in cpu_by_thread.items()}
        out.compute_total_us = sum(op.end_us - op.start_us for ops in ops_by_thread.values() for op in ops)
    ends = {thread: [op.end_us for op in ops] for thread, ops in ops_by_thread.items()}
    for thread, iv in scopes:
        out.scope_us[iv.name] += iv.end_us - iv.start_us
        out.compute_us[iv.name] += _overlap_us(iv, ops_by_thread.get(thread, []), ends.get(thread, []))
        out.count[iv.name] += 1
    return out


@dataclass(frozen=True)
class PhaseSplit:
    """Host time per phase per decode step (ms), and how much of host_ms the phases cover."""

    host_ms: dict[str, float]  # phase -> host ms per step (forward as forward_dispatch)
    forward_compute_ms: float  # compute ops inside the forward scope, per step (device)
    attributed_frac: float  # sum of host_ms over the cell's host_ms (nan without host time)
    ci_ms: dict[str, tuple[float, float]] = field(default_factory=dict)  # over profiled pairs (2 or more)
    pairs: int = 1
    # Work beside the step's critical path, per step (ms): the front-end's output processing,
    # which the EngineCore's next step overlaps; what of it delays the step is the host phase
    # frontend_exposed.
    overlapped_ms: dict[str, float] = field(default_factory=dict)
    # The timed step's host time over the profiled pairs' (profiled step - device): host_ms and
    # ci_ms are as profiled; times scale they apportion the timed host_ms (timed_ms, the metrics).
    scale: float = 1.0
    forward_compute_ci: Optional[tuple[float, float]] = None  # over 3 or more pairs

    @property
    def timed_ms(self) -> dict[str, float]:
        """Host ms per phase scaled to the timed step (host_ms x scale)."""
        return {name: ms * self.scale for name, ms in self.host_ms.items()}

    @property
    def largest(self) -> Optional[tuple[str, float]]:
        """(phase, ms scaled to the timed step) of the largest phase."""
        return max(self.timed_ms.items(), key=lambda kv: kv[1]) if self.host_ms else None

    def ordered(self) -> list[tuple[str, float]]:
        """(phase, ms scaled to the timed step) in the order a step runs them."""
        timed = self.timed_ms
        known = [(p, timed[p]) for p in PHASE_ORDER if p in timed]
        return known + sorted((p, v) for p, v in timed.items() if p not in PHASE_ORDER)


def per_step_ms(total_1_us: float, total_T_us: float, T: int) -> float:
    return (total_T_us - total_1_us) / (T - 1) / 1e3


def phase_split(short: PhaseTotals, long: PhaseTotals, T: int, host_ms: float,
                extra_ms: Optional[Mapping[str, float]] = None) -> Optional[PhaseSplit]:
    """Differenced host ms per phase from a T=1 / T pair's phase totals (one rank), plus
    phases measured elsewhere (extra_ms: e.g. the EngineCore's); None when the traces hold
    no phase scopes (the scopes were off)."""
    names = set(short.scope_us) | set(long.scope_us)
    if not names and not extra_ms:
        return None
    host: dict[str, float] = {}
    forward_compute = 0.0
    for name in names:
        scope = per_step_ms(short.scope_us[name], long.scope_us[name], T)
        compute = per_step_ms(short.compute_us[name], long.compute_us[name], T)
        if name == "forward":
            host["forward_dispatch"] = scope - compute
            forward_compute = compute
        else:
            host[name] = scope - compute
    host.update(extra_ms or {})
    attributed = sum(host.values()) / host_ms if host_ms > 0 else float("nan")
    return PhaseSplit(host, forward_compute, attributed)


def engine_phases(worker_1: PhaseTotals, worker_T: PhaseTotals, core_1: Optional[PhaseTotals],
                  core_T: Optional[PhaseTotals], T: int) -> dict[str, float]:
    """Per step, what the spans apportion (ms): the EngineCore's own phases, its wait for the
    worker beyond the worker's busy time (engine_worker_ipc: the two RPC round trips of a
    step), the loop outside its steps (other_engine_loop), and the worker's busy time outside
    every phase scope and compute op (other_worker). A part whose spans are missing is left out."""
    out: dict[str, float] = {}
    d = per_step_ms
    if worker_1.span_us.get("worker_busy") and worker_T.span_us.get("worker_busy"):
        busy = d(worker_1.span_us["worker_busy"], worker_T.span_us["worker_busy"], T)
        scoped = d(sum(worker_1.scope_us.values()), sum(worker_T.scope_us.values()), T)
        compute_in = d(sum(worker_1.compute_us.values()), sum(worker_T.compute_us.values()), T)
        compute_all = d(worker_1.compute_total_us, worker_T.compute_total_us, T)
        out["other_worker"] = busy - scoped - (compute_all - compute_in)
    else:
        busy = None
    if core_1 is None or core_T is None:
        return out
    engine = {name: d(core_1.scope_us[name], core_T.scope_us[name], T) for name in set(core_T.scope_us)}
    out.update(engine)
    if not core_T.span_us.get("engine_step"):  # no synchronous steps (async scheduling): no IPC or loop
        return out
    step = d(core_1.span_us["engine_step"], core_T.span_us["engine_step"], T)
    out["other_engine_loop"] = d(core_1.span_us["engine_loop"], core_T.span_us["engine_loop"], T) - step
    if busy is not None:
        out["engine_worker_ipc"] = step - sum(engine.values()) - busy
    return out


def frontend_phases(core_1: PhaseTotals, core_T: PhaseTotals, front_1: PhaseTotals, front_T: PhaseTotals,
                    T: int) -> tuple[dict[str, float], dict[str, float]]:
    """Per step (ms): what of the front-end's work delays the step, and the work itself.

    The EngineCore hands each step's outputs to a queue and steps on, so the front-end
    processes step k's outputs while step k+1 runs. What it cannot hide is what it still
    has to do after the engine's last step: `tail` = the front-end loop's end − the engine
    loop's end (one wall clock: both intervals are time.time()). A front-end that keeps up
    leaves the same tail at T=1 and T (one output to process), which the difference
    cancels; one slower than the engine falls further behind each step, and the tail grows
    by the excess. So frontend_exposed = (tail(T) − tail(1)) / (T − 1), a host phase; the
    output processing itself (its scopes) is reported beside as overlapped."""
    overlapped = {name: per_step_ms(front_1.scope_us[name], front_T.scope_us[name], T)
                  for name in set(front_T.scope_us)}
    ends = [(f.span_end_us.get("frontend_loop"), c.span_end_us.get("engine_loop"))
            for f, c in ((front_1, core_1), (front_T, core_T))]
    if any(front is None or core is None for front, core in ends):
        return {}, overlapped
    (front_end_1, core_end_1), (front_end_T, core_end_T) = ends
    return {"frontend_exposed": per_step_ms(front_end_1 - core_end_1, front_end_T - core_end_T, T)}, overlapped


def cell_phases(phases_1: list[PhaseTotals], phases_T: list[PhaseTotals], ranks: int, rank: int, T: int,
                host_ms: float) -> Optional[PhaseSplit]:
    """A cell's phases from a profiled pair: the given rank's trace (the split's slowest), and
    when the engine recorded them, the EngineCore's intervals (entry `ranks` of each list)
    and the front-end's (entry `ranks` + 1)."""
    if len(phases_1) < ranks or len(phases_T) < ranks:
        return None
    core_1 = phases_1[ranks] if len(phases_1) > ranks else None
    core_T = phases_T[ranks] if len(phases_T) > ranks else None
    front_1 = phases_1[ranks + 1] if len(phases_1) > ranks + 1 else None
    front_T = phases_T[ranks + 1] if len(phases_T) > ranks + 1 else None
    worker_1, worker_T = phases_1[rank], phases_T[rank]
    if core_1 is not None and core_T is not None:
        # Where the model runs inside the EngineCore (a GPU's single-process executor) the
        # rank's trace also holds vLLM's `schedule: …` scopes: the EngineCore's `schedule`
        # interval already encloses them.
        worker_1, worker_T = without_scheduler(worker_1), without_scheduler(worker_T)
    extra = engine_phases(worker_1, worker_T, core_1, core_T, T)
    overlapped: dict[str, float] = {}
    if core_1 is not None and core_T is not None and front_1 is not None and front_T is not None:
        exposed, overlapped = frontend_phases(core_1, core_T, front_1, front_T, T)
        extra.update(exposed)
    split = phase_split(worker_1, worker_T, T, host_ms, extra)
    return None if split is None else dataclasses.replace(split, overlapped_ms=overlapped)


def without_scheduler(totals: PhaseTotals) -> PhaseTotals:
    """The totals less vLLM's own scheduler phases (schedule_*)."""
    keep = [name for name in totals.scope_us if not name.startswith("schedule_")]
    return PhaseTotals(Counter({n: totals.scope_us[n] for n in keep}), Counter({n: totals.compute_us[n] for n in keep}),
                       Counter({n: totals.count[n] for n in keep}), totals.span_us, totals.span_end_us,
                       totals.compute_total_us)


def over_pairs(pairs: list[PhaseSplit], host_ms: float, level: float, scale: float = 1.0) -> PhaseSplit:
    """Several profiled pairs' phases as one: per phase the mean over the pairs, a phase
    missing from a pair counting as 0 there, with Student's t-interval from 3 pairs on (none
    below: a CI of 2 pairs would not cover, measure/split_stats.py). `scale` = the timed host
    time / the profiled pairs' host time is kept with them (PhaseSplit.scale): the profiled
    step is slower (the profiler's overhead), and the phases scaled by it apportion the timed
    host_ms in the proportions the profiled pairs measured. attributed_frac: the scaled
    phases' sum over host_ms."""
    from hostsweep.measure.split_stats import mean_t_ci  # lazily: stdlib-only for benchmarks/gpu_check.py

    cis: dict[str, tuple[float, float]] = {}

    def means_of(per_pair: list[dict[str, float]]) -> dict[str, float]:
        means = {}
        for name in sorted(set().union(*per_pair)):
            means[name], ci, _ = mean_t_ci([p.get(name, 0.0) for p in per_pair], level)
            if ci is not None:
                cis[name] = ci
        return means

    means = means_of([p.host_ms for p in pairs])
    overlapped = means_of([p.overlapped_ms for p in pairs])
    forward, forward_ci, _ = mean_t_ci([p.forward_compute_ms for p in pairs], level)
    attributed = sum(means.values()) * scale / host_ms if host_ms > 0 else float("nan")
    return PhaseSplit(means, forward, attributed, cis, len(pairs), overlapped, scale, forward_ci)


def phase_metrics(split: PhaseSplit, profiled_host_ms: Optional[float] = None) -> dict[str, float]:
    """phase_<name>_ms per phase and their CIs, scaled to the timed host time (PhaseSplit.scale,
    logged as phase_scale: divide by it for the profiled values), forward_compute_ms and
    attributed_frac; with the profiled pairs' own host time (profiled step minus device_ms),
    attributed_frac_profiled: how much of it the phases name (~1 when the scopes cover the step)."""
    metrics = {f"phase_{name}_ms": ms for name, ms in split.ordered()}
    metrics.update({f"overlapped_{name}_ms": ms for name, ms in sorted(split.overlapped_ms.items())})
    for name, (low, high) in split.ci_ms.items():
        overlapped = name in split.overlapped_ms  # beside the step, not host time: as profiled
        kind, scale = ("overlapped", 1.0) if overlapped else ("phase", split.scale)
        metrics[f"{kind}_{name}_ci_low_ms"], metrics[f"{kind}_{name}_ci_high_ms"] = low * scale, high * scale
    metrics.update(forward_compute_ms=split.forward_compute_ms, attributed_frac=split.attributed_frac,
                   phase_scale=split.scale)
    if split.forward_compute_ci is not None:
        metrics["forward_compute_ci_low_ms"], metrics["forward_compute_ci_high_ms"] = split.forward_compute_ci
    if profiled_host_ms is not None and profiled_host_ms > 0:
        metrics["attributed_frac_profiled"] = sum(split.host_ms.values()) / profiled_host_ms
    return metrics
