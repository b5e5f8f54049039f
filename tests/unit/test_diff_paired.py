"""Paired A/B diffs (a study measured with pair.against: both sides in one sweep, their
engine starts alternated A B, B A, A B, ...) against simulated truth: a machine whose speed
drifts by 20 % from one start pair to the next, shared by the two starts of a pair. The
paired CI (the mean of the start pairs' log-ratios, a t on k - 1 df) keeps the gate's
false-alarm rate at alpha and covers the true ratio, where the same machine measured as two
studies apart either raises false alarms (one start each, no floor) or sees nothing (k
starts each); every row says its design; the between-start noise floor a paired diff states
is the one simulated; and stage=diff reads a paired study alone, refusing a missing head on
an unpaired one in one line."""
from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pytest

from hostsweep.config.schema import ConfigError, DiffConfig
from hostsweep.compare import stats as S
from hostsweep.compare import (
    CELL_DIMS, GATED, PAIRED, PAIRED_HOST, RAW, DiffOptions, diff, floor_text, geometric_mean,
)
from hostsweep.report.diff_report import DiffContext, SideInfo, diff_document, console, to_json
from hostsweep.report.document import to_markdown

CELLS, K, PAIRS = 16, 3, 12  # a study: 16 cells, pair.starts=3, 12 timed pairs a start
WITHIN, START, DRIFT = 0.015, 0.005, 0.20  # log SDs: a pair, an engine start, the machine per start pair
STUDIES, ALPHA = 400, 0.05
SLACK = 3 * math.sqrt(ALPHA * (1 - ALPHA) / STUDIES)  # three standard errors of a rate at alpha
PLANTED = 1.15


def paired_sweeps(rng: np.random.Generator, studies: int, ratio: float = 1.0, k: int = K, drift: float = DRIFT,
                  start: float = START, within: float = WITHIN, cells: int = CELLS) -> tuple[np.ndarray, np.ndarray]:
    """Side a and side b of `studies` paired sweeps, shaped (studies, cells, k starts, n pairs):
    per start pair a machine speed factor (log-normal, SD `drift`) that both sides' starts of
    the pair share, each start its own engine-start noise, log-normal noise within a start, one
    pair in each start 40 % slow; side b `ratio` times slower."""
    machine = rng.normal(0, drift, (studies, cells, k, 1))

    def side(scale: float) -> np.ndarray:
        x = np.exp(machine + rng.normal(0, start, (studies, cells, k, 1))
                   + rng.normal(0, within, (studies, cells, k, PAIRS)))
        x[..., 0] *= 1.4
        return 2.0 * x * scale
    return side(1.0), side(ratio)


def any_slower(verdicts: np.ndarray) -> float:
    return float((verdicts == "slower").any(axis=1).mean())


def test_a_paired_aa_keeps_the_gates_false_alarm_rate_under_a_20_percent_drift_between_start_pairs():
    base, head = paired_sweeps(np.random.default_rng(11), STUDIES)
    for threshold in (5.0, 0.1):  # 0.1 %: the test alone decides, the threshold does not hide a bad CI
        paired = S.judge_arrays(base, head, threshold, ALPHA, paired=True)
        assert any_slower(paired) <= ALPHA + SLACK, threshold
    assert any_slower(S.judge_arrays(base, head, 5.0, ALPHA, paired=True)) == 0.0


def test_the_same_machine_measured_as_two_studies_apart_raises_false_alarms_or_sees_nothing():
    """Sides measured apart meet different machine speeds: one start a side with no noise
    floor fails the gate in nearly every A/A study; k starts a side keep alpha but are blind to
    +15 %, which the paired design finds (next test)."""
    rng = np.random.default_rng(12)
    (base, _), (_, head) = paired_sweeps(rng, STUDIES), paired_sweeps(rng, STUDIES)  # two sweeps, apart
    one_start = S.judge_arrays(base[:, :, :1], head[:, :, :1], 5.0, ALPHA, between_var=0.0)  # as if no spread
    assert any_slower(one_start) > 0.9
    assert (S.judge_arrays(base[:, :, :1], head[:, :, :1], 5.0, ALPHA) == "inconclusive").all()  # so: no verdict
    assert any_slower(S.judge_arrays(base, head, 5.0, ALPHA)) <= ALPHA + SLACK
    (base, _), (_, head) = paired_sweeps(rng, STUDIES), paired_sweeps(rng, STUDIES, PLANTED)
    assert (S.judge_arrays(base, head, 5.0, ALPHA) == "slower").mean() < 0.1


def test_a_paired_sweep_finds_a_planted_15_percent_in_every_cell_and_its_ci_covers_the_truth():
    base, head = paired_sweeps(np.random.default_rng(13), STUDIES, PLANTED)
    verdicts = S.judge_arrays(base, head, 5.0, ALPHA, paired=True)
    assert (verdicts == "slower").all(axis=1).mean() >= 0.9  # every cell slower, in most studies
    d, se, df = S.paired_log_ratio(np.median(base, axis=-1), np.median(head, axis=-1))
    low, high = S.ci(d, se, df, 0.95)
    assert ((low <= PLANTED) & (PLANTED <= high)).mean() >= 0.93
    # the sides treated as unpaired (each over its own starts) see the drift and find nothing
    assert (S.judge_arrays(base, head, 5.0, ALPHA) == "slower").mean() < 0.1


# ---------------------------------------------------------------------------------------
# The same through compare/cellwise.py: the frames stage=diff reads back from a paired sweep.

def frames(base: np.ndarray, head: np.ndarray, parent: str = "p" * 32, sides: tuple[str, str] = ("a", "b"),
           device: float = 0.8) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, list[np.ndarray]]]:
    """One simulated study's two sides as cell rows (params, metrics, run ids) with their raw
    pairs grouped by engine start: base and head shaped (cells, k, n)."""
    rows: dict[str, list[dict]] = {"a": [], "b": []}
    raw: dict[str, list[np.ndarray]] = {}
    for name, side, pairs in (("a", sides[0], base), ("b", sides[1], head)):
        for cell, starts in enumerate(pairs):
            run_id = f"{name}-{cell}"
            raw[run_id] = list(starts)
            step = float(np.mean([np.median(s) for s in starts]))
            rows[name].append({"sku": "cpu", "model": "tiny-llama", "mode": "eager", "tp": "1", "batch": str(cell),
                               "ctx": "128", "T": "33", "replicates": str(starts.shape[0]), "side": side,
                               "pair_against": "debug.delay_ms=0.6", "step_ms": step, "device_ms": device,
                               "host_ms": step - device, "parent_run_id": parent, "run_id": run_id})
    return pd.DataFrame(rows["a"]), pd.DataFrame(rows["b"]), raw


def test_report_diff_judges_paired_cells_as_the_vectorized_statistics_do():
    base, head = paired_sweeps(np.random.default_rng(14), 4, 1.08)
    for b, h in zip(base, head):
        result = diff(*frames(b, h), DiffOptions(fail_on="slower"))
        steps = result.cells[result.cells["quantity"] == GATED].sort_values("batch", key=lambda s: s.astype(int))
        d, se, df = S.paired_log_ratio(np.median(b, axis=-1), np.median(h, axis=-1))
        assert steps["d"].to_numpy() == pytest.approx(d) and steps["se"].to_numpy() == pytest.approx(se)
        assert (steps["df"] == K - 1).all() and set(steps["ci_source"]) == {PAIRED}
        assert list(steps["verdict"]) == list(S.judge_arrays(b[None], h[None], 5.0, ALPHA, paired=True)[0])
        assert set(steps["between"]) == {f"paired: {K} start pairs"} and result.refusal() is None


def test_host_ms_of_a_paired_cell_holds_each_sides_device_fixed():
    base, head = paired_sweeps(np.random.default_rng(15), 1, 1.2)
    result = diff(*frames(base[0], head[0]), DiffOptions())
    host = result.cells[result.cells["quantity"] == "host_ms"].sort_values("batch", key=lambda s: s.astype(int))
    mb, mh = np.median(base[0], axis=-1) - 0.8, np.median(head[0], axis=-1) - 0.8
    assert host["d"].to_numpy() == pytest.approx(S.paired_log_ratio(mb, mh)[0])
    assert set(host["ci_source"]) == {PAIRED_HOST} and set(host["design"]) == {"paired"}
    device = result.cells[result.cells["quantity"] == "device_ms"]
    assert device["verdict"].isna().all() and set(device["design"]) == {"paired"}


def test_a_paired_step_flagged_unstable_on_a_side_is_judged_on_its_paired_ci_and_counts_in_the_floor():
    base, head = paired_sweeps(np.random.default_rng(17), 1)
    b, h, raw = frames(base[0], head[0])
    flagged = {"stable": "false", "unstable_reasons": "machine_speed,drift"}
    result = diff(b.assign(**flagged), h.assign(**flagged), raw, DiffOptions(fail_on="slower"))
    steps = result._gated()
    assert not steps["unstable"].any() and set(steps["unstable_reasons"]) == {"drift,machine_speed"}
    assert steps["verdict"].notna().all() and result.summary[GATED]["cells_in_geomean"] == CELLS
    assert result.noise_floor_pct == diff(b, h, raw, DiffOptions()).noise_floor_pct  # flagged cells count too
    sequential = diff(b.assign(**flagged), h.assign(**flagged).drop(columns="side"), raw, DiffOptions())
    assert sequential._gated()["unstable"].all()  # unpaired, the flag still stands


def test_only_side_a_against_side_b_of_one_sweep_in_equal_starts_is_paired():
    base, head = paired_sweeps(np.random.default_rng(16), 1)
    b, h, raw = frames(base[0], head[0])
    assert set(diff(b, h, raw, DiffOptions())._gated()["design"]) == {"paired"}
    other_sweep = h.assign(parent_run_id="q" * 32)
    swapped = diff(h, b, raw, DiffOptions())  # side b as the base: sequential
    unpaired = diff(b.drop(columns="side"), h.drop(columns="side"), raw, DiffOptions())
    fewer = dict(raw, **{f"b-{c}": raw[f"b-{c}"][:2] for c in range(CELLS)})
    one = {run: [np.concatenate(starts)] for run, starts in raw.items()}
    for result in (diff(b, other_sweep, raw, DiffOptions()), swapped, unpaired,
                   diff(b, h, fewer, DiffOptions()), diff(b, h, one, DiffOptions(noise_floor_pct=1))):
        steps = result._gated()
        assert set(steps["design"]) == {"sequential"} and set(steps["ci_source"]) == {RAW}
        assert result.noise_floor_pct is None and result.design.startswith("sequential: two studies measured apart")


def test_every_row_and_the_result_say_the_design(tmp_path: Path):
    base, head = paired_sweeps(np.random.default_rng(17), 1, 1.3)
    b, h, raw = frames(base[0], head[0])
    paired = diff(b, h, raw, DiffOptions(fail_on="slower"))
    assert set(paired.cells["design"]) == {"paired"}
    assert paired.design == f"paired: {K} start pairs per cell, sides alternated ABBA in one sweep"
    one = {run: [np.concatenate(starts)] for run, starts in raw.items()}
    sequential = diff(b, h, one, DiffOptions(noise_floor_pct=2))
    assert sequential.design == ("sequential: two studies measured apart; one-start sides widened by noise floor "
                                 "diff.noise_floor_pct=2")
    several = diff(b.drop(columns="side"), h.drop(columns="side"), raw, DiffOptions())
    assert several.design == f"sequential: two studies measured apart; each side's CI from its own {K} engine starts"
    mixed_raw = dict(raw, **{f"b-{c}": one[f"b-{c}"] for c in range(4)})
    mixed = diff(b, h, mixed_raw, DiffOptions(noise_floor_pct=2))
    assert mixed.design.startswith(f"mixed: {CELLS - 4} cell(s) paired ({K} start pairs")
    assert ", 4 sequential (two studies measured apart; one-start sides widened by noise floor" in mixed.design
    assert sorted(mixed._gated()["design"]) == ["paired"] * (CELLS - 4) + ["sequential"] * 4

    out = console(paired)
    assert f"design: {paired.design}" in out.splitlines()
    assert paired.noise_floor_line() in out.splitlines() and paired.gate()[0]
    def info(side: str) -> SideInfo:
        return SideInfo("ab", f"ab:{side}", "study", "hostsweep-ab", "1", ("p" * 32,), CELLS, 0, side)
    ctx = DiffContext(info("a"), info("b"), "sqlite:///x.db", "r" * 32, "hostsweep-ab", "now", "python -m hostsweep")
    md = to_markdown(diff_document(paired, ctx, tmp_path), tmp_path)
    assert f"Design: {paired.design}." in md and "between-start spread on this machine" in md
    data = json.loads(json.dumps(to_json(paired, ctx)))
    assert data["design"] == paired.design and data["noise_floor_pct"] == pytest.approx(paired.noise_floor_pct)
    assert {c["design"] for c in data["cells"]} == {"paired"} and "between-start" not in console(sequential)


def test_the_noise_floor_of_a_paired_aa_is_the_simulated_between_start_spread():
    """Each side's start medians spread by the machine's drift between start pairs and each
    start's own noise: sqrt(2² + 1²) = 2.24 % (the median's own noise, 0.2 % / sqrt(12), adds
    nothing to speak of). 64 cells of one engine group: their starts are the group's, so 2
    sides x (3 - 1) = 4 df, not one set per cell."""
    drift, start = 0.02, 0.01
    truth = math.expm1(math.hypot(drift, start)) * 100
    estimates = []
    for seed in range(5):
        base, head = paired_sweeps(np.random.default_rng([18, seed]), 1, drift=drift, start=start, within=0.002,
                                   cells=64)
        result = diff(*frames(base[0], head[0]), DiffOptions())
        assert result.noise_floor_df == 2 * (K - 1)
        estimates.append(result.noise_floor_pct)
    assert all(abs(e / truth - 1) < 0.2 for e in estimates), (truth, estimates)
    line = result.noise_floor_line()
    assert line == (f"between-start spread on this machine: {floor_text(result.noise_floor_pct)} % (SD, 4 df): a "
                    f"sequential diff of two studies measured apart can pass diff.noise_floor_pct="
                    f"{floor_text(result.noise_floor_pct)} (a lower bound: studies measured further apart drift more)")


def test_the_floor_a_paired_aa_states_keeps_a_sequential_gate_of_one_start_sides_at_alpha():
    """What the floor is for: two one-start studies measured apart on that machine, widened by
    the floor paired A/As measured (5 sweeps of 64 cells: the gate takes the floor as known, and
    one 10 % low lets about 8 % of 16-cell A/A gates fail; docs/diff.md), fail an A/A gate at
    most alpha of the time."""
    drift, start = 0.02, 0.01
    rng = np.random.default_rng(19)
    floors = [diff(*frames(b[0], h[0]), DiffOptions()).noise_floor_pct
              for b, h in (paired_sweeps(rng, 1, drift=drift, start=start, cells=64) for _ in range(5))]
    floor = float(np.mean(floors))
    (base, _), (_, head) = paired_sweeps(rng, STUDIES, k=1, drift=drift, start=start), \
        paired_sweeps(rng, STUDIES, k=1, drift=drift, start=start)
    assert any_slower(S.judge_arrays(base, head, 5.0, ALPHA, between_var=0.0)) > ALPHA + SLACK  # no floor: alarms
    assert any_slower(S.judge_arrays(base, head, 5.0, ALPHA, math.log1p(floor / 100) ** 2)) <= ALPHA + SLACK


@pytest.mark.parametrize("pct,typed", [(2.2361, "2.3"), (0.0434, "0.044"), (12.3, "13"), (2.0, "2.0"), (0, "0")])
def test_the_floor_is_printed_as_typed_back_rounded_up(pct, typed):
    assert floor_text(pct) == typed


# ---------------------------------------------------------------------------------------
# stage=diff on a local sqlite store.

def log_sweep(uri: str, study: str, cells: pd.DataFrame, raw: dict[str, list[np.ndarray]]) -> str:
    """One parent run and a FINISHED child per row, with its params, metrics and
    raw_timings.csv (one row per timed pair, its engine start in `replicate`)."""
    from mlflow.entities import Metric, Param

    from hostsweep.record.tracking import SweepTracker

    tracker = SweepTracker(uri, f"hostsweep-{study}")
    client = tracker.client
    parent = client.create_run(tracker.experiment_id, run_name=f"{study} sweep").info.run_id
    params = [c for c in cells if c not in ("step_ms", "device_ms", "host_ms", "parent_run_id", "run_id")]
    for row in cells.to_dict("records"):
        run = client.create_run(tracker.experiment_id, run_name=row["run_id"],
                                tags={"mlflow.parentRunId": parent, "cell_key": f"{study}/{row['run_id']}"})
        client.log_batch(run.info.run_id, params=[Param(k, str(row[k])) for k in params],
                         metrics=[Metric(k, float(row[k]), 0, 0) for k in ("step_ms", "device_ms", "host_ms")])
        table = pd.concat([pd.DataFrame({"replicate": i, "step_ms": s}) for i, s in enumerate(raw[row["run_id"]])])
        client.log_text(run.info.run_id, table.to_csv(index=False), "raw_timings.csv")
        client.set_terminated(run.info.run_id, "FINISHED")
    client.set_terminated(parent, "FINISHED")
    return parent


@pytest.fixture(scope="module")
def store(tmp_path_factory, new_store):
    root = tmp_path_factory.mktemp("paired")
    uri = new_store(root / "mlflow.db")
    base, head = paired_sweeps(np.random.default_rng(20), 1, 1.3, drift=0.1, cells=4)
    b, h, raw = frames(base[0], head[0])
    paired = log_sweep(uri, "ab", pd.concat([b, h]), raw)
    unpaired = log_sweep(uri, "plain", b.drop(columns=["side", "pair_against"]), raw)
    yield {"root": root, "uri": uri, "paired": paired, "unpaired": unpaired}
    mlflow.set_tracking_uri(None)


def stage_diff(store, *args: str) -> tuple[int, str, Path]:
    from hostsweep.stages import diff as diff_stage
    from tests.conftest import compose_raw

    run_dir = store["root"] / f"run{len(list(store['root'].glob('run*')))}"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = diff_stage.run(compose_raw([f"tracking.uri={store['uri']}", "stage=diff", *args]), run_dir)
    return code, out.getvalue(), run_dir


def test_stage_diff_refuses_a_missing_head_on_an_unpaired_study_in_one_line(store):
    for args in (["diff.base=plain"], ["diff.base=plain", "diff.head=plain"]):
        with pytest.raises(ConfigError) as refused:
            stage_diff(store, *args)
        assert "\n" not in str(refused.value)
    with pytest.raises(ConfigError, match=r"^diff\.head is required unless diff\.base names a paired study "
                                          r"\(measured with pair\.enabled=true or \+pair\.against\.KEY=V\)$"):
        stage_diff(store, "diff.base=plain")


def test_stage_diff_of_a_paired_study_alone_is_side_a_against_side_b(store):
    for given in ("ab", store["paired"]):
        code, out, run_dir = stage_diff(store, f"diff.base={given}", "diff.fail_on=slower")
        data = json.loads((run_dir / "diff" / "diff.json").read_text())
        assert code == 1 and data["design"].startswith("paired: 3 start pairs") and data["noise_floor_pct"] > 0
        assert {c["design"] for c in data["cells"]} == {"paired"} and len(data["failing"]) == 4, out
        assert data["unmatched"] == [] and "pair_against" not in {d["name"] for d in data["differs"]}
        # side is what differs and pair_against (the same on both sides) is matched on, as cell params
        assert ("pair_against" in data["matched_on"]) == ("pair_against" in CELL_DIMS)
        assert ({"name": "side", "base": ["a"], "head": ["b"]} in data["differs"]) == ("side" in CELL_DIMS)
        assert data["base"]["side"] == "a" and data["head"]["side"] == "b"
        assert "between-start spread on this machine" in out and "design: paired" in out


def test_the_sweep_diffs_itself_at_its_end_and_returns_the_gates_code(store, tmp_path):
    from hostsweep.stages.diff import GATE_FAILED, paired_diff_of_sweep

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result, code = paired_diff_of_sweep(store["uri"], "hostsweep-ab", store["paired"],
                                            DiffConfig(fail_on="slower"), tmp_path)
        _, quiet = paired_diff_of_sweep(store["uri"], "hostsweep-ab", store["paired"], DiffConfig(), tmp_path / "x")
    assert code == GATE_FAILED and quiet == 0 and result.design.startswith("paired")
    assert "diff.fail_on=slower: FAIL: 4 cell(s) slower" in out.getvalue()
    runs = mlflow.search_runs(experiment_names=["hostsweep-ab"], filter_string="tags.`hostsweep.kind` = 'diff'")
    assert runs["metrics.noise_floor_pct"].notna().all() and f"{store['paired']}:a" in set(runs["params.base"])
    with pytest.raises(ConfigError, match="is not a paired sweep"):
        paired_diff_of_sweep(store["uri"], "hostsweep-plain", store["unpaired"], DiffConfig(), tmp_path / "y")


def test_normalize_canary_takes_a_slow_spell_out_of_a_paired_cell_pair_by_pair():
    """Spells of +50 % that cover part of some starts (one side of a start pair only) widen the
    raw paired CI; dividing each pair by the canary timed beside it takes them out where they
    happened, and the planted ratio is recovered with a narrower CI; the verdicts stay raw."""
    rng = np.random.default_rng(21)
    cells, k, n, planted = 4, 3, 8, 1.10
    spell = rng.random((2, cells, k, n)) < 0.35  # which pairs met a slow spell, per side
    factor = np.where(spell, 1.5, 1.0)
    steps = 5.0 * factor * np.exp(rng.normal(0, 0.01, factor.shape))
    steps[1] *= planted
    canary = 1.7 * factor * np.exp(rng.normal(0, 0.01, factor.shape))
    b, h, raw = frames(steps[0], steps[1])
    per_canary = {f"{name}-{c}": list(steps[i, c] / canary[i, c]) for i, name in enumerate("ab") for c in range(cells)}
    result = diff(b, h, raw, DiffOptions(normalize="canary"), raw_canary=per_canary)
    rows = result._gated()
    assert (rows["design"] == "paired").all()
    assert rows["ratio_canary"].to_numpy() == pytest.approx(planted, rel=0.02)
    raw_width = np.log(rows["ci_high"] / rows["ci_low"])
    canary_width = np.log(rows["ci_high_canary"] / rows["ci_low_canary"])
    assert canary_width.max() < 0.1 and canary_width.sum() < raw_width.sum() / 3
    assert ((rows["ci_low_canary"] <= planted) & (planted <= rows["ci_high_canary"])).all()
    unnormalized = diff(b, h, raw, DiffOptions(), raw_canary=per_canary)._gated()
    assert list(unnormalized["verdict"]) == list(rows["verdict"])  # beside, never instead of, the raw verdict


def test_the_geometric_mean_of_paired_cells_covers_when_a_spell_hits_every_cell_of_one_start():
    """A slow spell during one side's start hits every cell of that start alike: the cells'
    log ratios are not independent, so the geometric mean's CI comes from the start pairs
    (the mean over cells per start pair, t on k - 1 df). Over many simulated A/A studies it
    covers 1 at about its level; treating the cells as independent covers far less."""
    rng = np.random.default_rng(22)
    studies, cells, k, n = 300, 16, 3, 8
    covered = naive = 0
    for _ in range(studies):
        spell = np.exp(rng.normal(0, 0.10, (2, 1, k, 1)))  # per side and start, shared by every cell
        steps = 5.0 * spell * np.exp(rng.normal(0, 0.02, (2, cells, k, n)))
        result = diff(*frames(steps[0], steps[1]), DiffOptions())
        s = result.summary[GATED]
        covered += s["ci_low"] <= 1.0 <= s["ci_high"]
        rows = result._gated()
        _, low, high = geometric_mean(*(rows[c].to_numpy(float) for c in ("d", "se", "df")), 0.95)
        naive += low <= 1.0 <= high
    assert covered / studies >= 0.95 - 3 * math.sqrt(0.05 * 0.95 / studies)
    assert naive / studies < 0.8
