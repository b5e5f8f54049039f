"""The fit and compare stages through the real command line on a store written from known
cells (the TP study's [2] grid on H100 and H200, H200 TP-4 measured below H + T_ar): selection
mistakes are one-line errors (exit 2) before anything is fitted or measured, and a
compare run holds the report, its figures and the verdicts. Ray and vLLM are made
unimportable throughout: these stages never need them."""
from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Optional

import mlflow
import pytest
import yaml

from tests.conftest import run_concurrently, run_hostsweep
from tests.fake_store import write_sweep
from tests.unit.test_fit_report import study_cells

GUARD = "raise ImportError('{name} must not be imported by the fit and compare stages')\n"
STUDY = ["+experiment=tp70b", "fit.train_sku=h100", "calibration=seed002-h100", "fit.calibrate=false",
         "fit.resamples=300"]


@pytest.fixture(scope="module")
def store(tmp_path_factory, new_store) -> dict:
    root = tmp_path_factory.mktemp("stages")
    for name in ("ray", "vllm"):
        (root / "poison" / name).mkdir(parents=True)
        (root / "poison" / name / "__init__.py").write_text(GUARD.format(name=name))
    uri = new_store(root / "mlflow.db")
    cells = study_cells(seed=3)
    parent, children = write_sweep(uri, "hostsweep-tp70b", cells)
    calibration = root / "calib.yaml"  # H200's all-reduce: the TP study reports only H100's, so take the same
    calibration.write_text(yaml.safe_dump({"allreduce": {"h200": {"latency_us": 21.2, "bandwidth_gbps": 307}}}))
    return {"root": root, "uri": uri, "parent": parent, "children": children,
            "args": [*STUDY, f"tracking.uri={uri}", f"fit.calibration_file={calibration}"]}


def stage(store: dict, *args: str, timeout: float = 300, run_dir: Optional[Path] = None):
    run_dir = run_dir or store["root"] / f"run{len(list(store['root'].glob('run*')))}"
    return run_hostsweep([*store["args"], *args, f"hydra.run.dir={run_dir}"], store["root"], timeout,
                         pythonpath=store["root"] / "poison"), run_dir


MISTAKES = [
    (["stage=compare", "tracking.uri=sqlite:///nowhere/x.db"], "select: no MLflow store at sqlite:///nowhere/x.db"),
    (["stage=compare", "select.experiment=hostsweep-nope"], "select.experiment='hostsweep-nope' does not exist"),
    (["stage=fit", "select.parent_run=0123abc"], "no FINISHED cell runs in experiment 'hostsweep-tp70b' (parent run"),
    (["stage=compare", "fit.train_sku=h300"], "fit.train_sku=h300 has no cells in the selection; SKUs with cells: h100, h200"),
    (["stage=compare", "fit.train_sku=null"], "fit.train_sku is required: the selection spans SKUs h100, h200"),
    (["stage=compare", "fit.train_tp=8"], "fit.train_tp=[8] has no cells of sku h100; its TP degrees: 2, 4"),
    (["stage=fit", "fit.mode=graph"], "fit.mode=graph has no cells in the selection; modes with cells: eager"),
    (["stage=compare", 'select.filter="params.sku = \'h100\' and params.tp = \'2\'"'], "fit: nothing is held out"),
    (["stage=compare", "fit.form=c_squared"], "fit.form 'c_squared' is not a host form"),
    (["stage=compare", "fit.roofs=guess"], "fit.roofs='guess' is not allowed"),
    (["stage=compare", 'select.filter="params.sku ==== 1"'], "select.filter='params.sku ==== 1' was refused by MLflow"),
    (["stage=report"], "stage='report' is not allowed; allowed: sweep, fit, compare, all, diff, noise"),
    (["stage=compare", "calibration=seed009"], "unknown calibration 'seed009'"),
]
NO_ALL_REDUCE = ["stage=fit", "fit.calibration_file=null"]


@pytest.fixture(scope="module")
def refused(store) -> dict:
    """Every mistake's (result, run dir), run side by side before the compare run writes to the store."""
    runs = [args for args, _ in MISTAKES] + [NO_ALL_REDUCE]
    return run_concurrently({tuple(args): partial(stage, store, *args, run_dir=store["root"] / f"refused{i}")
                             for i, args in enumerate(runs)})


@pytest.mark.parametrize("args,needle", MISTAKES)
def test_selection_mistakes_are_one_line_errors_before_any_fit(refused, args, needle):
    proc, run_dir = refused[tuple(args)]
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("hostsweep: error:") and needle in lines[0], proc.stderr
    assert not (run_dir / "fit" / "fit.json").exists()


def test_a_missing_all_reduce_is_an_error_unless_the_stage_may_measure_it(refused):
    proc, _ = refused[tuple(NO_ALL_REDUCE)]
    assert proc.returncode == 2 and "sku h200 has TP>1 cells but the calibration has no all-reduce" in proc.stderr


@pytest.fixture(scope="module")
def compared(store) -> dict:
    proc, run_dir = stage(store, "stage=compare")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    mlflow.set_tracking_uri(store["uri"])
    runs = mlflow.search_runs(experiment_names=["hostsweep-tp70b"], filter_string="tags.`hostsweep.kind` = 'compare'")
    return {"proc": proc, "run_dir": run_dir, "run": runs.iloc[0], "runs": runs}


def test_compare_logs_one_named_run_with_the_report_figures_and_fit(store, compared):
    run = compared["run"]
    assert len(compared["runs"]) == 1 and run["tags.mlflow.runName"] == "compare-tp70b" and run["status"] == "FINISHED"
    client = mlflow.MlflowClient(store["uri"])
    files = {f.path for f in client.list_artifacts(run["run_id"])} | {
        f.path for f in client.list_artifacts(run["run_id"], "figures")}
    assert {"report.md", "report.html", "fit.json", "cells.csv"} <= files
    assert {f"figures/{n}.png" for n in ("step_composition", "predicted_vs_measured", "heldout_mape", "regime_map",
                                         "step_times")} <= files
    assert run["params.verdict.h100_tp4"] == "validated" and run["params.verdict.h200_tp4"] == "falsified"
    assert "falsified" in run["tags.mlflow.note.content"]


def test_compare_report_traces_every_number_to_a_run_and_prints_the_runs_table_link(store, compared):
    report = (compared["run_dir"] / "compare" / "report.md").read_text()
    for run_id in [store["parent"], compared["run"]["run_id"], compared["run"]["params.fit_run"], *store["children"]]:
        assert run_id in report
    out = compared["proc"].stdout
    assert "held-out h200 TP-4: falsified" in out and "held-out h100 TP-4: validated" in out
    assert "/runs?workflowType=machine_learning" in out and "--host 127.0.0.1" in out


def test_compare_can_report_on_a_logged_fit_without_refitting(store, compared):
    fit_run = compared["run"]["params.fit_run"]
    proc, run_dir = stage(store, "stage=compare", f"compare.fit_run={fit_run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (run_dir / "fit").exists() and fit_run in (run_dir / "compare" / "report.md").read_text()
