"""stage=diff end to end on two studies swept with the fake engine into one real sqlite
store, the head with a planted slowdown of one cell (HOSTSWEEP_FAKE_SLOWDOWN) and more
reps: the diff names what differs, finds exactly the planted cell, calls the rest `same`,
logs its run with the files, and gates; naming mistakes are one-line errors (exit 2)
through the real command line, with Ray and vLLM unimportable."""
from __future__ import annotations

import contextlib
import io
import json
from functools import partial
from pathlib import Path

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from hostsweep.stages import diff as diff_stage
from hostsweep.stages import sweep
from tests.conftest import compose_raw, run_concurrently, run_hostsweep
from tests.fakes import FakeBackend

GUARD = "raise ImportError('{name} must not be imported by the diff stage')\n"
GRID = ["+sku=cpu", "engine.name=fake", "engine.dtype=float32", "measure.T=17", "measure.warmups=1",
        "ctx=[16,32]", "batch=[1,2]", "ray.exclusive=false",
        "tracking.heartbeat_s=0.5"]
PLANTED = "b2-ctx32"
DIFF = ["stage=diff", "diff.base=diffbase", "diff.head=diffhead", "diff.threshold_pct=15", "diff.noise_floor_pct=2"]


def swept(root, uri: str, study: str, reps: int) -> str:
    """One in-process sweep of the grid; its parent run id."""
    with contextlib.redirect_stdout(io.StringIO()):
        code = sweep.run(compose_raw([*GRID, f"tracking.uri={uri}", f"study={study}", f"measure.reps={reps}"]),
                         root / study, FakeBackend(root / f"work-{study}"))
    assert code == 0
    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=[f"hostsweep-{study}"])
    return runs[runs["tags.cell_key"].isna()]["run_id"].iloc[0]


def pin_stability(uri: str, study: str, unstable: tuple[str, ...] = ()) -> None:
    """The sweep judges stability from this machine's load, and tags the checkout's commit,
    which may move between the two sweeps of a shared checkout: the test pins both."""
    client = MlflowClient(uri)
    runs = mlflow.search_runs(experiment_names=[f"hostsweep-{study}"], filter_string="tags.cell_key != ''")
    for run_id, name in zip(runs["run_id"], runs["tags.mlflow.runName"]):
        client.set_tag(run_id, "stable", "false" if name in unstable else "true")
        client.set_tag(run_id, "unstable_reasons", "drift" if name in unstable else "")
        client.set_tag(run_id, "git_sha", "0" * 40)


@pytest.fixture(scope="module")
def store(tmp_path_factory, new_store):
    root = tmp_path_factory.mktemp("diff")
    for name in ("ray", "vllm"):
        (root / "poison" / name).mkdir(parents=True)
        (root / "poison" / name / "__init__.py").write_text(GUARD.format(name=name))
    uri = new_store(root / "mlflow.db")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        patch.setenv("HOSTSWEEP_FAKE_TIME_SCALE", "4")  # steps of ~2 ms: sleep jitter stays small beside them
        base = swept(root, uri, "diffbase", 8)
        patch.setenv("HOSTSWEEP_FAKE_SLOWDOWN", f"{PLANTED}=1.6")
        head = swept(root, uri, "diffhead", 10)
    for study in ("diffbase", "diffhead"):
        pin_stability(uri, study)
    cells = mlflow.search_runs(experiment_names=["hostsweep-diffbase"], filter_string="tags.cell_key != ''")
    yield {"root": root, "uri": uri, "base": base, "head": head, "cell_run": cells["run_id"].iloc[0]}
    mlflow.set_tracking_uri(None)


def diff_in_process(store, *args: str, run_dir=None) -> tuple[int, str, object]:
    run_dir = run_dir or store["root"] / f"diff{len(list(store['root'].glob('diff*')))}"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = diff_stage.run(compose_raw([f"tracking.uri={store['uri']}", *args]), run_dir)
    return code, out.getvalue(), run_dir


@pytest.fixture(scope="module")
def gated(store):
    code, out, run_dir = diff_in_process(store, *DIFF, "diff.fail_on=slower")
    return {"code": code, "out": out, "run_dir": run_dir, "json": json.loads((run_dir / "diff" / "diff.json").read_text())}


def test_the_planted_cell_is_slower_and_every_other_cell_same(gated):
    steps = {c["cell"]: c for c in gated["json"]["cells"] if c["quantity"] == "step_ms"}
    assert {cell: c["verdict"] for cell, c in steps.items()} == {
        "b1-ctx16": "same", "b1-ctx32": "same", "b2-ctx16": "same", PLANTED: "slower"}, gated["out"]
    assert steps[PLANTED]["ratio"] == pytest.approx(1.6, rel=0.1) and steps[PLANTED]["ci_source"] == "raw pairs"


def test_what_differs_is_stated_first_and_the_gate_fails(gated):
    data, lines = gated["json"], gated["out"].splitlines()
    assert [d["name"] for d in data["differs"]] == ["reps"] and "batch" in data["matched_on"]
    assert lines[0] == "what differs: reps: 8 → 10"
    assert gated["code"] == diff_stage.GATE_FAILED and data["failing"] == [PLANTED]
    assert f"diff.fail_on=slower: FAIL: 1 cell(s) slower (±15%): {PLANTED}; 4 cell(s) judged at family-wise alpha " \
           "0.05 (Holm), rule significant: " in gated["out"]
    assert data["between"]["base"] == "noise floor diff.noise_floor_pct=2"
    assert all(c["mde_pct"] > 15 for c in data["cells"] if c["quantity"] == "step_ms")
    assert data["unmatched"] == [] and data["base"]["raw_missing"] == 0


def test_the_diff_run_holds_the_files_params_and_counts(store, gated):
    runs = mlflow.search_runs(experiment_names=["hostsweep-diffhead"], filter_string="tags.`hostsweep.kind` = 'diff'")
    run = runs[runs["tags.mlflow.runName"] == "diff-diffbase-diffhead"].iloc[0]
    files = {f.path for f in MlflowClient(store["uri"]).list_artifacts(run["run_id"])}
    files |= {f.path for f in MlflowClient(store["uri"]).list_artifacts(run["run_id"], "figures")}
    assert {"diff.md", "diff.html", "diff.json", "diff.csv", "figures/ratios.png"} <= files
    assert run["params.differs.reps"] == "8 → 10" and run["params.base_sweeps"] == store["base"]
    assert run["metrics.slower"] == 1 and run["metrics.same"] == 3 and run["metrics.failing"] == 1
    assert run["metrics.geomean_ci_low"] <= run["metrics.geomean_ratio"] <= run["metrics.geomean_ci_high"]
    html = (gated["run_dir"] / "diff" / "diff.html").read_text()
    assert "data:image/png;base64," in html and "What differs" in html


def test_sweeps_named_by_parent_run_id_and_an_unstable_slower_cell_fails_the_gate(store):
    pin_stability(store["uri"], "diffhead", unstable=(PLANTED,))
    try:
        code, out, run_dir = diff_in_process(store, "stage=diff", f"diff.base={store['base']}",
                                             f"diff.head={store['head']}", "diff.threshold_pct=15",
                                             "diff.fail_on=slower", "diff.noise_floor_pct=2")
    finally:
        pin_stability(store["uri"], "diffhead")
    data = json.loads((run_dir / "diff" / "diff.json").read_text())
    assert code == diff_stage.GATE_FAILED and data["failing"] == [PLANTED]  # unstable does not exempt it
    assert data["base"]["kind"] == "sweep" and data["base"]["label"] == store["base"][:8]
    assert data["summary"]["step_ms"]["unstable_counts"]["slower"] == 1 and "1 unstable (counted apart: 1 slower" in out
    assert f"FAIL: 1 cell(s) slower (±15%): {PLANTED} (unstable: drift)" in out


def test_a_head_cell_that_failed_fails_the_gate_by_name(store):
    client = MlflowClient(store["uri"])
    runs = mlflow.search_runs(experiment_names=["hostsweep-diffhead"], filter_string="tags.cell_key != ''")
    lost = runs[runs["tags.mlflow.runName"].str.contains("b1") & runs["tags.mlflow.runName"].str.contains("ctx16")]
    run_id = lost["run_id"].iloc[0]
    client.set_terminated(run_id, "FAILED")
    try:
        code, out, _ = diff_in_process(store, *DIFF, "diff.fail_on=slower")
    finally:
        client.set_terminated(run_id, "FINISHED")
    assert code == diff_stage.GATE_FAILED
    assert f"1 base cell(s) missing from head: b1-ctx16 (head run {run_id} FAILED)" in out


def test_a_gate_without_any_between_start_estimate_refuses_with_exit_2(store, monkeypatch, capsys):
    import hostsweep.compare.cellwise as cellwise

    # as sides measured with measure.replicate_first=false and one engine start would be
    monkeypatch.setattr(cellwise, "between_component", lambda cells, options: cellwise.Between(
        float("nan"), 0.0, "none"))
    code, _, run_dir = diff_in_process(store, *DIFF[:-1], "diff.fail_on=slower")
    assert code == diff_stage.GATE_REFUSED and "measure.replicates=3" in capsys.readouterr().err
    assert (run_dir / "diff" / "diff.json").is_file()  # the report is still written
    assert diff_in_process(store, *DIFF[:-1])[0] == 0  # no gate asked: a report, whatever the design


MISTAKES = [
    (["diff.head=diffhead"], "diff.base is required: a study name or a sweep's parent run id"),
    (["diff.base=nosuch", "diff.head=diffhead"], "diff.base='nosuch' is neither a study in sqlite:///"),
    (["diff.base=diffbase", f"diff.head={'0' * 32}"], f"diff.head={'0' * 32}: no such run in"),
    (["diff.base=diffbase", "diff.head=diffbase"], "diff.base=diffbase and diff.head=diffbase are the same"),
    (["diff.base=diffbase", "diff.head=diffhead", "diff.fail_on=faster"], "diff.fail_on='faster' is not allowed"),
    (["diff.base=diffbase", "diff.head=diffhead", "tracking.uri=sqlite:///nowhere/x.db"],
     "diff: no MLflow store at sqlite:///nowhere/x.db"),
]


def cli(store, *args: str, run_dir: str):
    return run_hostsweep([f"tracking.uri={store['uri']}", "stage=diff", *args, f"hydra.run.dir={run_dir}"],
                         store["root"], 300, pythonpath=store["root"] / "poison")


@pytest.fixture(scope="module")
def command_line(store, gated):
    jobs = {tuple(args): partial(cli, store, *args, run_dir=str(store["root"] / f"cli{i}"))
            for i, (args, _) in enumerate(MISTAKES)}
    jobs[("cell",)] = partial(cli, store, "diff.base=diffbase", f"diff.head={store['cell_run']}",
                              run_dir=str(store["root"] / "cli-cell"))
    jobs[("gate",)] = partial(cli, store, *DIFF[1:], "diff.fail_on=slower", run_dir=str(store["root"] / "cli-gate"))
    return run_concurrently(jobs)


@pytest.mark.parametrize("args,needle", MISTAKES)
def test_naming_mistakes_are_one_line_errors(command_line, args, needle):
    proc = command_line[tuple(args)]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("hostsweep: error: "), proc.stderr[-2000:]
    assert needle in lines[0]


def test_a_cell_run_is_refused_with_its_sweep_named(store, command_line):
    proc = command_line[("cell",)]
    assert proc.returncode == 2 and "is a cell run" in proc.stderr and store["base"] in proc.stderr


def test_the_command_line_gate_exits_1(command_line):
    proc = command_line[("gate",)]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "diff.fail_on=slower: FAIL" in proc.stdout


def test_the_preset_names_both_sides_of_its_two_studies():
    from tests.conftest import compose_typed

    base = compose_typed(["+experiment=diff-cpu", "+sku=cpu"]).config
    head = compose_typed(["+experiment=diff-cpu", "+sku=cpu", "study=diff-cpu-head", "tp=2"]).config
    assert (base.study, base.tp, head.study, head.tp) == ("diff-cpu-base", [1], "diff-cpu-head", [2])
    assert (base.diff.base, base.diff.head) == ("diff-cpu-base", "diff-cpu-head")


def test_the_closing_lines_name_a_relative_store_by_its_absolute_path(store, monkeypatch):
    # last in the module: it adds a diff run the tests above would read as theirs.
    # The sweep prints its store absolute; a diff run from the store's folder must name the
    # same store the same way, so a command quoting it works from anywhere
    monkeypatch.chdir(store["root"])
    code, out, _ = diff_in_process({**store, "uri": f"sqlite:///{Path(store['uri'][len('sqlite:///'):]).name}"}, *DIFF)
    assert code == 0, out
    assert "in experiment " in out and f"of {store['uri']}\n" in out
    assert f"--backend-store-uri {store['uri']} " in out
