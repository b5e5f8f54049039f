"""The worker in-process with the fake engine: results, provenance, failure capture."""
from __future__ import annotations

import math

from hostsweep.grid import build_cells
from hostsweep.worker import SweepWorker, release_ray_thread_limits
from tests.conftest import compose_typed


def fake_cells(*overrides: str):
    return build_cells(compose_typed(["+sku=cpu", "engine.name=fake", "measure.reps=4",
                                      "measure.warmups=1", "measure.T=5", *overrides]))


def test_worker_measures_a_cell_with_a_finite_step_and_bracketing_ci(tmp_path):
    cell = fake_cells("batch=[1]", "ctx=[64]")[0]
    worker = SweepWorker(cell.engine, str(tmp_path))
    result = worker.measure(cell, resamples=500, ci_level=0.95)
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
    result = worker.measure(cell, resamples=500, ci_level=0.95)
    assert result.status == "FAILED" and result.measurement is None
    assert "engine produced" in result.error


def test_ray_thread_caps_are_dropped_and_reported():
    environ = {"OMP_NUM_THREADS": "1", "PATH": "/bin"}
    assert release_ray_thread_limits(environ) == {"OMP_NUM_THREADS": "1"}
    assert environ == {"PATH": "/bin"}
