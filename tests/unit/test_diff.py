"""stage=diff's computation on synthetic sides with known answers: raw timed pairs drawn
around known per-cell ratios over many noise seeds, so the planted slowdowns (and
speed-ups) are found exactly and unchanged cells are called `same`; what differs is
detected from params and provenance; unstable cells are counted apart; the gate trips
on what it should and cannot be walked around. The gate's error rates over many
simulated studies are in tests/unit/test_diff_gate.py."""
from __future__ import annotations

import json
import math
import re
import zlib
from itertools import product
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from hostsweep.compare import (
    GATED, HOST_FIXED, POINT, RAW, SUMMARY, DiffOptions, dimensions, diff, match_cells, stable_flag,
)
from hostsweep.compare.options import NO_BETWEEN
from hostsweep.report.diff_report import DiffContext, SideInfo, diff_document, console, to_json
from hostsweep.report.document import to_html, to_markdown

GRID = list(product([1, 2, 4], [128, 512]))  # (batch, ctx)
PLANTED = {(2, 512): 1.25, (4, 128): 1.40, (1, 512): 0.70}  # head/base; every other cell 1.0
SEEDS = range(20)


def side(version: str, ratios: dict, seed: int, sigma: float = 0.015, reps: int = 12,
         outliers: bool = True) -> tuple[pd.DataFrame, dict[str, np.ndarray]]:
    """Cells of the grid with raw step pairs: a base step per cell times its ratio, times
    log-normal noise, with one pair in twelve 40% slow (a stray process), as measured."""
    rng = np.random.default_rng([seed, zlib.crc32(version.encode())])  # each side its own noise
    rows, raw = [], {}
    for batch, ctx in GRID:
        step = 2.0 * (1 + 0.1 * batch) * (1 + ctx / 1024) * ratios.get((batch, ctx), 1.0)
        pairs = step * np.exp(rng.normal(0, sigma, reps))
        if outliers:
            pairs[rng.integers(reps)] *= 1.4
        run_id = f"{version}-b{batch}-ctx{ctx}"
        raw[run_id] = pairs
        device = 0.4 * step
        rows.append({"sku": "cpu", "model": "tiny-llama", "mode": "eager", "tp": "1", "batch": str(batch),
                     "ctx": str(ctx), "T": "33", "dtype": "float32", "engine_args": '{"enforce_eager":true}',
                     "step_ms": float(np.median(pairs)), "device_ms": device, "host_ms": float(np.median(pairs)) - device,
                     "step_ci_low_ms": step * 0.97, "step_ci_high_ms": step * 1.03, "vllm_version": version,
                     "torch_version": "2.13.0", "git_sha": "abc", "hostname": "box", "run_id": run_id})
    return pd.DataFrame(rows), raw


FLOOR = 1.0  # the between-start spread (%) the synthetic sides are widened by, as an A/A diff would state


def run(base_ratios: dict, head_ratios: dict, seed: int, **options) -> tuple:
    base, raw_b = side("0.31.0", base_ratios, seed)
    head, raw_h = side("0.32.0", head_ratios, seed)
    return diff(base, head, {**raw_b, **raw_h}, DiffOptions(**{"noise_floor_pct": FLOOR, **options})), base, head


def verdicts(result, quantity: str = GATED) -> dict[str, str]:
    rows = result.cells[result.cells["quantity"] == quantity]
    return dict(zip(rows["cell"], rows["verdict"]))


@pytest.mark.parametrize("seed", SEEDS)
def test_planted_changes_are_found_exactly_and_the_rest_is_same(seed):
    result, _, _ = run({}, PLANTED, seed)
    expected = {f"b{b}-ctx{c}": ("slower" if PLANTED.get((b, c), 1) > 1 else "faster" if (b, c) in PLANTED
                                 else "same") for b, c in GRID}
    found = verdicts(result)  # an unchanged cell is shown the same, or at worst not shown anything
    assert {c: v for c, v in found.items() if expected[c] != "same"} == {c: v for c, v in expected.items()
                                                                         if v != "same"}
    assert {found[c] for c, v in expected.items() if v == "same"} <= {"same", "inconclusive"}
    rows = result.cells[result.cells["quantity"] == GATED].set_index("cell")
    for (b, c), ratio in PLANTED.items():  # (the CI misses it in 5% of seeds, as a 95% CI should)
        assert rows.loc[f"b{b}-ctx{c}", "ratio"] == pytest.approx(ratio, rel=0.03)
    assert set(rows["ci_source"]) == {RAW}


def test_the_ci_covers_the_true_ratio_about_as_often_as_it_says():
    inside = []
    for seed in range(60):
        result, _, _ = run({}, {(2, 128): 1.1}, seed)
        row = result.cells[(result.cells["quantity"] == GATED) & (result.cells["cell"] == "b2-ctx128")].iloc[0]
        inside.append(row["ci_low"] <= 1.1 <= row["ci_high"])
    assert np.mean(inside) >= 0.85


def test_the_geometric_mean_and_its_ci_hold_the_planted_mean():
    result, _, _ = run({}, PLANTED, 3)
    truth = math.exp(np.mean([math.log(PLANTED.get(cell, 1.0)) for cell in GRID]))
    s = result.summary[GATED]
    assert s["ci_low"] <= truth <= s["ci_high"] and abs(s["geomean_ratio"] - truth) < 0.03
    assert s["counts"] == {"faster": 1, "slower": 2, "same": 3, "inconclusive": 0}


def test_a_change_surely_smaller_than_the_threshold_is_same_by_the_equivalence_test():
    result, _, _ = run({}, {(2, 128): 1.02}, 7, noise_floor_pct=0.2)
    row = result.cells[(result.cells["quantity"] == GATED) & (result.cells["cell"] == "b2-ctx128")].iloc[0]
    assert row["verdict"] == "same" and row["p_same"] <= 0.05


def test_verdicts_do_not_depend_on_which_other_cells_are_compared_or_their_order():
    base, raw_b = side("a", {}, 9)
    head, raw_h = side("b", PLANTED, 9)
    whole = diff(base, head, {**raw_b, **raw_h}, DiffOptions(noise_floor_pct=FLOOR))
    shuffled = diff(base.iloc[::-1], head.sample(frac=1, random_state=1), {**raw_b, **raw_h},
                    DiffOptions(noise_floor_pct=FLOOR))
    assert verdicts(whole) == verdicts(shuffled)
    rows = lambda r: r.cells[r.cells["quantity"] == GATED].set_index("cell")  # noqa: E731
    assert rows(whole)["p_slower"].to_dict() == pytest.approx(rows(shuffled)["p_slower"].to_dict())


def test_what_differs_is_detected_and_left_out_of_the_matching():
    base, _ = side("0.31.0", {}, 0)
    head, _ = side("0.32.0", {}, 0)
    head["sku"], head["git_sha"] = "h200", "def"
    head.loc[head.index[:3], "hostname"] = "box2"  # the head ran on two hosts
    matched, differs, shared = dimensions(base, head)
    names = {d.name: d.text() for d in differs}
    assert names == {"sku": "cpu → h200", "vllm_version": "0.31.0 → 0.32.0", "git_sha": "abc → def",
                     "hostname": "box → {box, box2}"}
    assert "sku" not in matched and {"batch", "ctx", "mode", "engine_args"} <= set(matched)
    assert "hostname" not in matched and shared == {"torch_version": "2.13.0"}


def test_cells_one_side_lacks_are_listed_unmatched_not_dropped():
    base, raw_b = side("a", {}, 0)
    head, raw_h = side("b", {}, 0)
    head = head[head["batch"] != "4"]
    extra = head.iloc[[0]].assign(batch="16", run_id="b-b16")
    head = pd.concat([head, extra])
    result = diff(base, head, {**raw_b, **raw_h}, DiffOptions())
    assert "batch" in result.matched_on
    assert sorted(zip(result.unmatched["side"], result.unmatched["batch"])) == [
        ("base", "4"), ("base", "4"), ("head", "16")]
    assert len(verdicts(result)) == 4


def test_a_single_matched_cell_is_still_named_by_batch_and_ctx():
    base, raw_b = side("a", {}, 0)
    head, raw_h = side("b", {}, 0)
    result = diff(base.iloc[[3]], head.iloc[[3]], {**raw_b, **raw_h}, DiffOptions())
    assert set(result.cells["cell"]) == {"b2-ctx512"}


def test_a_side_measured_twice_keeps_its_newest_cell():
    base, _ = side("a", {}, 0)
    twice = pd.concat([base.assign(start_time=1), base.assign(start_time=2, run_id=base["run_id"] + "-new")])
    pairs, unmatched, warnings = match_cells(twice, base, ["batch", "ctx"])
    assert len(pairs) == 6 and unmatched.empty and all(b["run_id"].endswith("-new") for b, _ in pairs)
    assert warnings == ["base: 6 cell(s) share their matching dimensions with a newer one and are left out"]


@pytest.mark.parametrize("flag,unstable", [("false", True), ("False", True), (0.0, True), ("true", False),
                                           (None, False), (float("nan"), False)])
def test_the_stable_flag_in_any_spelling_and_its_absence(flag, unstable):
    assert (stable_flag(flag) is False) == unstable


def test_an_unstable_cell_that_measured_slower_fails_the_gate_with_its_reason():
    base, raw_b = side("a", {}, 1)
    head, raw_h = side("b", PLANTED, 1)
    is_b4 = [(int(b), int(c)) == (4, 128) for b, c in zip(head["batch"], head["ctx"])]
    head["stable"] = ["false" if x else "true" for x in is_b4]
    head["unstable_reasons"] = ["drift" if x else "" for x in is_b4]
    raw_h["b-b4-ctx128"] = raw_h["b-b4-ctx128"] * np.exp(  # noisier as well as slower
        np.random.default_rng(0).normal(0, 0.15, 12))
    result = diff(base, head, {**raw_b, **raw_h}, DiffOptions(fail_on="slower", noise_floor_pct=FLOOR))
    s = result.summary[GATED]
    assert s["unstable"] == 1 and s["counts"]["slower"] == 1
    assert sorted(result.failing()["cell"]) == ["b2-ctx512", "b4-ctx128"]
    failed, why = result.gate()
    assert failed and "b4-ctx128" in why and "drift" in why
    strict = diff(base, head, {**raw_b, **raw_h}, DiffOptions(fail_on="inconclusive", noise_floor_pct=FLOOR))
    assert "b4-ctx128" in strict.failing()["cell"].tolist()  # unstable is inconclusive there


def test_unstable_noisy_cells_of_an_aa_fail_the_gate_at_most_alpha_not_by_their_point_ratios():
    """An A/A whose every cell is unstable and noisy (pairs 12 % apart): their point ratios
    cross +5 % by chance in most studies, which failed the gate when it read them; judged on
    each cell's own one-sided test (no Holm), over 200 studies of 6 cells the gate fails in no
    more than alpha of them. A noisy unstable cell truly 40 % slower, short of Holm, still fails
    it, named with its own test."""
    point, gated = [], []
    for seed in range(200):
        base, raw_b = side("a", {}, seed, sigma=0.12, outliers=False)
        head, raw_h = side("b", {}, seed, sigma=0.12, outliers=False)
        head["stable"], head["unstable_reasons"] = "false", "ci_width"
        # no MDE bound: these cells cannot see +15 %, so the gate would refuse them (exit 2)
        result = diff(base, head, {**raw_b, **raw_h}, DiffOptions(fail_on="slower", noise_floor_pct=FLOOR,
                                                                  max_mde_factor=None))
        rows = result.cells[result.cells["quantity"] == GATED]
        point.append(bool((rows["ratio"] > 1.05).any()))
        gated.append(result.gate()[0])
    assert np.mean(point) > 0.5 and np.mean(gated) <= 0.05, (np.mean(point), np.mean(gated))
    base, raw_b = side("a", {}, 7, sigma=0.12, outliers=False)
    head, raw_h = side("b", {(4, 128): 1.40}, 7, sigma=0.12, outliers=False)
    is_b4 = [(int(b), int(c)) == (4, 128) for b, c in zip(head["batch"], head["ctx"])]
    head["stable"] = ["false" if x else "true" for x in is_b4]  # one unstable cell: its own test at alpha / 1
    head["unstable_reasons"] = ["ci_width" if x else "" for x in is_b4]
    # the default rule calls it slower under Holm; the margin rule's shifted null leaves it short
    assert diff(base, head, {**raw_b, **raw_h}, DiffOptions(fail_on="slower", noise_floor_pct=FLOOR)
                ).failing()["verdict"].tolist() == ["slower"]
    result = diff(base, head, {**raw_b, **raw_h}, DiffOptions(fail_on="slower", noise_floor_pct=FLOOR,
                                                              rule="margin"))
    failed, why = result.gate()
    assert failed and result.failing()["cell"].tolist() == ["b4-ctx128"]
    assert "b4-ctx128 (unstable: ci_width; slower on its own test, p " in why and "without Holm" in why


def test_split_impossible_alone_never_exempts_the_step():
    base, raw_b = side("a", {}, 2)
    head, raw_h = side("b", {(4, 128): 1.40}, 2)
    head["stable"], head["unstable_reasons"] = "false", "split_impossible"
    result = diff(base, head, {**raw_b, **raw_h}, DiffOptions(fail_on="slower", noise_floor_pct=FLOOR))
    steps = result.cells[result.cells["quantity"] == GATED]
    assert not steps["unstable"].any() and result.summary["host_ms"]["unstable"] == 6
    assert result.failing()["cell"].tolist() == ["b4-ctx128"] and result.gate()[0]


def test_a_head_that_lacks_base_cells_or_failed_them_fails_the_gate_listing_them():
    base, raw_b = side("a", {}, 3)
    head, raw_h = side("b", {}, 3)
    failed = head[head["batch"] == "4"][["batch", "ctx", "run_id"]].assign(run_id="f" * 32)
    head = head[(head["batch"] != "4") & ~((head["batch"] == "2") & (head["ctx"] == "512"))]
    result = diff(base, head, {**raw_b, **raw_h}, DiffOptions(fail_on="slower", noise_floor_pct=FLOOR), failed)
    assert result.failing().empty and len(result.missing()) == 3
    failed_gate, why = result.gate()
    assert failed_gate and "3 base cell(s) missing from head" in why
    assert f"b4-ctx128 (head run {'f' * 32} FAILED)" in why and "b2-ctx512 (no head cell" in why


def test_a_gate_with_no_cell_to_judge_fails():
    base, raw_b = side("a", {}, 1)
    head, raw_h = side("b", {}, 1)
    head["batch"] = "16"
    result = diff(base, head, {**raw_b, **raw_h}, DiffOptions(fail_on="slower", noise_floor_pct=FLOOR))
    assert result.gate()[0]


def test_a_gate_on_one_start_sides_with_no_between_start_estimate_refuses_saying_what_to_run():
    result, _, _ = run({}, {}, 4, fail_on="slower", noise_floor_pct=None)
    assert "measure.replicates=3" in result.refusal() and "diff.noise_floor_pct" in result.refusal()
    assert result.gate()[0]
    assert run({}, {}, 4, noise_floor_pct=None)[0].refusal() is None  # no gate asked: the diff still reports


def test_the_studys_own_re_measures_are_named_as_a_lower_bound_and_leave_the_cells_without_a_verdict():
    """Periods and re-measures of one engine start are minutes apart: they miss what a new start
    and an hour's drift change (two quiet periods put them near 0), so they widen nothing and
    vouch for no verdict; the diff names them as a lower bound."""
    base, raw_b = side("a", {}, 5)
    head, raw_h = side("b", {(1, 128): 1.5}, 5)  # a planted +50 %: still no verdict without a between-start estimate
    for frame in (base, head):  # one-cell groups (each its own replicate), and one cell timed in 3 periods
        frame["replicate_step_ms"] = frame["step_ms"] * [1.02, 0.99, 1.01, 0.98, 1.0, 1.03]
        frame["period_var"], frame["period_df"] = [0.0004] + [math.nan] * 5, [2.0] + [0.0] * 5
    result = diff(base, head, {**raw_b, **raw_h}, DiffOptions(fail_on="slower"))
    assert result.between["base"].startswith("none (within one engine start the study shows")
    assert "a lower bound, not between-study evidence" in result.between["base"]
    steps = result.cells[result.cells["quantity"] == GATED]
    assert (steps["verdict"] == "inconclusive").all() and (steps["note"] == NO_BETWEEN).all()
    assert steps["ci_low"].isna().all() and np.isinf(steps["mde_pct"]).all()
    assert steps["ratio"].max() > 1.4  # the ratio is still shown
    assert "no between-start estimate" in result.refusal()
    assert result.summary[GATED]["notes"] == {NO_BETWEEN: 6} and result.summary[GATED]["judged"] == 0


def test_a_replicate_shared_by_a_group_of_cells_is_not_taken_as_each_cells_own():
    base, raw_b = side("a", {}, 5)
    base["replicate_step_ms"] = 9.0  # the group's first cell's re-measure, carried by all six
    result = diff(base, side("b", {}, 5)[0], {**raw_b, **side("b", {}, 5)[1]}, DiffOptions(fail_on="slower"))
    assert result.between["base"] == "none" and result.refusal() is not None


def test_sides_measured_in_several_starts_are_judged_over_their_starts():
    base, raw_b = side("a", {}, 6)
    head, raw_h = side("b", {(1, 128): 1.3}, 6)
    rng = np.random.default_rng(6)
    starts = {run: [p * np.exp(rng.normal(0, 0.01)) for p in np.split(np.r_[p, p[:3]], 3)] for run, p in
              {**raw_b, **raw_h}.items()}
    for frame in (base, head):
        frame["replicates"] = "3"
    result = diff(base, head, starts, DiffOptions(fail_on="slower"))
    steps = result.cells[result.cells["quantity"] == GATED].set_index("cell")
    assert (steps["starts_base"] == 3).all() and (steps["df"] < 10).all() and result.refusal() is None
    assert steps.loc["b1-ctx128", "verdict"] == "slower" and "replicates" in result.matched_on


def test_sides_of_two_starts_are_judged_with_a_warning_that_the_interval_is_wide():
    base, raw_b = side("a", {}, 8)
    head, raw_h = side("b", {}, 8)
    starts = {run: np.split(p, 2) for run, p in {**raw_b, **raw_h}.items()}
    result = diff(base.assign(replicates="2"), head.assign(replicates="2"), starts, DiffOptions())
    assert any("2 engine starts" in w and "pair.starts) >= 3" in w for w in result.warnings)
    assert (result.cells[result.cells["quantity"] == GATED]["df"] < 3).all()


def test_a_one_start_side_is_never_matched_silently_against_a_several_start_side():
    base, raw_b = side("a", {}, 7)
    head, raw_h = side("b", {}, 7)
    head["replicates"] = "3"
    result = diff(base, head, {**raw_b, **raw_h}, DiffOptions(noise_floor_pct=FLOOR))
    assert {d.name: d.text() for d in result.differs}["replicates"] == "1 → 3"


def test_without_a_stable_flag_nothing_is_unstable():
    result, _, _ = run({}, PLANTED, 2)
    assert not result.cells["unstable"].any() and set(result.cells["stable_flag"]) == {"unknown"}


def test_the_gate_states_how_many_cells_it_judged_and_at_what_level():
    same, _, _ = run({}, {}, 4, fail_on="slower")
    slower, _, _ = run({}, PLANTED, 4, fail_on="slower")
    off, _, _ = run({}, PLANTED, 4)
    assert same.failing().empty and off.failing().empty and not off.gate()[0]
    failed, why = same.gate()
    assert not failed and why.startswith("6 cell(s) judged at family-wise alpha 0.05 (Holm), rule significant: ")
    assert "would have been found 80 % of the time" in why and why.endswith("none slower (±5%)")
    assert sorted(slower.failing()["cell"]) == ["b2-ctx512", "b4-ctx128"] and slower.gate()[0]
    assert slower.cells["mde_pct"].notna().any() and (slower.cells["mde_pct"].dropna() > 5).all()


def test_host_ms_without_a_device_ci_holds_device_fixed_and_device_ms_has_no_verdict():
    result, _, _ = run({}, PLANTED, 5)
    host = result.cells[result.cells["quantity"] == "host_ms"]
    device = result.cells[result.cells["quantity"] == "device_ms"]
    assert set(host["ci_source"]) == {HOST_FIXED} and host["ci_low"].notna().all()
    assert set(device["ci_source"]) == {POINT} and device["verdict"].isna().all() and device["ci_low"].isna().all()
    assert device.set_index("cell").loc["b4-ctx128", "ratio"] == pytest.approx(1.4)
    assert result.summary["device_ms"]["no_verdict"] == 6


def test_cells_without_raw_timings_fall_back_to_their_logged_cis_labelled():
    base, _ = side("a", {}, 0)
    head, _ = side("b", {(2, 128): 1.5}, 0)
    result = diff(base, head, {}, DiffOptions(noise_floor_pct=FLOOR))
    steps = result.cells[result.cells["quantity"] == GATED]
    assert set(steps["ci_source"]) == {SUMMARY}
    assert verdicts(result)["b2-ctx128"] == "slower"
    assert set(result.cells[result.cells["quantity"] == "host_ms"]["ci_source"]) == {POINT}


@pytest.mark.parametrize("options,needle", [
    ({"threshold_pct": 0}, "threshold_pct must be in (0, 100)"),
    ({"alpha": 0.7}, "alpha must be in (0, 0.5]"),
    ({"noise_floor_pct": -1}, "noise_floor_pct must be in [0, 100) or null"),
    ({"fail_on": "faster"}, "fail_on='faster' is not allowed; allowed: null, slower, slower_overall, inconclusive"),
    ({"quantities": ()}, "quantities must name at least one metric"),
])
def test_options_are_checked(options, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        DiffOptions(**options).check()


def test_the_document_json_and_console_say_what_differs_first(tmp_path: Path):
    result, _, _ = run({}, PLANTED, 6, fail_on="slower")
    info = lambda label: SideInfo(label, label, "study", f"hostsweep-{label}", "1", ("p" * 32,), 6, 0)  # noqa: E731
    ctx = DiffContext(info("old"), info("new"), "sqlite:///x.db", "r" * 32, "hostsweep-new", "now", "python -m hostsweep")
    doc = diff_document(result, ctx, tmp_path)
    md, page = to_markdown(doc, tmp_path), to_html(doc)
    assert md.index("## What differs") < md.index("## Verdict") and "**vllm_version**: 0.31.0 → 0.32.0" in md
    assert "**diff.fail_on=slower: FAIL: 2 cell(s) slower (±5%): b2-ctx512, b4-ctx128; 6 cell(s) judged" in md
    assert "data:image/png;base64," in page
    assert (tmp_path / "figures" / "ratios.png").stat().st_size > 1000
    data = json.loads(json.dumps(to_json(result, ctx)))
    assert data["differs"] == [{"name": "vllm_version", "base": ["0.31.0"], "head": ["0.32.0"]}]
    assert sorted(data["failing"]) == ["b2-ctx512", "b4-ctx128"] and len(data["cells"]) == 18
    out = console(result)
    assert out.splitlines()[0] == "what differs: vllm_version: 0.31.0 → 0.32.0"
    assert "2 slower" in out and "b4-ctx128" in out


def test_host_ms_carries_device_ms_own_error_by_the_delta_method():
    """host = step - device: device_ms comes from a few profiled pairs with its own t-interval,
    which the host diff's variance must hold beside the step's (a device CI of ±10 % on a
    device-heavy cell widens the host CI several-fold)."""
    result, base, head = run({}, {}, 5)
    for frame in (base, head):
        frame["device_ci_low_ms"] = frame["device_ms"].astype(float) * 0.9
        frame["device_ci_high_ms"] = frame["device_ms"].astype(float) * 1.1
        frame["split_pairs"] = 3.0
    raw = {**side("0.31.0", {}, 5)[1], **side("0.32.0", {}, 5)[1]}
    wider = diff(base, head, raw, DiffOptions(noise_floor_pct=FLOOR))
    host = lambda r: r.cells[r.cells["quantity"] == "host_ms"].set_index("cell")  # noqa: E731
    before, after = host(result), host(wider)
    assert (after["se"] > before["se"]).all()
    row, b = after.iloc[0], base.iloc[0]
    step, device = float(b["step_ms"]), float(b["device_ms"])
    device_se = 0.1 * device / stats.t.ppf(0.975, 2)
    added = 2 * device_se ** 2 / (step - device) ** 2  # both sides: same device, same error
    assert row["se"] ** 2 == pytest.approx(before.iloc[0]["se"] ** 2 + added, rel=0.05)
