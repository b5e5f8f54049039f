"""hostsweep's vLLM plugin without a vLLM engine: the gated scopes, the delay, the EngineCore's
intervals read back as phases, and the environment the engine hands its processes."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from hostsweep.engines.vllm_plugin import SPAN_PREFIX, EngineRecorder, _phase_of
from hostsweep.measure.phases import engine_phases, phase_totals
from hostsweep.measure.traces import load_trace


@pytest.mark.parametrize("scope, phase", [("gpu_model_runner: sample", "sample"),
                                          ("gpu_model_runner: ModelRunnerOutput", "model_runner_output"),
                                          ("schedule: allocate_slots", "allocate_slots")])
def test_delay_hook_phase_names(scope, phase):
    assert _phase_of(scope) == phase


def test_scopes_are_recorded_only_while_the_profiler_runs_and_the_delay_sits_inside():
    torch = pytest.importorskip("torch")
    from hostsweep.engines.vllm_plugin import scope_factory

    scope = scope_factory("sample", 0.02)
    with scope("gpu_model_runner: forward") as entered:  # profiler off: a null context
        assert entered is None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with scope("gpu_model_runner: sample"):
            pass
        with scope("gpu_model_runner: forward"):
            pass
    durations = {e.key: e.cpu_time_total for e in prof.key_averages() if e.key.startswith("gpu_model_runner")}
    assert set(durations) == {"gpu_model_runner: sample", "gpu_model_runner: forward"}
    assert durations["gpu_model_runner: sample"] >= 20_000  # us: the 20-ms delay is inside the scope
    started = time.perf_counter()
    with scope("gpu_model_runner: sample"):  # the delay also applies unprofiled
        pass
    assert time.perf_counter() - started >= 0.02


def test_engine_recorder_writes_what_phases_reads(tmp_path: Path):
    def run(steps: int) -> Path:
        recorder = EngineRecorder(tmp_path)
        recorder.add("hostsweep: schedule", "phases", 0.0, 1.0)  # before start: dropped
        recorder.start(f"gen{steps}")
        t = 100.0
        for _ in range(steps):
            recorder.add("hostsweep: schedule", "phases", t, t + 0.001)
            recorder.add("hostsweep: update_from_output", "phases", t + 0.004, t + 0.0045)
            recorder.step(t, t + 0.005)
            t += 0.006
        return recorder.stop()

    short, long = phase_totals(load_trace(run(1))), phase_totals(load_trace(run(5)))
    assert short.scope_us["schedule"] == pytest.approx(1000) and set(long.span_us) == {"engine_step", "engine_loop"}
    assert long.span_us["engine_loop"] == pytest.approx(4 * 6000 + 5000)
    no_worker = phase_totals({"traceEvents": []})
    parts = engine_phases(no_worker, no_worker, short, long, 5)
    assert parts == pytest.approx({"schedule": 1.0, "update_from_output": 0.5, "other_engine_loop": 1.0})
    assert not list(tmp_path.glob("*.tmp"))


def test_the_engine_hands_its_processes_the_phase_environment():
    from hostsweep.engines.vllm_engine import phase_environment
    from tests.unit.test_worker import fake_cells

    spec = fake_cells("batch=[1]", "ctx=[16]", "debug.delay_phase=sample", "debug.delay_ms=2")[0].engine
    env = phase_environment(spec, Path("/t"), installed=True)
    assert env == {"HOSTSWEEP_PHASES_DIR": "/t", "VLLM_CUSTOM_SCOPES_FOR_PROFILING": "1",
                   "HOSTSWEEP_DELAY_PHASE": "sample", "HOSTSWEEP_DELAY_MS": "2"}
    assert set(phase_environment(spec, Path("/t"), installed=False).values()) == {None}
    for off in ("split.enabled=false", "split.phases=false"):
        plain = fake_cells("batch=[1]", "ctx=[16]", off)[0].engine
        assert set(phase_environment(plain, Path("/t"), installed=True).values()) == {None}


def test_span_prefix_agrees_with_the_reader():
    from hostsweep.measure import phases

    assert SPAN_PREFIX == phases.SPAN_PREFIX


def test_a_later_engine_of_the_same_process_records_into_its_own_folder_and_one_without_phases_undoes_it(
        tmp_path, monkeypatch):
    """The classes are patched once per process; each register points the hooks at the engine
    starting now (a benchmark starts several engines in one process)."""
    import hostsweep.engines.vllm_plugin as plugin

    monkeypatch.setattr(plugin, "patch_engine_core", lambda: None)
    monkeypatch.setattr(plugin, "patch_front_end", lambda: None)
    monkeypatch.setattr(plugin, "mark_worker_busy", lambda: None)
    monkeypatch.setattr(plugin, "HOOKS", plugin.Hooks())
    for name, delay in (("first", "0"), ("second", "2")):
        monkeypatch.setenv(plugin.DIR_ENV, str(tmp_path / name))
        monkeypatch.setenv(plugin.DELAY_PHASE_ENV, plugin.FRONTEND_PHASE)
        monkeypatch.setenv(plugin.DELAY_MS_ENV, delay)
        plugin.register()
        assert plugin.HOOKS.frontend.folder == plugin.HOOKS.engine.folder == tmp_path / name
    assert plugin.HOOKS.delay_in(plugin.FRONTEND_PHASE) == pytest.approx(0.002) and plugin.HOOKS.delay_in("sample") == 0
    monkeypatch.delenv(plugin.DIR_ENV)
    plugin.register()
    assert plugin.HOOKS.engine is None and plugin.HOOKS.frontend is None and plugin.HOOKS.delay_s == 0
