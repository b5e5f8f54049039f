"""The falsification rule guards against its own inputs: a calibrated all-reduce far from the
one the engine paid in situ gives `allreduce_mismatch`, never `falsified`; right terms and
cells truly below the bound are still falsified; every verdict line names the term that drives
the margin; the additive term comes apart into host-exposed, all-reduce beyond the calibration
and unattributed. Fits over many noise seeds."""
from __future__ import annotations

import dataclasses
from dataclasses import asdict

import numpy as np
import pandas as pd
import pytest

from hostsweep.config.options import load_calibration, load_model_shape, load_sku
from hostsweep.model.fit import AllReduceFit, allreduce_s
from hostsweep.model.study_fit import CalibrationTerms, FitOptions, calibration_terms, fit_study
from hostsweep.model.synthetic import clean_step_s, grid, host_truth_s, measure, push_below_bound
from hostsweep.model.term_checks import (ALLREDUCE_BEYOND, ALLREDUCE_MISMATCH, ENGINE, STANDALONE, allreduce_check, allreduce_path,
                                         decomposition_table, driving_term, path_of)
from hostsweep.report.fit_tables import heldout_groups

SEEDS = range(20)
TRUE_G = 0.30
TP_STUDY = calibration_terms(load_calibration("seed002-h100"))  # λ 21.2 µs, β 307 GB/s, s0 16.9 ms
TRUE = CalibrationTerms({s: TP_STUDY.allreduce["h100"] for s in ("h100", "h200")}, TP_STUDY.host)
SHAPES = {"llama-3.1-70b": load_model_shape("llama-3.1-70b")}
SKUS = {s: asdict(load_sku(s)) for s in ("h100", "h200")}
BOTH = grid(["h100", "h200"], "llama-3.1-70b", SHAPES, SKUS)


def with_insitu(cells: pd.DataFrame, truth: CalibrationTerms, seed: int, noise: float = 0.03) -> pd.DataFrame:
    """The cells' all-reduce as their traces would give it: the true T_ar, rank 0 with noise
    and a ±2 noise CI, the other rank a little slower (it waits inside the all-reduce)."""
    rng = np.random.default_rng(seed + 1000)
    true_ms = allreduce_s(cells, {s: f for s, f in truth.allreduce.items()}) * 1e3
    rank0 = true_ms * (1 + rng.normal(0, noise, len(cells)))
    sharded = cells["tp"].to_numpy() > 1
    out = cells.copy()
    for name, values in (("allreduce_insitu_ms", rank0), ("allreduce_insitu_ci_low_ms", rank0 * (1 - 2 * noise)),
                         ("allreduce_insitu_ci_high_ms", rank0 * (1 + 2 * noise)),
                         ("allreduce_insitu_rank_min_ms", rank0), ("allreduce_insitu_rank_max_ms", rank0 * 1.04)):
        out[name] = np.where(sharded, values, np.nan)
    return out


def h200_tp4_below_the_bound(seed: int) -> pd.DataFrame:
    """The study's cells from the true terms, h200 TP-4's pushed to 75 % of the bound H + T_ar,
    each with the all-reduce its traces would give."""
    clean = clean_step_s(BOTH, TRUE_G, TRUE.allreduce, host_truth_s("invariant", BOTH, TRUE.host))
    cells = measure(BOTH, clean, 0.015, seed)
    h200_tp4 = ((cells["sku"] == "h200") & (cells["tp"] == 4)).to_numpy()
    return with_insitu(push_below_bound(cells, h200_tp4, TRUE.allreduce, TRUE.host, 0.75), TRUE, seed)


def group(report, sku: str, tp: int) -> dict:
    (found,) = [g for g in report.groups if (g["sku"], g["tp"], g["role"]) == (sku, tp, "held-out")]
    return found


SLOW = AllReduceFit(TRUE.allreduce["h100"].latency_s * 30, TRUE.allreduce["h100"].bandwidth_Bps)
MISMEASURED = CalibrationTerms({"h100": SLOW, "h200": SLOW}, TRUE.host)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_planted_calibration_mismatch_is_judged_with_the_insitu_allreduce_never_falsified_by_it(seed):
    # the engine reduces fast (the true λ); the calibration says 30× slower, as a standalone
    # gloo benchmark did beside vLLM's shared-memory all-reduce: the bound lies over every cell,
    # so the groups are judged with the all-reduce their own traces hold, and say so
    cells = with_insitu(measure(BOTH, clean_step_s(BOTH, TRUE_G, TRUE.allreduce, host_truth_s("invariant", BOTH,
                                                                                                TRUE.host)),
                                0.015, seed), TRUE, seed)
    report = fit_study(cells, MISMEASURED, FitOptions("h100"))
    for sku, tp in (("h100", 4), ("h200", 4), ("h200", 2)):
        g = group(report, sku, tp)
        assert g["allreduce_source"] == "insitu" and g["verdict"] not in (ALLREDUCE_MISMATCH, "falsified"), (seed, sku)
        assert not g["falsified"] and g["allreduce_check"]["status"] == "match"
        assert g["allreduce_check_calibrated"]["status"] == ALLREDUCE_MISMATCH
        assert g["allreduce_check_calibrated"]["ratio"] > 10
        assert g["reason"].startswith("T_ar from the group's own traces (in situ)")
    assert report.falsification["falsified_groups"] == [] and report.falsification["allreduce_mismatch_groups"] == []
    assert {(g["sku"], g["tp"]) for g in report.falsification["insitu_allreduce_groups"]} == \
        {("h100", 4), ("h200", 2), ("h200", 4)}
    rows = heldout_groups(report.to_dict(), report.predictions)
    assert ALLREDUCE_MISMATCH not in set(rows["verdict"])


@pytest.mark.parametrize("seed", SEEDS)
def test_cells_truly_below_the_bound_are_falsified_with_the_insitu_allreduce_when_the_calibration_missed_it(seed):
    cells = h200_tp4_below_the_bound(seed)
    report = fit_study(cells, dataclasses.replace(MISMEASURED, host_path=ENGINE), FitOptions("h100"))
    g = group(report, "h200", 4)
    assert g["allreduce_source"] == "insitu" and g["verdict"] == "falsified" and g["terms_on_engine_path"], seed
    assert group(report, "h100", 4)["verdict"] != "falsified"


def test_a_group_whose_traces_hold_no_allreduce_keeps_the_calibrated_t_ar():
    cells = with_insitu(measure(BOTH, clean_step_s(BOTH, TRUE_G, TRUE.allreduce, host_truth_s("invariant", BOTH,
                                                                                                TRUE.host)),
                                0.015, 0), TRUE, 0)
    h200_tp2 = ((cells["sku"] == "h200") & (cells["tp"] == 2)).to_numpy()
    cells.loc[h200_tp2, "allreduce_insitu_ms"] = np.nan  # its traces lost: its check has no point to read
    report = fit_study(cells, MISMEASURED, FitOptions("h100"))
    assert group(report, "h200", 4)["allreduce_source"] == "insitu"
    lost = group(report, "h200", 2)
    assert "allreduce_source" not in lost and lost["allreduce_check"]["status"] == "unmeasured"


@pytest.mark.parametrize("seed", SEEDS)
def test_right_terms_and_cells_truly_below_the_bound_are_still_falsified(seed):
    cells = h200_tp4_below_the_bound(seed)
    on_path = dataclasses.replace(TRUE, host_path=ENGINE)
    report = fit_study(cells, on_path, FitOptions("h100"))
    g = group(report, "h200", 4)
    assert g["verdict"] == "falsified" and g["falsified"] and g["allreduce_check"]["status"] == "match", seed
    assert g["terms_on_engine_path"] and "NOT ON THE ENGINE'S PATH" not in g["reason"]
    assert g["driving_term"]["term"] == "H" and "H drives the margin" in g["reason"]
    assert group(report, "h100", 4)["verdict"] != "falsified"
    # the same cells with H from a standalone microbenchmark: still falsified, and said loudly
    loud = group(fit_study(cells, TRUE, FitOptions("h100")), "h200", 4)
    assert loud["verdict"] == "falsified" and loud["terms_off_engine_path"] == ["H"]
    assert "NOT ON THE ENGINE'S PATH: H measured standalone" in loud["reason"]


@pytest.mark.parametrize("seed", SEEDS)
def test_an_engine_that_pays_more_than_the_calibration_is_judged_and_the_excess_named(seed):
    """The engine's all-reduce ops hold 8x the calibrated transfer (a rank waiting in them for its
    peer, as on a 2-core VM whose ranks share cores with the engine's other processes): the
    bound H + T_ar is then below what the engine pays, so the group is judged, not set aside;
    cells truly below the bound are still falsified, and the verdict names the excess."""
    clean = clean_step_s(BOTH, TRUE_G, TRUE.allreduce, host_truth_s("invariant", BOTH, TRUE.host))
    cells = measure(BOTH, clean, 0.015, seed)
    h200_tp4 = ((cells["sku"] == "h200") & (cells["tp"] == 4)).to_numpy()
    cells = push_below_bound(cells, h200_tp4, TRUE.allreduce, TRUE.host, 0.75)
    waited = dataclasses.replace(TRUE, allreduce={s: AllReduceFit(f.latency_s * 8, f.bandwidth_Bps / 8)
                                                  for s, f in TRUE.allreduce.items()})
    cells = with_insitu(cells, waited, seed)
    report = fit_study(cells, dataclasses.replace(TRUE, host_path=ENGINE), FitOptions("h100"))
    for sku, tp in (("h100", 4), ("h200", 2), ("h200", 4)):
        g = group(report, sku, tp)
        assert g["allreduce_check"]["status"] == ALLREDUCE_BEYOND and g["verdict"] != ALLREDUCE_MISMATCH, (seed, sku)
        assert g["allreduce_check"]["beyond_ms"] > 0 and "beyond the calibrated T_ar" in g["reason"]
    falsified = group(report, "h200", 4)
    assert falsified["verdict"] == "falsified" and falsified["terms_on_engine_path"]
    assert report.falsification["allreduce_mismatch_groups"] == []


def test_the_check_is_one_sided_about_what_it_sets_aside():
    one = {"allreduce_insitu_ms": [0.40], "allreduce_insitu_ci_low_ms": [0.38], "allreduce_insitu_ci_high_ms": [0.43],
           "allreduce_insitu_rank_min_ms": [0.40], "allreduce_insitu_rank_max_ms": [0.44]}
    assert allreduce_check(pd.DataFrame({"allreduce_ms": [0.41], **one}))["status"] == "match"
    assert allreduce_check(pd.DataFrame({"allreduce_ms": [0.60], **one}))["status"] == ALLREDUCE_MISMATCH
    below = allreduce_check(pd.DataFrame({"allreduce_ms": [0.05], **one}))
    assert below["status"] == ALLREDUCE_BEYOND and below["beyond_ms"] == pytest.approx(0.35)


def test_without_an_in_situ_all_reduce_a_standalone_t_ar_is_named_off_the_engines_path():
    cells = measure(BOTH, clean_step_s(BOTH, TRUE_G, TRUE.allreduce, host_truth_s("invariant", BOTH, TRUE.host)),
                    0.015, 0)
    tp4 = ((cells["sku"] == "h200") & (cells["tp"] == 4)).to_numpy()
    report = fit_study(push_below_bound(cells, tp4, TRUE.allreduce, TRUE.host, 0.75),
                       dataclasses.replace(TRUE, host_path=ENGINE), FitOptions("h100"))
    g = group(report, "h200", 4)
    assert g["allreduce_check"]["status"] == "unmeasured" and g["verdict"] == "falsified"
    assert g["terms_off_engine_path"] == ["T_ar"] and "not confirmed in situ" in g["reason"]


@pytest.mark.parametrize("recorded, path", [
    ({}, STANDALONE), ({"path": "engine"}, ENGINE), ({"method": "engine (shm_allreduce)"}, ENGINE),
    ({"path": "standalone"}, STANDALONE), (AllReduceFit(1e-5, 1e9), STANDALONE),
])
def test_a_calibration_without_a_path_is_the_papers_standalone_method(recorded, path):
    assert path_of(recorded) == path
    assert allreduce_path({"allreduce": {"cpu": recorded}}, "cpu") == path


@pytest.mark.parametrize("step, host, tar, compute, term, alone", [
    (3.4, 0.5, 6.0, 0.4, "T_ar", True),     # the CPU study's: the all-reduce bar taller than the step
    (20.0, 16.9, 4.0, 2.0, "H", False),     # a C/k truth under the TP study's s0
    (30.0, 16.9, 1.0, 12.0, "H", False),    # above the bound: the largest piece of the model's step
    (30.0, 2.0, 1.0, 25.0, "compute", False),
])
def test_the_verdict_names_the_term_that_drives_the_margin(step, host, tar, compute, term, alone):
    cells = pd.DataFrame({"step_ms": [step], "microbench_ms": [host], "allreduce_ms": [tar], "compute_ms": [compute],
                          "bound_ms": [host + tar]})
    drive = driving_term(cells)
    assert drive["term"] == term and drive["alone_exceeds_step"] is alone
    assert drive["margin_ms"] == pytest.approx(step - host - tar)


def test_the_in_situ_interval_spans_rank_zeros_ci_and_the_ranks_range():
    cells = pd.DataFrame({"allreduce_ms": [0.50, 0.50], "allreduce_insitu_ms": [0.40, 0.42],
                          "allreduce_insitu_ci_low_ms": [0.38, 0.40], "allreduce_insitu_ci_high_ms": [0.43, 0.44],
                          "allreduce_insitu_rank_min_ms": [0.40, 0.42], "allreduce_insitu_rank_max_ms": [0.52, 0.55]})
    assert allreduce_check(cells)["status"] == "match"  # the slower rank's 0.52-0.55 reaches it
    assert allreduce_check(cells.assign(allreduce_insitu_rank_max_ms=[0.43, 0.44]))["status"] == ALLREDUCE_MISMATCH


@pytest.mark.parametrize("seed", SEEDS)
def test_the_decomposition_recovers_known_host_allreduce_and_unattributed_parts(seed):
    # the TP paper's proportions: an additive term of 17.5 ms with a measured host part of 5.8 ms;
    # planted: the engine's all-reduce 1.2 ms beyond the calibrated T_ar, 10.5 ms unattributed
    rng = np.random.default_rng(seed)
    n, host, beyond, unattributed, tar, compute = 24, 5.8, 1.2, 10.5, 0.8, 3.0
    noise = lambda: rng.normal(0, 0.05, n)  # noqa: E731  per-cell measurement noise
    host_ms, insitu = host + noise(), tar + beyond + noise()
    device_compute = compute + unattributed + noise()  # what the engine's compute took beyond g·T_cmp/k
    pred = pd.DataFrame({"sku": "h100", "model": "m", "tp": 2, "batch": np.arange(n), "ctx": 512,
                         "compute_ms": compute, "allreduce_ms": tar, "host_ms": host_ms, "allreduce_insitu_ms": insitu,
                         "device_ms": device_compute + insitu, "step_ms": device_compute + insitu + host_ms})
    pred["free_constant_ms"] = compute + tar + (pred["step_ms"] - compute - tar).mean()  # the fitted constant
    row = decomposition_table(pred, "free_constant").iloc[0]
    assert row["host_exposed_ms"] == pytest.approx(host, abs=0.05)
    assert row["allreduce_beyond_calibrated_ms"] == pytest.approx(beyond, abs=0.05)
    assert row["unattributed_ms"] == pytest.approx(unattributed, abs=0.08)
    assert row["additive_ms"] == pytest.approx(host + beyond + unattributed, abs=0.1)
    assert row["host_share"] + row["allreduce_share"] + row["unattributed_share"] == pytest.approx(1.0)
    assert row["device_compute_ms"] + row["allreduce_insitu_ms"] + row["host_exposed_ms"] == \
        pytest.approx(row["step_ms"])


def test_the_report_sets_calibrated_beside_in_situ_all_reduce_and_takes_the_additive_term_apart(tmp_path):
    from hostsweep.report.document import to_markdown
    from hostsweep.report.fit_report import build
    from tests.unit.test_fit_report import context

    cells = with_insitu(measure(BOTH, clean_step_s(BOTH, TRUE_G, TRUE.allreduce, host_truth_s("invariant", BOTH,
                                                                                              TRUE.host)), 0.015, 0),
                        TRUE, 0)
    cells = cells.assign(mode="eager", run_id=[f"run{i:02d}" for i in range(len(cells))], parent_run_id="p0",
                         cell_key=[f"k{i}" for i in range(len(cells))], host_ms=5.8, host_frac=0.3,
                         device_ms=cells["step_ms"] - 5.8)
    slow = AllReduceFit(TRUE.allreduce["h100"].latency_s * 30, TRUE.allreduce["h100"].bandwidth_Bps)
    fit = fit_study(cells, CalibrationTerms({"h100": slow, "h200": slow}, TRUE.host),
                    FitOptions("h100", resamples=300)).to_dict()
    doc, groups = build(context(), cells, fit, tmp_path)
    markdown = to_markdown(doc, tmp_path)
    assert ALLREDUCE_MISMATCH not in set(groups["verdict"])  # judged with the in-situ all-reduce instead
    assert "judged with **T_ar in situ**" in markdown and "| insitu" in markdown.replace("|insitu", "| insitu")
    terms, verdict = markdown.index("The bound's terms against the engine"), markdown.index("## Verdict")
    assert verdict < terms < markdown.index("Falsification: cells below")  # read before any falsification
    assert "calibrated_T_ar_ms" in markdown and "insitu_ms" in markdown and "standalone" in markdown
    assert "Decomposition of the additive term" in markdown and "unattributed_ms" in markdown


def test_a_fit_json_logged_before_the_report_parts_gets_the_same_parts_from_the_compare_stage():
    # compare.fit_run reads a logged fit.json: one from before the fit carried the term paths
    # and the decomposition gets them added, equal to what the fit now writes
    import copy

    from hostsweep.stages.compare import with_report_parts

    cells = with_insitu(measure(BOTH, clean_step_s(BOTH, TRUE_G, TRUE.allreduce, host_truth_s("invariant", BOTH,
                                                                                              TRUE.host)), 0.015, 0),
                        TRUE, 0)
    cells = cells.assign(host_ms=5.8, device_ms=cells["step_ms"] - 5.8)
    fit = fit_study(cells, TRUE, FitOptions("h100", resamples=100)).to_dict()
    assert fit["decomposition"] and any("term_paths" in g for g in fit["groups"])
    old = copy.deepcopy(fit)
    del old["decomposition"]
    for g in old["groups"]:
        g.pop("term_paths", None)
    upgraded = with_report_parts(old)
    assert [g.get("term_paths") for g in upgraded["groups"]] == [g.get("term_paths") for g in fit["groups"]]
    pd.testing.assert_frame_equal(pd.DataFrame(upgraded["decomposition"]), pd.DataFrame(fit["decomposition"]),
                                  check_dtype=False)
