"""Noise floors measured on the machine at hand (compare/floors.py, stages/noise.py,
stages/noise.py): the estimates and their upper bounds recover a known SD at their stated
coverage over many seeds; auto floors take the newest calibration of the cells' machine and
engine, a given number wins, and without a calibration the defaults stand and the line says
how to measure; the stage on the fake engine logs a calibration a later paired diff uses."""
from __future__ import annotations

import contextlib
import io
import math

import mlflow
import numpy as np
import pandas as pd
import pytest
from scipy import stats

from hostsweep.compare.floors import (AUTO, CALIBRATE_COMMAND, DEFAULT_INSTANCE_FLOOR_PCT,
                                      FloorEstimate, MachineEngine, NoiseCalibration, floor_setting, instance_floor,
                                      machine_engine, resolve_floors, resolve_start_floor, sd_upper_pct, start_floor)
from hostsweep.config.schema import ConfigError
from hostsweep.stages.noise import aa_config, log_noise_calibration, newest_calibration, open_calibration_run
from hostsweep.stages import noise as noise_stage
from hostsweep.stages import sweep
from tests.conftest import compose_raw, compose_typed
from tests.fakes import FakeBackend

HERE = MachineEngine("host-a", "AMD EPYC 7B13", "0.32.0")
SEEDS = 2000


@pytest.mark.parametrize("true_pct,draws,se", [(1.5, 3, 0.0), (1.5, 3, 0.01), (4.0, 5, 0.02), (0.8, 8, 0.005)])
def test_the_instance_floors_upper_bound_holds_the_true_sd_at_its_confidence_over_many_seeds(true_pct, draws, se):
    """Each A/A's geometric mean: the instance draw plus its rounds' sampling error (se), which
    the floor takes out: the bound holds the instance SD at 80 %, and the variance estimate
    (before its floor at 0) is unbiased."""
    rng = np.random.default_rng(7)
    sigma = math.log1p(true_pct / 100)
    held, raw_variances = 0, []
    for _ in range(SEEDS):
        g = rng.normal(0.0, math.sqrt(sigma ** 2 + se ** 2), draws)
        estimate = instance_floor(g, 0.8, [se] * draws)
        held += estimate.upper_pct >= true_pct - 1e-9
        raw_variances.append(np.mean(g ** 2) - se ** 2)
    # coverage 0.8 within its binomial band over SEEDS seeds (3 SE)
    assert abs(held / SEEDS - 0.8) < 3 * math.sqrt(0.8 * 0.2 / SEEDS)
    assert np.mean(raw_variances) == pytest.approx(sigma ** 2, rel=0.1)


def test_the_sampling_error_is_taken_out_of_the_instance_floor_not_counted_as_instance_spread():
    g = [0.02, -0.02, 0.02]
    assert instance_floor(g, 0.8).pct == pytest.approx(math.expm1(0.02) * 100)
    assert instance_floor(g, 0.8, [0.02] * 3).pct == 0.0  # all of it sampling noise
    assert 0 < instance_floor(g, 0.8, [0.01] * 3).pct < instance_floor(g, 0.8).pct


def test_the_between_start_floors_upper_bound_holds_the_true_sd_at_its_confidence():
    rng = np.random.default_rng(11)
    true_pct, df, held = 9.7, 4, 0
    for _ in range(SEEDS):
        sample_sd = true_pct * math.sqrt(rng.chisquare(df) / df)
        held += start_floor(sample_sd, df, 0.8).upper_pct >= true_pct
    assert abs(held / SEEDS - 0.8) < 3 * math.sqrt(0.8 * 0.2 / SEEDS)


def test_an_sd_from_three_draws_has_an_upper_bound_one_point_seven_times_it_and_none_without_draws():
    assert sd_upper_pct(1.0, 3, 0.8) == pytest.approx(math.sqrt(3 / stats.chi2.ppf(0.2, 3)))
    assert sd_upper_pct(1.0, 3, 0.8) == pytest.approx(1.73, abs=0.01)
    assert sd_upper_pct(1.0, 0, 0.8) == math.inf
    assert instance_floor([math.nan, None], 0.8) is None
    assert start_floor(None, 3, 0.8) is None and start_floor(2.0, 0, 0.8) is None


def calibration(instance: float = 1.2, start: float = 6.0) -> NoiseCalibration:
    return NoiseCalibration("run123", "2026-12-07", HERE, FloorEstimate(instance, instance * 1.73, 3, 0.8),
                            FloorEstimate(start, start * 1.5, 4, 0.8))


def test_auto_floors_take_the_calibrations_upper_bounds_and_name_the_run():
    floors = resolve_floors(AUTO, AUTO, calibration())
    assert floors.instance_floor_pct == pytest.approx(2.1) and floors.noise_floor_pct == pytest.approx(9.0)
    assert "upper 80% bound, 3 df" in floors.line and "calibrated 2026-12-07 on host-a" in floors.line
    assert "run run123" in floors.line
    point = resolve_floors(AUTO, AUTO, calibration(), use="point")
    assert point.instance_floor_pct == pytest.approx(1.2) and point.noise_floor_pct == pytest.approx(6.0)


def test_a_given_floor_wins_over_the_calibration_and_null_means_none():
    floors = resolve_floors(None, 2.5, calibration())
    assert floors.instance_floor_pct == 2.5 and floors.noise_floor_pct is None
    assert "diff.instance_floor_pct=2.5, given" in floors.line and "calibrated" not in floors.line


def test_without_a_calibration_the_documented_defaults_stand_and_the_line_names_the_command():
    floors = resolve_floors(AUTO, AUTO, None, looked_for=HERE)
    assert floors.instance_floor_pct == DEFAULT_INSTANCE_FLOOR_PCT and floors.noise_floor_pct is None
    assert "no noise calibration of host-a (AMD EPYC 7B13, vLLM 0.32.0)" in floors.line
    assert CALIBRATE_COMMAND in floors.line
    assert resolve_start_floor(AUTO, None)[0] is None
    value, line = resolve_start_floor(AUTO, None, fallback=9.7)  # a preset's own measured floor
    assert value == 9.7 and "(default)" in line and CALIBRATE_COMMAND in line
    assert resolve_start_floor(AUTO, calibration(), fallback=9.7)[0] == pytest.approx(9.0)
    assert compose_typed(["+experiment=generalize-cpu"]).config.fit.start_floor_fallback_pct == 9.7


@pytest.mark.parametrize("value", ["often", -1, 100, "1e9"])
def test_a_floor_that_is_not_auto_null_or_a_percentage_is_refused_naming_the_key(value):
    with pytest.raises(ValueError, match="instance_floor_pct must be auto, null or a percentage"):
        floor_setting(value, "instance_floor_pct")
    with pytest.raises(ConfigError, match="diff.instance_floor_pct must be auto"):
        from hostsweep.compare import diff_options
        diff_options(compose_typed(["+sku=cpu", f"diff.instance_floor_pct={value}"]).config.diff)


def test_the_cells_machine_is_one_host_device_and_engine_or_none():
    cells = pd.DataFrame({"hostname": ["host-a"] * 2, "device_name": ["AMD EPYC 7B13"] * 2,
                          "vllm_version": ["0.32.0", "0.32.0"]})
    assert machine_engine(cells) == HERE
    assert machine_engine(cells.assign(hostname=["host-a", "host-b"])) is None
    assert machine_engine(cells.drop(columns="vllm_version")) is None


def test_the_newest_calibration_of_the_machine_and_engine_is_found_and_no_other(new_store, tmp_path):
    uri = new_store(tmp_path / "mlflow.db")
    for where, instance in ((HERE, 1.0), (HERE, 2.0), (MachineEngine("host-b", "AMD EPYC 7B13", "0.32.0"), 3.0),
                            (MachineEngine("host-a", "AMD EPYC 7B13", "0.31.0"), 4.0)):
        run = open_calibration_run(uri, "noise", where, "default")
        made = NoiseCalibration(run.run_id, "2026-12-07", where, instance_floor([math.log1p(instance / 100)], 0.8),
                                None)
        (tmp_path / run.run_id).mkdir()
        log_noise_calibration(run, made, {"study": "default"}, tmp_path / run.run_id, "note")
    found = newest_calibration(uri, "noise", HERE)
    assert found is not None and found.instance.pct == pytest.approx(2.0) and found.start is None
    assert found.where == HERE
    assert newest_calibration(uri, "noise", MachineEngine("host-c", "x", "y")) is None
    assert newest_calibration(uri, "no-such-experiment", HERE) is None
    assert newest_calibration(uri, "noise", None) is None


FAKE = ["+sku=cpu", "engine.name=fake", "measure.T=5", "measure.reps=8", "measure.warmups=1", "ctx=[16]",
        "batch=[1,2]", "split.enabled=false", "ray.exclusive=false", "tracking.heartbeat_s=0.5"]


def test_the_noise_stage_logs_a_calibration_that_a_later_paired_diff_uses_and_names(new_store, tmp_path,
                                                                                    monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOSTSWEEP_FAKE_TIME_SCALE", "4")
    uri = new_store(tmp_path / "mlflow.db")
    args = [*FAKE, f"tracking.uri={uri}", "study=cal"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = noise_stage.run(compose_raw([*args, "stage=noise", "noise.aas=2", "noise.starts=2"]),
                               tmp_path / "noise", lambda folder: FakeBackend(folder / "work"))
    assert code == 0, out.getvalue()
    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=["noise"])
    assert len(runs) == 1 and runs["tags.hostsweep.kind"].iloc[0] == "noise_calibration"
    assert runs["metrics.instance_floor_df"].iloc[0] == 2 and runs["metrics.start_floor_df"].iloc[0] >= 1
    run_id = runs["run_id"].iloc[0]
    assert (tmp_path / "noise" / "noise" / "noise.md").is_file()
    assert {"hostsweep-cal-noise-aa1", "hostsweep-cal-noise-aa2", "hostsweep-cal-noise-starts"} <= {
        e.name for e in mlflow.search_experiments()}
    # a paired A/A measured afterwards, floors auto: its diff uses the calibration and says so
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert sweep.run(compose_raw([*args, "study=later", "pair.enabled=true"]), tmp_path / "later",
                         FakeBackend(tmp_path / "later-work")) == 0
    said = [line for line in out.getvalue().splitlines() if line.startswith("floors:")]
    assert said and f"run {run_id}" in said[0] and "upper 80% bound" in said[0], out.getvalue()[-3000:]
    # and with a floor given, the given one
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        sweep.run(compose_raw([*args, "study=given", "pair.enabled=true", "diff.instance_floor_pct=3"]),
                  tmp_path / "given", FakeBackend(tmp_path / "given-work"))
    assert "diff.instance_floor_pct=3, given" in out.getvalue()
    mlflow.set_tracking_uri(None)


def test_a_noise_calibration_of_a_b_side_or_without_an_aa_is_refused_in_one_line(tmp_path):
    for extra, needle in ((["+pair.against.debug.delay_ms=1"], "not stage=noise's"),
                          (["noise.aas=0"], "noise.aas must be >= 1"), (["noise.starts=1"], "noise.starts must be 0"),
                          (["noise.confidence=1.2"], "noise.confidence must be in")):
        with pytest.raises(ConfigError, match=needle):
            noise_stage.run(compose_raw([*FAKE, "stage=noise", *extra]), tmp_path / "refused")


@pytest.mark.parametrize("given,rounds,per_start", [(None, 40, 12), (24, 24, 24)])
def test_the_calibrations_aas_by_rounds_take_a_gates_forty_rounds_unless_measure_reps_is_given(
        given, rounds, per_start, monkeypatch, tmp_path):
    asked = []

    def measured(raw_cfg, name, design, starts, reps, run_dir, backends, start_first="a"):
        asked.append((design, reps, aa_config(raw_cfg, name, design, starts, reps).measure.reps))
        return noise_stage.AaOutcome(name, 1, None)

    monkeypatch.setattr(noise_stage, "measure_aa", measured)
    args = [arg for arg in FAKE if not arg.startswith("measure.reps")] + ([f"measure.reps={given}"] if given else [])
    with contextlib.redirect_stderr(io.StringIO()):
        assert noise_stage.run(compose_raw([*args, "stage=noise", "noise.aas=2", "noise.starts=2"]), tmp_path) == 1
    assert asked == [("rounds", rounds, rounds)] * 2 + [("starts", per_start, per_start)]
