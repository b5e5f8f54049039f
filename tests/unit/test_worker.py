"""The worker in-process with the fake engine: results, provenance, failure capture."""
from __future__ import annotations

import math

import pytest

from hostsweep.config.grid import build_cells
from hostsweep.run.worker import MeasureOptions, SweepWorker, release_ray_thread_limits
from tests.conftest import compose_typed


def fake_cells(*overrides: str):
    return build_cells(compose_typed(["+sku=cpu", "engine.name=fake", "measure.reps=4",
                                      "measure.warmups=1", "measure.T=5", *overrides]))


def test_worker_measures_a_cell_with_a_finite_step_and_bracketing_ci(tmp_path):
    cell = fake_cells("batch=[1]", "ctx=[64]")[0]
    worker = SweepWorker(cell.engine, str(tmp_path))
    result = worker.measure(cell, MeasureOptions(resamples=500))
    assert result.status == "FINISHED" and result.error is None
    m = result.measurement
    assert math.isfinite(m.step_ms) and m.step_ms > 0
    assert m.step_ci_low_ms <= m.step_ms <= m.step_ci_high_ms
    assert len(m.reps) == 4
    assert result.host["vllm_version"] == "fake" and result.host["hostname"]


def test_a_short_generate_fails_the_cell_instead_of_corrupting_it(tmp_path):
    cell = fake_cells("batch=[2]", "ctx=[8]")[0]
    worker = SweepWorker(cell.engine, str(tmp_path))
    worker.engine.generate = lambda prompts, tokens: [tokens, tokens - 1]
    result = worker.measure(cell, MeasureOptions(resamples=500))
    assert result.status == "FAILED" and result.measurement is None
    assert "engine produced" in result.error


def test_ray_thread_caps_are_dropped_and_reported():
    environ = {"OMP_NUM_THREADS": "1", "PATH": "/bin"}
    assert release_ray_thread_limits(environ) == {"OMP_NUM_THREADS": "1"}
    assert environ == {"PATH": "/bin"}


def test_split_through_the_fake_profiler_recovers_the_known_device_share(tmp_path):
    from hostsweep.engines.fake import FakeEngine

    cell = fake_cells("batch=[2]", "ctx=[64]", "tp=2")[0]
    worker = SweepWorker(cell.engine, str(tmp_path))
    result = worker.measure(cell, MeasureOptions(resamples=500, split=True, split_reps=3))
    assert result.status == "FINISHED", result.error
    expected_ms = FakeEngine.step_seconds(worker.engine, 2, 64) * FakeEngine.device_share * 1e3
    split = result.split
    assert split.kernel_source == "cpu-ops"
    assert split.device_ms == pytest.approx(expected_ms, rel=1e-9)
    assert split.per_rank_device_ms == pytest.approx((expected_ms, expected_ms), rel=1e-9)
    assert 0 < split.host_frac < 1 and split.host_ms == pytest.approx(result.measurement.step_ms - split.device_ms)
    assert split.top_ops[0][0] == "aten::linear"
    assert not list((tmp_path / "traces").glob("*.json.gz"))  # parsed traces are not left behind


def test_kept_traces_come_back_with_the_result(tmp_path):
    cell = fake_cells("batch=[1]", "ctx=[16]")[0]
    worker = SweepWorker(cell.engine, str(tmp_path))
    result = worker.measure(cell, MeasureOptions(resamples=200, keep_traces=True))
    assert len(result.traces) == 2 and all(name.endswith(".json.gz") for name in result.traces)


def test_linearity_sweep_reports_r2_for_wall_and_kernels(tmp_path):
    cell = fake_cells("batch=[1]", "ctx=[16]")[0]
    worker = SweepWorker(cell.engine, str(tmp_path))
    result = worker.measure(cell, MeasureOptions(resamples=200, linearity_T=(8, 32, 128), linearity_reps=3))
    lin = result.linearity
    assert lin.tokens == (8, 32, 128) and len(lin.kernel_ms) == 3
    assert lin.r2_kernel == pytest.approx(1.0)  # synthetic kernels are exactly linear in T
    assert lin.r2_wall > 0.8


def test_pyspy_view_samples_the_worker_or_is_skipped_cleanly(tmp_path, monkeypatch):
    from hostsweep.run import pyspy

    cell = fake_cells("batch=[1]", "ctx=[16]", "measure.T=20")[0]
    worker = SweepWorker(cell.engine, str(tmp_path))
    result = worker.measure(cell, MeasureOptions(resamples=200, split=False, pyspy_seconds=1.0))
    assert result.status == "FINISHED", result.error
    if pyspy.pyspy_binary() is None:
        assert result.thread_states is None
    else:
        assert result.thread_states["samples"].sum() > 0
        assert ((result.thread_states["active_frac"] >= 0) & (result.thread_states["active_frac"] <= 1)).all()
    monkeypatch.setattr(pyspy, "pyspy_binary", lambda: None)
    skipped = worker.measure(cell, MeasureOptions(resamples=200, split=False, pyspy_seconds=1.0))
    assert skipped.status == "FINISHED" and skipped.thread_states is None


def test_worker_takes_back_every_core_when_ray_daemons_were_confined():
    import os
    import subprocess
    import sys

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    script = ("import os; os.sched_setaffinity(0, {%d}); from hostsweep.run.worker import restore_affinity; "
              "restore_affinity(); print(sorted(os.sched_getaffinity(0)))" % cores[-1])
    env = {**os.environ, "HOSTSWEEP_WORKER_AFFINITY": ",".join(map(str, cores))}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(cores)


def test_a_worker_started_under_sched_idle_measures_under_the_normal_policy_or_refuses():
    import os
    import subprocess
    import sys

    script = ("import os; os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0)); "
              "from hostsweep.run.worker import restore_scheduler; print(restore_scheduler(), os.sched_getscheduler(0))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    restored = out.returncode == 0 and out.stdout.split() == ["other", str(os.SCHED_OTHER)]
    refused = out.returncode != 0 and "SCHED_OTHER" in out.stderr  # unprivileged, RLIMIT_NICE 0
    assert restored if os.geteuid() == 0 else (restored or refused), out.stderr[-2000:]
