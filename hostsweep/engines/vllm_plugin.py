"""A vLLM general plugin (entry point group `vllm.general_plugins`, pyproject.toml): the
phase scopes of a decode step, in every vLLM process, only while the profiler records.

vLLM loads general plugins in each of its processes (the front-end, the EngineCore, each
model worker). `register` does nothing unless the engine that hostsweep starts set
HOSTSWEEP_PHASES_DIR (engines/vllm_engine.py); then it

- replaces vLLM's scope factory (vllm.v1.utils._PROFILER_FUNC, what
  VLLM_CUSTOM_SCOPES_FOR_PROFILING=1 makes `torch.profiler.record_function`) by one that
  opens the scope only while a torch profiler records: unscoped, an entered and left
  record_function still costs ~12 us per scope on this machine, on every step of the timed
  pairs (measured: benchmarks/RESULTS.md);
- in the model's worker processes, marks the worker's own `execute_model` and
  `sample_tokens` (spans, `hostsweep span: worker_busy`): what the EngineCore waits for;
- in the EngineCore process, which vLLM's profiler does not record, times each step while
  the engine is asked to profile (EngineCore.profile) and writes the intervals at the stop
  as a small chrome trace `<prefix>_enginecore.json` in that folder (wall-clock
  microseconds): `hostsweep: schedule` and `hostsweep: update_from_output` (phases, on one
  thread row), and the spans `engine_step` (schedule → wait for the worker → update) and
  `engine_loop` (first step's start to last step's end) on rows of their own;
- in the front-end process (the `LLM`, hostsweep's worker), times each call of the output
  processor (`hostsweep: frontend_process_outputs`, the work of `llm_engine step:
  process_outputs`) between LLMEngine.start_profile and stop_profile, with the span
  `frontend_loop` (first call's start to last call's end), written at the stop as
  `<prefix>_frontend.json`: the EngineCore hands its outputs to a queue and steps on, so
  this work overlaps the next step unless the front-end falls behind (measure/phases.py);
- with HOSTSWEEP_DELAY_PHASE=<phase> and HOSTSWEEP_DELAY_MS=<d> (config `debug.`), spins d ms
  (a busy wait) inside that phase's scope on every step, profiled or not: the test-only hook
  that shows a phase's time is on the step's critical path (benchmarks/phase_delay.py).

Keep it free of everything but the standard library, torch and vLLM, imported lazily.
"""
from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

DIR_ENV, DELAY_PHASE_ENV, DELAY_MS_ENV = "HOSTSWEEP_PHASES_DIR", "HOSTSWEEP_DELAY_PHASE", "HOSTSWEEP_DELAY_MS"
SPAN_PREFIX = "hostsweep span: "
# The delay hook's phases that vLLM has no scope for: hostsweep's EngineCore scopes, and
# the front-end's output processing.
ENGINE_PHASES = ("schedule", "update_from_output")
FRONTEND_PHASE = "frontend_process_outputs"


def _phase_of(scope: str) -> str:
    """'gpu_model_runner: sample' -> 'sample' (the delay hook's phase names; see measure/phases.py)."""
    rest = scope.split(": ", 1)[-1]
    return "".join("_" + c.lower() if c.isupper() and i else c.lower() for i, c in enumerate(rest))


def spin(seconds: float) -> None:
    """Hold the CPU for `seconds`, as a phase whose code got slower would. A sleep would give
    the core away: measured here, a 2-ms sleep in `sample` raised the step by 2.9-4.2 ms, the
    rest as colder forward, preprocess and IPC after the wake-up (benchmarks/phase_delay.py)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class _Delayed:
    """A scope that spins `delay_s` before it closes: the phase grows by exactly that."""

    def __init__(self, inner: Any, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s

    def __enter__(self) -> Any:
        return self.inner.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        spin(self.delay_s)
        return self.inner.__exit__(*exc)


def scope_factory(delay_phase: str = "", delay_s: float = 0.0) -> Callable[[str], Any]:
    """record_function while a torch profiler records, else a null context; the delayed
    phase spins inside its scope either way."""
    from torch.autograd import profiler as autograd_profiler

    record_function = autograd_profiler.record_function

    def scope(name: str) -> Any:
        inner = record_function(name) if autograd_profiler._is_profiler_enabled else contextlib.nullcontext()
        if delay_s > 0 and _phase_of(name) == delay_phase:
            return _Delayed(inner, delay_s)
        return inner

    return scope


class EngineRecorder:
    """One vLLM process's intervals while profiling (the EngineCore's steps, or the
    front-end's output processing), written as a chrome trace `<prefix>_<suffix>.json` at
    the stop, with the span `<loop>` from the first recorded interval's start to the last's end."""

    def __init__(self, folder: Path, process: str = "EngineCore", suffix: str = "enginecore",
                 loop: str = "engine_loop") -> None:
        self.folder, self.process, self.suffix, self.loop = folder, process, suffix, loop
        self.prefix: Optional[str] = None
        self.events: list[dict[str, Any]] = []
        self.first_start: Optional[float] = None
        self.last_end: Optional[float] = None

    def start(self, prefix: Optional[str]) -> None:
        self.prefix, self.events, self.first_start, self.last_end = prefix or "profile", [], None, None

    def add(self, name: str, row: str, start_s: float, end_s: float) -> None:
        if self.prefix is None:
            return
        self.events.append({"ph": "X", "cat": "user_annotation", "name": name, "pid": self.process, "tid": row,
                            "ts": start_s * 1e6, "dur": (end_s - start_s) * 1e6})

    def extend(self, start_s: float, end_s: float) -> None:
        """Widen the loop span to cover this interval."""
        if self.prefix is None:
            return
        self.first_start = start_s if self.first_start is None else self.first_start
        self.last_end = end_s

    def step(self, start_s: float, end_s: float) -> None:
        if self.prefix is None:
            return
        self.add(SPAN_PREFIX + "engine_step", "step", start_s, end_s)
        self.extend(start_s, end_s)

    def stop(self) -> Optional[Path]:
        if self.prefix is None:
            return None
        if self.first_start is not None:
            self.add(SPAN_PREFIX + self.loop, "loop", self.first_start, self.last_end)
        path = self.folder / f"{self.prefix}_{self.suffix}.json"
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"traceEvents": self.events}))
        tmp.replace(path)  # whole or absent: the worker reads it once stop_profile returns
        self.prefix = None
        return path


@dataclass
class Hooks:
    """What the patched methods of one process use, set by every `register`: a process may
    start several engines one after the other (a benchmark's, a GPU's in-process EngineCore),
    and the classes are patched once, by the first."""

    engine: Optional[EngineRecorder] = None
    frontend: Optional[EngineRecorder] = None
    delay_phase: str = ""
    delay_s: float = 0.0

    def delay_in(self, phase: str) -> float:
        return self.delay_s if self.delay_phase == phase else 0.0


HOOKS = Hooks()


def _timed(name: str, method: Callable) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.time()
        try:
            return method(*args, **kwargs)
        finally:
            delay_s = HOOKS.delay_in(name)
            if delay_s > 0:
                spin(delay_s)
            if HOOKS.engine is not None:
                HOOKS.engine.add("hostsweep: " + name, "phases", start, time.time())
    return wrapper


def patch_engine_core() -> None:
    """Time EngineCore.step and its scheduler's schedule / update_from_output; record
    between EngineCore.profile(start) and profile(stop). The class is patched before the
    EngineCore binds its step function (plugins load first in EngineCore.__init__)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    if getattr(EngineCore, "_hostsweep_phases", False):
        return
    for name in ENGINE_PHASES:
        setattr(Scheduler, name, _timed(name, getattr(Scheduler, name)))
    step, profile = EngineCore.step, EngineCore.profile

    def timed_step(self: Any) -> Any:
        start = time.time()
        outputs = step(self)
        if outputs[1] and HOOKS.engine is not None:  # a step that ran the model
            HOOKS.engine.step(start, time.time())
        return outputs

    def recorded_profile(self: Any, is_start: bool = True, profile_prefix: Optional[str] = None,
                         *args: Any, **kwargs: Any) -> Any:
        if is_start and HOOKS.engine is not None:
            HOOKS.engine.start(profile_prefix)
        result = profile(self, is_start, profile_prefix, *args, **kwargs)
        if not is_start and HOOKS.engine is not None:
            HOOKS.engine.stop()
        return result

    EngineCore.step, EngineCore.profile = timed_step, recorded_profile
    EngineCore._hostsweep_phases = True


def patch_front_end() -> None:
    """Time the front-end's output processing between LLMEngine.start_profile and
    stop_profile (the recorder's file is whole once stop_profile returns); spin inside it on
    every call when the delay hook is set there."""
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.engine.output_processor import OutputProcessor

    if getattr(LLMEngine, "_hostsweep_phases", False):
        return
    process, start_profile, stop_profile = OutputProcessor.process_outputs, LLMEngine.start_profile, \
        LLMEngine.stop_profile

    def timed_process(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.time()
        try:
            return process(self, *args, **kwargs)
        finally:
            delay_s = HOOKS.delay_in(FRONTEND_PHASE)
            if delay_s > 0:
                spin(delay_s)
            end = time.time()
            if HOOKS.frontend is not None:
                HOOKS.frontend.add("hostsweep: " + FRONTEND_PHASE, "phases", start, end)
                HOOKS.frontend.extend(start, end)

    def recorded_start(self: Any, profile_prefix: Optional[str] = None, *args: Any, **kwargs: Any) -> Any:
        result = start_profile(self, profile_prefix, *args, **kwargs)
        if HOOKS.frontend is not None:
            HOOKS.frontend.start(profile_prefix)
        return result

    def recorded_stop(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = stop_profile(self, *args, **kwargs)
        if HOOKS.frontend is not None:
            HOOKS.frontend.stop()
        return result

    OutputProcessor.process_outputs = timed_process
    LLMEngine.start_profile, LLMEngine.stop_profile = recorded_start, recorded_stop
    LLMEngine._hostsweep_phases = True


def mark_worker_busy() -> None:
    """The worker's execute_model and sample_tokens as spans (what the EngineCore waits on)."""
    from vllm.v1.worker.gpu_worker import Worker

    if getattr(Worker, "_hostsweep_phases", False):
        return
    from torch.autograd import profiler as autograd_profiler

    def spanned(method: Callable) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not autograd_profiler._is_profiler_enabled:
                return method(*args, **kwargs)
            with autograd_profiler.record_function(SPAN_PREFIX + "worker_busy"):
                return method(*args, **kwargs)
        return wrapper

    Worker.execute_model = spanned(Worker.execute_model)
    Worker.sample_tokens = spanned(Worker.sample_tokens)
    Worker._hostsweep_phases = True


def register() -> None:
    """vLLM's entry point: a no-op unless hostsweep's engine asked for phases (beyond undoing
    what an earlier engine of this process asked for)."""
    folder = os.environ.get(DIR_ENV)
    if not folder:
        HOOKS.engine = HOOKS.frontend = None
        HOOKS.delay_phase, HOOKS.delay_s = "", 0.0
        vllm_utils = sys.modules.get("vllm.v1.utils")
        if vllm_utils is not None and getattr(vllm_utils._PROFILER_FUNC, "__module__", None) == __name__:
            vllm_utils._PROFILER_FUNC = None  # vLLM's own choice again, made at the next scope
        return
    delay_phase = os.environ.get(DELAY_PHASE_ENV, "")
    delay_s = float(os.environ.get(DELAY_MS_ENV, "0") or 0) / 1e3
    import vllm.v1.utils as vllm_utils

    vllm_utils._PROFILER_FUNC = scope_factory(delay_phase, delay_s)
    HOOKS.engine, HOOKS.delay_phase, HOOKS.delay_s = EngineRecorder(Path(folder)), delay_phase, delay_s
    patch_engine_core()
    if multiprocessing.parent_process() is None:  # the front-end: vLLM starts its other processes
        HOOKS.frontend = EngineRecorder(Path(folder), "frontend", "frontend", "frontend_loop")
        patch_front_end()
    try:
        mark_worker_busy()
    except ImportError:  # a build without the GPU worker module: the spans are skipped
        pass
