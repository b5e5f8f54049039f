"""The fit and comparison on a noisy host: H(N) bounded >= 0 over the batches it serves,
recovered with a CI that covers the truth; unstable cells left out and counted; and an
inconclusive verdict that says whether the cells' noise could have resolved it. All on
synthetic cells drawn from known parameters."""
from __future__ import annotations

import json
from dataclasses import asdict, replace

import numpy as np
import pandas as pd
import pytest
from scipy.optimize import lsq_linear

from hostsweep.config.options import load_calibration, load_model_shape, load_sku
from hostsweep.config.schema import ConfigError, FitConfig
from hostsweep.model.fit import HostFit
from hostsweep.model.fit_console import render
from hostsweep.model.host_calibration import calibrate_host
from hostsweep.model.hostline import endpoint_design, fit_bounded_line, nnls2
from hostsweep.model.resolution import noise_resolution
from hostsweep.model.study_fit import FitOptions, calibration_terms, fit_study
from hostsweep.model.synthetic import clean_step_s, grid, host_truth_s, measure
from hostsweep.measure.unstable import exclude_unstable, left_out_mask, unstable_mask
from hostsweep.report import fit_tables
from hostsweep.report.document import to_markdown
from hostsweep.report.fit_report import Context, build

S0, S1 = 5.0, 0.25  # ms: the line the TP-1 host times are drawn from
BATCHES = np.repeat([1, 2, 4, 8], 3).astype(float)  # 4 batches x 3 contexts, as a TP-1 grid gives
TP_STUDY = calibration_terms(load_calibration("seed002-h100"))
SHAPES = {"llama-3.1-70b": load_model_shape("llama-3.1-70b")}
H100 = grid(["h100"], "llama-3.1-70b", SHAPES, {"h100": asdict(load_sku("h100"))})


def host_cells(host_ms: np.ndarray, batches: np.ndarray = BATCHES, **columns) -> pd.DataFrame:
    return pd.DataFrame({"sku": "cpu", "model": "m", "tp": 1, "batch": batches.astype(int), "ctx": 128,
                         "host_ms": host_ms, "run_id": [f"r{i}" for i in range(len(batches))], **columns})


# --- H(N): bounded, recovered, with a CI ---------------------------------------------------

def test_the_two_column_bounded_solver_agrees_with_lsq_linear():
    rng = np.random.default_rng(0)
    design = endpoint_design(BATCHES, 1.0, 8.0)
    targets = rng.normal(0, 3, (300, BATCHES.size)) + rng.normal(0, 3, (300, 1))
    mine = nnls2(design, targets)
    for row, target in zip(mine, targets):
        assert row == pytest.approx(lsq_linear(design, target, bounds=(0, np.inf), method="bvls").x, abs=1e-9)


def test_the_bounded_line_recovers_s0_and_s1_over_many_noise_seeds():
    fits = [fit_bounded_line(BATCHES, S0 + S1 * (BATCHES - 1) + np.random.default_rng(seed).normal(0, 0.2, 12),
                             resamples=200, seed=seed) for seed in range(50)]
    s0, s1 = np.array([f.s0_ms for f in fits]), np.array([f.s1_ms for f in fits])
    # standard errors here: 0.083 ms (s0) and 0.022 ms (s1); 5 of them per seed, a tenth on average
    assert np.abs(s0 - S0).max() < 0.4 and np.abs(s1 - S1).max() < 0.11
    assert s0.mean() == pytest.approx(S0, abs=0.03) and s1.mean() == pytest.approx(S1, abs=0.01)
    assert all(not f.at_bound for f in fits)


def test_the_bootstrap_ci_covers_the_true_line_in_about_95_percent_of_seeds():
    seeds = range(200)
    covered = np.zeros((len(seeds), 2), bool)
    for seed in seeds:
        host = S0 + S1 * (BATCHES - 1) + np.random.default_rng(seed).normal(0, 0.4, BATCHES.size)
        line = fit_bounded_line(BATCHES, host, seed=seed)
        covered[seed] = (line.s0_ci_ms[0] <= S0 <= line.s0_ci_ms[1], line.s1_ci_ms[0] <= S1 <= line.s1_ci_ms[1])
    assert covered.mean(axis=0).min() >= 0.9


@pytest.mark.parametrize("seed", range(10))
def test_a_falling_host_line_stays_nonnegative_over_the_batches_it_serves(seed):
    """The reported failure: H(N) = 5.969 − 2.296·(N−1) ms from noisy TP-1 cells at N = 1, 2,
    4: negative from N = 4 unbounded; bounded, H >= 0 up to the largest batch served."""
    batches = np.repeat([1, 2, 4], 2).astype(float)
    host = 5.969 - 2.296 * (batches - 1) + np.random.default_rng(seed).normal(0, 0.3, batches.size)
    served = np.array([1, 2, 4, 8])
    calibrated = calibrate_host(host_cells(host, batches), served, seed=seed)
    line = calibrated.line
    assert line.unbounded_s0_ms + line.unbounded_s1_ms * 3 < 0  # unbounded: H(4) < 0
    assert (line.at_batches_ms(np.arange(1, 9)) >= -1e-9).all() and line.high == 8
    assert line.at_bound == ("H(N_hi)",) and "held at 0" in calibrated.describe()
    assert calibrated.fit.time_s(8.0) == pytest.approx(0.0, abs=1e-12)


def test_two_cells_give_the_line_but_no_ci():
    line = fit_bounded_line(np.array([1.0, 4.0]), np.array([5.0, 5.75]))
    assert (line.s0_ms, line.s1_ms) == pytest.approx((5.0, 0.25)) and np.isnan(line.s0_ci_ms).all()
    assert line.resamples == 0


# --- unstable cells ------------------------------------------------------------------------

def test_h_of_n_leaves_unstable_cells_out_and_counts_them():
    host = S0 + S1 * (BATCHES - 1) + np.random.default_rng(1).normal(0, 0.05, BATCHES.size)
    stable = np.array(["true"] * 12, object)
    stable[[1, 5, 10]] = "false"
    reasons = np.array([""] * 12, object)
    reasons[[1, 5, 10]] = ["foreign_cpu", "foreign_cpu,ci_width", "drift"]
    host[[1, 5, 10]] += 20.0  # what a contended cell measures
    cells = host_cells(host, stable=stable, unstable_reasons=reasons)
    calibrated = calibrate_host(cells)
    assert calibrated.line.s0_ms == pytest.approx(S0, abs=0.15) and calibrated.line.s1_ms == pytest.approx(S1, abs=0.04)
    assert calibrated.exclusion.count == 3 and len(calibrated.table) == 9
    assert calibrated.exclusion.reasons() == {"foreign_cpu": 2, "ci_width": 1, "drift": 1}
    assert "r1" not in set(calibrated.table["run_id"])
    assert "3 unstable TP-1 cell(s) left out" in calibrated.describe()
    kept = calibrate_host(cells, exclude=False)
    assert kept.exclusion.count == 0 and kept.line.s0_ms > S0 + 2  # pulled up by the contended cells


@pytest.mark.parametrize("column, unstable", [
    (None, [False, False, False]),  # a run from before the verdict: stable
    (["", "true", None], [False, False, False]),
    (["false", "TRUE", "False"], [True, False, True]),
    ([False, True, np.nan], [True, False, False]),  # cells.csv read back: booleans and blanks
])
def test_a_missing_or_empty_verdict_counts_as_stable(column, unstable):
    cells = pd.DataFrame({"batch": [1, 2, 4]})
    if column is not None:
        cells["stable"] = pd.Series(column, dtype=object)
    assert unstable_mask(cells).tolist() == unstable


def test_the_exclusion_is_counted_and_json_safe():
    cells = pd.DataFrame({"sku": "cpu", "model": "m", "mode": "eager", "tp": np.array([1, 1, 2, 2]),
                          "batch": np.array([1, 4, 1, 4]), "ctx": 128, "run_id": list("abcd"),
                          "stable": ["true", "false", "false", ""], "unstable_reasons": ["", "ci_width", "", ""]})
    kept, exclusion = exclude_unstable(cells)
    assert list(kept["run_id"]) == ["a", "d"] and exclusion.count == 2 and exclusion.total == 4
    assert exclusion.reasons() == {"ci_width": 1, "unstated": 1}
    assert exclusion.describe().startswith("left out 2 of 4 cells as unstable (ci_width: 1, unstated: 1)")
    data = json.loads(json.dumps(exclusion.to_dict(), allow_nan=False))
    assert data["left_out"] == 2 and [c["run_id"] for c in data["cells"]] == ["b", "c"]
    everything, off = exclude_unstable(cells, enabled=False)
    assert len(everything) == 4 and off.count == 0 and off.flagged == 2
    assert "fitted anyway" in off.describe()


def test_a_cell_flagged_only_for_the_machine_is_fitted_and_counted_as_kept():
    # machine_speed says the machine moved over the group's rounds (a cloud VM's normal
    # case), replicate that the first cell timed again alone after them moved; the cell's own
    # pairs still judge its number, so only other reasons leave it out
    cells = pd.DataFrame({"sku": "cpu", "model": "m", "mode": "eager", "tp": 1, "batch": [1, 2, 4, 8, 16],
                          "ctx": 128, "run_id": list("abcde"), "stable": ["false", "false", "false", "false", "true"],
                          "unstable_reasons": ["machine_speed", "ci_width,machine_speed", "", "replicate,machine_speed",
                                               ""]})
    assert left_out_mask(cells).tolist() == [False, True, True, False, False]
    assert unstable_mask(cells).tolist() == [True, True, True, True, False]  # the flag itself stays
    kept, exclusion = exclude_unstable(cells)
    assert list(kept["run_id"]) == ["a", "d", "e"]
    assert exclusion.count == 2 and exclusion.flagged == 4 and exclusion.machine_only == 2
    assert exclusion.reasons() == {"ci_width": 1, "unstated": 1}  # what left each out, not the machine's flag
    assert "kept 2 flagged only for the machine (group_trend/machine_speed/replicate" in exclusion.describe()
    assert json.loads(json.dumps(exclusion.to_dict()))["kept_machine_only"] == 2
    only_machine = cells.iloc[[0, 4]]
    assert exclude_unstable(only_machine)[1].describe().startswith("no cell of 2 is left out as unstable")


def test_the_report_says_which_flagged_cells_were_fitted_because_only_the_machine_moved():
    from hostsweep.report.document import Text
    from hostsweep.report.fit_report import _unstable

    cells = pd.DataFrame({"sku": "cpu", "model": "m", "mode": "eager", "tp": 1, "batch": [1, 2, 4],
                          "ctx": 128, "run_id": list("abc"), "stable": ["false", "false", "true"],
                          "unstable_reasons": ["machine_speed", "drift,machine_speed", ""]})
    text = " ".join(part.text for part in _unstable({}, cells, True) if isinstance(part, Text))
    assert "1 of 3 selected cells are flagged unstable (drift: 1)" in text
    assert "1 more are flagged only for the machine (`machine_speed`, `replicate`) and kept" in text


def test_the_fit_stage_leaves_unstable_cells_out_and_refuses_when_none_is_left():
    from hostsweep.stages.fit import stable_cells

    cells = pd.DataFrame({"sku": "cpu", "model": "m", "mode": ["eager", "eager", "eager", "graph"],
                          "tp": 1, "batch": [1, 2, 4, 1], "ctx": 128, "run_id": list("abcd"),
                          "stable": ["true", "false", "true", "false"], "unstable_reasons": ["", "drift", "", "drift"]})
    kept, exclusion = stable_cells(cells, FitConfig())
    assert list(kept["run_id"]) == ["a", "c"] and exclusion.count == 1 and exclusion.total == 3
    assert len(stable_cells(cells, FitConfig(exclude_unstable=False))[0]) == 3
    with pytest.raises(ConfigError, match="every one of the 1 cells of mode graph is flagged unstable"):
        stable_cells(cells, FitConfig(mode="graph"))


# --- an inconclusive verdict, and whether the cells' noise could have resolved it ------------

def noisy_fit(host_ms: float, noise: float, ci_pct: float | None, **options) -> dict:
    """The TP study's [2] H100 grid with a host term of `host_ms` at every k, measured with
    relative noise `noise` and CIs of ± ci_pct %, fitted on TP-2, TP-4 held out."""
    terms = replace(TP_STUDY, host=HostFit(host_ms * 1e-3, 0.0))
    step = clean_step_s(H100, 0.30, terms.allreduce, host_truth_s("invariant", H100, terms.host))
    cells = measure(H100, step, noise, 0, ci_pct=ci_pct)
    return fit_study(cells, terms, FitOptions("h100", resamples=300, **options)).to_dict()


def heldout(fit: dict) -> dict:
    (group,) = [g for g in fit["groups"] if g["role"] == "held-out"]
    return group


@pytest.mark.parametrize("host_ms, ci_pct, limited_by, says", [
    # CIs of ±30 %: the families differ by up to 12 points, the noise alone moves d by ±5
    (2.0, 30.0, "noise", "could not resolve a MAPE difference of"),
    # the same cells with CIs of ±0.5 %: the noise could have; the error's cell-to-cell spread did not
    (2.0, 0.5, "cell-to-cell spread", "could have resolved a MAPE difference of"),
    # a host term of 0.05 ms: the families differ by under the margin, no CIs could
    (0.05, 0.2, "separation", "and no CIs could"),
])
def test_an_inconclusive_group_says_whether_the_cells_noise_could_have_resolved_it(host_ms, ci_pct, limited_by, says):
    fit = noisy_fit(host_ms, 0.10 if host_ms > 1 else 0.05, ci_pct)
    group = heldout(fit)
    assert group["verdict"] == "inconclusive"
    noise = group["noise"]
    assert noise["limited_by"] == limited_by and says in noise["sentence"]
    assert noise["resolvable"] == (limited_by == "cell-to-cell spread")
    assert noise["median_ci_half_width_pct"] == pytest.approx(ci_pct, rel=1e-6)
    assert noise["detectable_points"] == pytest.approx(1.0 + noise["noise_half_width_points"])
    assert f"the cells' CIs (±{ci_pct:.1f} % median)" in noise["sentence"]
    assert fit["verdict"]["verdict"] == "inconclusive" and "noise" in fit["verdict"]
    json.dumps(fit, allow_nan=False)


def test_a_conclusive_group_carries_no_noise_statement():
    fit = noisy_fit(16.9, 0.015, None)
    assert heldout(fit)["verdict"] == "k-invariant" and "noise" not in heldout(fit)
    assert "noise" not in fit["verdict"]


def test_cells_without_cis_leave_the_question_open():
    step = np.array([10.0, 12.0, 14.0])
    predicted = {"c_times_k": step * 1.02, "free_constant": step * 0.99}
    result = noise_resolution(predicted, step, np.full(3, np.nan), np.full(3, np.nan), ["c_times_k"],
                              ["free_constant"], 1.0, 1.0, "d")
    assert result["resolvable"] is None and "carry no CIs" in result["sentence"]
    assert result["separation_points"] == pytest.approx(3.0)


def test_the_noise_statement_reaches_the_console_the_report_and_its_verdict_line(tmp_path):
    fit = noisy_fit(2.0, 0.10, 30.0)
    verdict, reason = fit_tables.additive_model_verdict(heldout(fit))
    assert verdict == "inconclusive" and "the cells' CIs (±30.0 % median) could not resolve" in reason
    assert "noise: the cells' noise could not resolve the question in 1 of 1" in render(fit)
    cells = pd.DataFrame(fit["cells"]).assign(mode="eager", stable="true", unstable_reasons="",
                                              parent_run_id="parent0", run_id=lambda f: [f"run{i}" for i in f.index])
    cells.loc[[0, 5], ["stable", "unstable_reasons"]] = [["false", "foreign_cpu"], ["false", "ci_width"]]
    ctx = Context("noisy", "hostsweep-noisy", "1", "sqlite:///x.db", "c" * 32, "f" * 32, "models", "now",
                  "python -m hostsweep")
    doc, groups = build(ctx, cells, fit, tmp_path)
    text = to_markdown(doc, tmp_path)
    assert "could not resolve a MAPE difference of" in text
    assert "Noise: the cells' noise could not resolve the question in 1 of 1 inconclusive held-out group(s)" in text
    assert "2 of 24 selected cells are flagged unstable (ci_width: 1, foreign_cpu: 1)" in text
    assert "could not resolve" in groups.loc[0, "reason"]


def test_the_report_says_when_cells_carry_no_stability_verdict(tmp_path):
    fit = noisy_fit(16.9, 0.015, None)
    cells = pd.DataFrame(fit["cells"]).assign(mode="eager")
    ctx = Context("old", "hostsweep-old", "1", "sqlite:///x.db", "c" * 32, "f" * 32, "models", "now", "cmd")
    text = to_markdown(build(ctx, cells, fit, tmp_path)[0], tmp_path)
    assert "carry no stability verdict (measured before it): every one is treated as stable" in text


# --- the compare stage on a store whose TP-1 host split is noisy --------------------------

def log_study(uri: str, experiment: str) -> None:
    """generalize-cpu's 24 cells as FINISHED cell runs, drawn from the TP model with the TP-1
    host times on the reported falling line (negative from N = 4 unbounded), two flagged
    unstable: a TP-1 cell whose host time a neighbour inflated, and a TP-2 cell."""
    from itertools import product

    from mlflow.tracking import MlflowClient

    from hostsweep.model.inputs import model_inputs
    from hostsweep.model.fit import AllReduceFit, allreduce_s, sharded_compute_s

    rows = pd.DataFrame([{"sku": "cpu", "model": m, "tp": k, "batch": n, "ctx": c, "T": 17, "dtype": "float32"}
                         for m, k, n, c in product(["tiny-llama", "small-llama"], [1, 2], [1, 2, 4], [128, 512])])
    spec = {**asdict(load_sku("cpu")), "peak_bf16_tflops": 1.0, "mem_bandwidth_gbps": 20.0, "device_memory_gib": 64}
    frame = model_inputs(rows, {m: load_model_shape(m) for m in rows["model"].unique()}, {"cpu": spec})
    rng = np.random.default_rng(0)
    host = 5.969 - 2.296 * (rows["batch"] - 1) + rng.normal(0, 0.3, len(rows))
    step = 0.5 * sharded_compute_s(frame) * 1e3 + allreduce_s(frame, AllReduceFit(50e-6, 5e9)) * 1e3 + 1.0
    step = step * (1 + rng.normal(0, 0.02, len(rows)))
    client = MlflowClient(uri)
    experiment_id = client.create_experiment(experiment)
    for i, row in rows.iterrows():
        flagged = {3: "foreign_cpu", 20: "drift,ci_width"}.get(i)
        tags = {"cell_key": f"key{i}", "mlflow.parentRunId": "parent0", "stable": "false" if flagged else "true",
                "unstable_reasons": flagged or ""}
        run = client.create_run(experiment_id, tags=tags).info.run_id
        for name in ("sku", "model", "tp", "batch", "ctx", "T", "dtype"):
            client.log_param(run, name, row[name])
        client.log_param(run, "mode", "eager")
        metrics = {"step_ms": step[i], "step_ci_low_ms": step[i] * 0.97, "step_ci_high_ms": step[i] * 1.03}
        if row["tp"] == 1:
            cell_host = host[i] + (30.0 if flagged else 0.0)
            metrics |= {"host_ms": cell_host, "device_ms": step[i] - cell_host, "host_frac": cell_host / step[i]}
        for name, value in metrics.items():
            client.log_metric(run, name, float(value))
        client.set_terminated(run, "FINISHED")


def test_the_compare_stage_leaves_unstable_cells_out_and_bounds_h_of_n(tmp_path, new_store, capsys):
    import yaml

    from hostsweep.stages.compare import compare_study
    from tests.conftest import compose_typed

    uri = new_store(tmp_path / "mlflow.db")
    log_study(uri, "hostsweep-generalize-cpu")
    calibration = tmp_path / "calibration.yaml"
    calibration.write_text(yaml.safe_dump({"roofs": {"cpu": {"measured_tflops": 1.0, "measured_bandwidth_gbps": 20.0}},
                                           "allreduce": {"cpu": {"latency_us": 50.0, "bandwidth_gbps": 5.0, "path": "engine"}}}))
    study = compose_typed(["+experiment=generalize-cpu", "+sku=cpu", f"tracking.uri={uri}", "fit.resamples=200",
                           f"fit.calibration_file={calibration}"])
    assert compare_study(study, tmp_path / "run") == 0
    out = capsys.readouterr().out
    assert "cells: left out 2 of 24 cells as unstable (ci_width: 1, drift: 1, foreign_cpu: 1)" in out
    fit = json.loads((tmp_path / "run" / "compare" / "fit.json").read_text())
    assert fit["unstable"]["left_out"] == 2 and {c["run_id"] for c in fit["unstable"]["cells"]}.isdisjoint(
        c["run_id"] for c in fit["cells"])
    host = fit["calibration"]["host"]
    assert host["s0_ms"] + 3 * host["s1_ms"] >= -1e-9  # H(4) >= 0: the unbounded line is negative there
    assert host["s0_ci_low_ms"] <= host["s0_ms"] <= host["s0_ci_high_ms"] and host["bounded_to_batch"] == 4
    assert any("would go negative over N = 1..4" in w for w in fit["warnings"] + [out])
    report = (tmp_path / "run" / "compare" / "report.md").read_text()
    assert "2 of 24 selected cells are flagged unstable" in report and "The fit: left out 2 of 24" in report
