"""Adaptive repetitions (measure.target_ci_pct): a cell stops at the first planned look
whose CI (at the looks' stricter level) is narrow enough, between min_reps and max_reps,
and keeps its old key when the rule is off. Its coverage is in test_coverage.py."""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from hostsweep.config.grid import build_cells
from hostsweep.config.schema import ConfigError
from hostsweep.engines.fake import FakeEngine
from hostsweep.measure.protocol import adaptive_looks, ci_target_rule, run_protocol, summarize
from hostsweep.measure.results import MeasureOptions, cell_metrics, cell_row
from hostsweep.run.worker import SweepWorker
from tests.conftest import compose_typed

SEEDS = range(30)
T, MIN_REPS, MAX_REPS, TARGET = 33, 8, 48, 2.0
LOOKS = adaptive_looks(TARGET, MIN_REPS, MAX_REPS)


class NoisyFakeClock:
    """The fake engine's wall time (fixed overhead + T steps, batch 1, ctx 128), without
    sleeping, each generate scaled by (1 + noise * N(0, 1)): quiet or noisy data with a
    known step."""

    def __init__(self, noise: float, seed: int) -> None:
        self.noise, self.rng = noise, np.random.default_rng(seed)
        self.step = FakeEngine.step_s * (1.0 + 128 / 4096)

    def __call__(self, tokens: int) -> float:
        wall = FakeEngine.overhead_s + self.step * tokens
        return wall * max(0.05, 1.0 + self.noise * self.rng.standard_normal())


def adaptive_run(noise: float, seed: int):
    stop = ci_target_rule(TARGET, MIN_REPS, MAX_REPS, 0.95)
    timings = run_protocol(NoisyFakeClock(noise, seed), T, warmups=1, reps=MAX_REPS, stop=stop)
    return summarize(timings, 0.95, LOOKS)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_quiet_cell_stops_early_with_its_ci_within_the_target(seed):
    m = adaptive_run(noise=0.005, seed=seed)
    assert MIN_REPS <= len(m.reps) < MAX_REPS and len(m.reps) in LOOKS
    assert m.ci_half_width_pct <= TARGET  # the CI that stopped it is the one reported
    assert m.ci_coverage >= 0.95
    assert m.step_ms == pytest.approx(NoisyFakeClock(0, 0).step * 1e3, rel=0.05)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_noisy_cell_runs_to_max_reps(seed):
    m = adaptive_run(noise=0.3, seed=seed)
    assert len(m.reps) == MAX_REPS
    assert m.ci_half_width_pct > TARGET


def test_a_looser_target_never_needs_more_reps():
    for seed in SEEDS:
        used = []
        for target in (1.0, 2.0, 5.0, 20.0):
            stop = ci_target_rule(target, MIN_REPS, MAX_REPS, 0.95)
            used.append(len(run_protocol(NoisyFakeClock(0.03, seed), T, 0, MAX_REPS, stop=stop)))
        assert used == sorted(used, reverse=True)


def test_the_looks_are_min_reps_then_every_four_pairs_and_max_reps():
    assert adaptive_looks(2.0, 8, 22) == (8, 12, 16, 20, 22)
    assert adaptive_looks(2.0, 8, 8) == (8,) and adaptive_looks(None, 8, 48) == ()


def test_a_cell_stops_only_at_a_look():
    always = ci_target_rule(99.0, 8, 20, 0.95)  # any CI is narrow enough: stops at the first look
    assert len(run_protocol(NoisyFakeClock(0.01, 0), T, 0, 20, stop=always)) == 8
    pairs = run_protocol(NoisyFakeClock(0.01, 0), T, 0, 11)
    assert [always(pairs[:n]) for n in (8, 9, 10, 11)] == [True, False, False, False]


def test_without_a_rule_every_rep_runs():
    assert len(run_protocol(NoisyFakeClock(0.0, 0), T, warmups=0, reps=7)) == 7


FAKE = ["+sku=cpu", "engine.name=fake", "measure.warmups=1", "measure.remeasure_unstable=0",
        "batch=[1]", "ctx=[64]", "split.enabled=false"]


def test_the_worker_stops_a_cell_at_the_target_and_logs_reps_and_half_width(tmp_path):
    loose = [*FAKE, "measure.target_ci_pct=99", "measure.min_reps=8", "measure.max_reps=12"]
    (cell,) = build_cells(compose_typed(loose))
    worker = SweepWorker(cell.engine, str(tmp_path))
    result = worker.measure(cell, MeasureOptions.of(compose_typed(loose).config))
    metrics = cell_metrics(result)
    assert metrics["reps_used"] in (8, 12)
    assert metrics["ci_half_width_pct"] == pytest.approx(result.measurement.ci_half_width_pct, rel=1e-5)  # 6 digits
    row = cell_row(result, "run")
    assert row["reps_used"] == metrics["reps_used"] and row["target_ci_pct"] == 99.0
    assert (row["min_reps"], row["max_reps"]) == (8, 12)


def test_an_unreachable_target_runs_the_worker_to_max_reps(tmp_path):
    strict = [*FAKE, "measure.target_ci_pct=1e-9", "measure.min_reps=8", "measure.max_reps=9"]
    (cell,) = build_cells(compose_typed(strict))
    result = SweepWorker(cell.engine, str(tmp_path)).measure(cell, MeasureOptions.of(compose_typed(strict).config))
    assert result.status == "FINISHED" and len(result.measurement.reps) == 9


def test_cells_without_a_target_keep_the_key_they_always_had():
    """Resumed studies find their cells: the key of a fixed-reps cell is the legacy hash (of a
    cell measured without a preload, as every cell logged before engine.preload was)."""
    for cell in build_cells(compose_typed(["+sku=cpu", "engine.preload=none", "measure.min_reps=7",
                                           "measure.max_reps=9"])):
        e = cell.engine
        legacy = json.dumps([e.sku, e.model, e.shape_json, e.model_path, e.mode, None, e.tp, e.dtype,
                             e.engine, cell.batch, cell.ctx, cell.T, cell.warmups, cell.reps], sort_keys=True)
        assert cell.key.endswith(hashlib.sha1(legacy.encode()).hexdigest()[:10])
        assert "target_ci_pct" not in cell.params()


def test_the_target_and_its_bounds_are_part_of_an_adaptive_cells_key():
    fixed = build_cells(compose_typed(["+sku=cpu"]))
    two = build_cells(compose_typed(["+sku=cpu", "measure.target_ci_pct=2"]))
    five = build_cells(compose_typed(["+sku=cpu", "measure.target_ci_pct=5"]))
    more = build_cells(compose_typed(["+sku=cpu", "measure.target_ci_pct=2", "measure.max_reps=60"]))
    keys = [[c.key for c in cells] for cells in (fixed, two, five, more)]
    assert len({k for ks in keys for k in ks}) == 4 * len(fixed)
    assert two[0].reps == 48 and two[0].params()["max_reps"] == 48


@pytest.mark.parametrize("override,message", [
    ("measure.target_ci_pct=0", "measure.target_ci_pct must be a percentage in (0, 100) or null, got 0"),
    ("measure.target_ci_pct=150", "measure.target_ci_pct must be a percentage in (0, 100) or null, got 150"),
])
def test_a_target_outside_0_to_100_is_refused_in_one_line(override, message):
    with pytest.raises(ConfigError) as err:
        compose_typed(["+sku=cpu", override])
    assert str(err.value) == message


def test_bounds_of_an_adaptive_cell_are_checked_only_when_a_target_is_set():
    compose_typed(["+sku=cpu", "measure.min_reps=1", "measure.max_reps=0"])  # unused: fine
    with pytest.raises(ConfigError, match=r"^measure.min_reps must be >= 8 .*got 7$"):
        compose_typed(["+sku=cpu", "measure.target_ci_pct=2", "measure.min_reps=7"])
    with pytest.raises(ConfigError, match=r"^measure.max_reps must be >= measure.min_reps \(10\), got 8$"):
        compose_typed(["+sku=cpu", "measure.target_ci_pct=2", "measure.min_reps=10", "measure.max_reps=8"])
