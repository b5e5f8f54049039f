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
- with HOSTSWEEP_DELAY_PHASE=<phase> and HOSTSWEEP_DELAY_MS=<d> (config `debug.`), spins d ms
  (a busy wait) inside that phase's scope on every step, profiled or not: the test-only hook
  that shows a phase's time is on the step's critical path (benchmarks/phase_delay.py).

Keep it free of everything but the standard library, torch and vLLM, imported lazily.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Optional

DIR_ENV, DELAY_PHASE_ENV, DELAY_MS_ENV = "HOSTSWEEP_PHASES_DIR", "HOSTSWEEP_DELAY_PHASE", "HOSTSWEEP_DELAY_MS"
SPAN_PREFIX = "hostsweep span: "
# The delay hook's phases that vLLM has no scope for: hostsweep's EngineCore scopes.
ENGINE_PHASES = ("schedule", "update_from_output")


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
    """The EngineCore's step intervals while profiling, written as a chrome trace at the stop."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.prefix: Optional[str] = None
        self.events: list[dict[str, Any]] = []
        self.first_start: Optional[float] = None
        self.last_end: Optional[float] = None

    def start(self, prefix: Optional[str]) -> None:
        self.prefix, self.events, self.first_start, self.last_end = prefix or "profile", [], None, None

    def add(self, name: str, row: str, start_s: float, end_s: float) -> None:
        if self.prefix is None:
            return
        self.events.append({"ph": "X", "cat": "user_annotation", "name": name, "pid": "EngineCore", "tid": row,
                            "ts": start_s * 1e6, "dur": (end_s - start_s) * 1e6})

    def step(self, start_s: float, end_s: float) -> None:
        if self.prefix is None:
            return
        self.add(SPAN_PREFIX + "engine_step", "step", start_s, end_s)
        self.first_start = start_s if self.first_start is None else self.first_start
        self.last_end = end_s

    def stop(self) -> Optional[Path]:
        if self.prefix is None:
            return None
        if self.first_start is not None:
            self.add(SPAN_PREFIX + "engine_loop", "loop", self.first_start, self.last_end)
        path = self.folder / f"{self.prefix}_enginecore.json"
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"traceEvents": self.events}))
        tmp.replace(path)  # whole or absent: the worker reads it once stop_profile returns
        self.prefix = None
        return path


def _timed(recorder: EngineRecorder, name: str, method: Callable, delay_s: float) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.time()
        try:
            return method(*args, **kwargs)
        finally:
            if delay_s > 0:
                spin(delay_s)
            recorder.add("hostsweep: " + name, "phases", start, time.time())
    return wrapper


def patch_engine_core(recorder: EngineRecorder, delay_phase: str, delay_s: float) -> None:
    """Time EngineCore.step and its scheduler's schedule / update_from_output; record
    between EngineCore.profile(start) and profile(stop). The class is patched before the
    EngineCore binds its step function (plugins load first in EngineCore.__init__)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    if getattr(EngineCore, "_hostsweep_phases", False):
        return
    for name in ENGINE_PHASES:
        setattr(Scheduler, name, _timed(recorder, name, getattr(Scheduler, name),
                                        delay_s if delay_phase == name else 0.0))
    step, profile = EngineCore.step, EngineCore.profile

    def timed_step(self: Any) -> Any:
        start = time.time()
        outputs = step(self)
        if outputs[1]:  # a step that ran the model
            recorder.step(start, time.time())
        return outputs

    def recorded_profile(self: Any, is_start: bool = True, profile_prefix: Optional[str] = None,
                         *args: Any, **kwargs: Any) -> Any:
        if is_start:
            recorder.start(profile_prefix)
        result = profile(self, is_start, profile_prefix, *args, **kwargs)
        if not is_start:
            recorder.stop()
        return result

    EngineCore.step, EngineCore.profile = timed_step, recorded_profile
    EngineCore._hostsweep_phases = True


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
    """vLLM's entry point: a no-op unless hostsweep's engine asked for phases."""
    folder = os.environ.get(DIR_ENV)
    if not folder:
        return
    delay_phase = os.environ.get(DELAY_PHASE_ENV, "")
    delay_s = float(os.environ.get(DELAY_MS_ENV, "0") or 0) / 1e3
    import vllm.v1.utils as vllm_utils

    vllm_utils._PROFILER_FUNC = scope_factory(delay_phase, delay_s)
    patch_engine_core(EngineRecorder(Path(folder)), delay_phase, delay_s)
    try:
        mark_worker_busy()
    except ImportError:  # a build without the GPU worker module: the spans are skipped
        pass
