"""What a sweep leaves for people, on the fake backend and a real sqlite MLflow store: the
console's last lines, summary.json (which round-trips to the printed table), figures, the
parent run's description, cell runs that agree with the run directory cell for cell, a
failed cell's one line with its worker log, and studies logged by earlier versions still
resuming."""
from __future__ import annotations

import contextlib
import io
import json
import logging

import mlflow
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from hostsweep.config.grid import build_cells
from hostsweep.record.claims import PARENT_TAG
from hostsweep.report.summary import rows_from_summary
from hostsweep.report.tables import format_table
from hostsweep.run.worklog import worker_log_path
from hostsweep.stages import sweep
from tests.conftest import compose_raw, compose_typed
from tests.fakes import FakeBackend

FAST = ["+sku=cpu", "engine.name=fake", "measure.T=5", "measure.reps=4", "measure.warmups=1", "ctx=[16,32]",
        "batch=[1,2]", "ray.exclusive=false", "tracking.heartbeat_s=0.5"]


def study_in(folder, name: str, new_store) -> tuple[list[str], str]:
    """The sweep's overrides with an empty store in `folder`, and the store's URI."""
    store = new_store(folder / "mlflow.db")
    return [*FAST, f"tracking.uri={store}", f"study={name}"], store


@pytest.fixture
def study(request, tmp_path, monkeypatch, new_store):
    monkeypatch.chdir(tmp_path)
    return study_in(tmp_path, request.node.name[:50], new_store)


def runs_of(store: str, study_args: list[str]) -> pd.DataFrame:
    name = [a for a in study_args if a.startswith("study=")][0].split("=", 1)[1]
    mlflow.set_tracking_uri(store)
    try:
        return mlflow.search_runs(experiment_names=[f"hostsweep-{name}"])
    finally:
        mlflow.set_tracking_uri(None)


@pytest.fixture(scope="module")
def swept(tmp_path_factory, new_store):
    """One sweep whose outputs (console, run directory, store) the tests below read."""
    root = tmp_path_factory.mktemp("swept")
    args, store = study_in(root, "outputs", new_store)
    run_dir, out = root / "run", io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out):
        patch.chdir(root)
        code = sweep.run(compose_raw(args), run_dir, FakeBackend(root / "work"))
    return {"code": code, "out": out.getvalue(), "run_dir": run_dir, "args": args, "store": store}


def test_the_console_ends_with_the_table_below_where_the_results_are_then_the_stability_and_design_lines(swept):
    assert swept["code"] == 0
    lines = swept["out"].rstrip().splitlines()
    table = format_table(pd.read_csv(swept["run_dir"] / "cells.csv").to_dict("records")).splitlines()
    assert lines[-len(table) - 2:-2] == table and table[0].split()[-1] == "stable"
    assert lines[-2].startswith("stability: ") and "4 measured cells" in lines[-2]
    assert lines[-1].startswith("design: ") and "of 4 cells" in lines[-1] and "speed canary" in lines[-1]
    # it names what is there (a fake backend writes no worker logs; hostsweep.log is Hydra's, always)
    assert lines[0] == f"results: {swept['run_dir']}  (cells.csv, summary.json, figures/, hostsweep.log)"
    assert any("then browse http://127.0.0.1:5000/#/experiments/" in line and
               line.endswith("/runs?workflowType=machine_learning") for line in lines)
    ui = next(line for line in lines if line.startswith("open the UI: "))
    assert f"--backend-store-uri sqlite:///{swept['run_dir'].parent}/mlflow.db" in ui  # absolute: works anywhere


def test_summary_json_round_trips_to_the_printed_table(swept):
    summary = json.loads((swept["run_dir"] / "summary.json").read_text())
    assert format_table(rows_from_summary(summary)) in swept["out"]
    cell = summary["cells"][0]
    assert set(cell["step_ms"]) == {"median", "ci_low", "ci_high", "p10", "p25", "p75", "p90", "mde_pct"}
    assert cell["step_ms"]["p10"] <= cell["step_ms"]["median"] <= cell["step_ms"]["p90"]
    assert cell["split"]["regime"] in ("host-bound", "device-bound", "undetermined") and cell["params"]["batch"] == 1
    assert cell["mlflow_url"].endswith(f"/runs/{cell['mlflow_run_id']}?workflowType=machine_learning")
    assert summary["git_sha"] and summary["versions"]["hostsweep"] and summary["versions"]["vllm"] == "fake"
    assert summary["status"] == "FINISHED" and len(summary["cells"]) == 4
    # the fake engine's host phases (engines/fake.py): every share named, the sample phase 0.1 cycle
    assert cell["phases"]["phase_sample_ms"] > 0 and 0 < cell["phases"]["attributed_frac"]


def test_the_machine_the_dtype_and_why_are_said_above_the_table_in_summary_json_and_on_every_figure(swept):
    from hostsweep.config.machine import cpu_model_name
    from hostsweep.report.sweep_outputs import sweep_figures

    summary = json.loads((swept["run_dir"] / "summary.json").read_text())
    machine = summary["machine"]
    study = compose_typed(swept["args"])
    dtype = study.config.engine.dtype
    assert machine["dtype_why"] == study.dtype_why and machine["dtype_why"].startswith(f"{dtype}: ")
    assert machine["devices"] == [cpu_model_name()] and machine["vllm"] == ["fake"] and machine["dtypes"] == [dtype]
    assert machine["line"] == f"{cpu_model_name()}, vLLM fake; engine dtype {study.dtype_why}"
    lines = swept["out"].splitlines()
    assert f"machine: {machine['line']}" in lines and lines[lines.index(f"machine: {machine['line']}") + 1].startswith("sku ")
    figs = sweep_figures(study, pd.read_csv(swept["run_dir"] / "cells.csv"))
    subtitles = [f._suptitle.get_text() for f in figs.values()]
    import matplotlib.pyplot as plt

    for fig in figs.values():
        plt.close(fig)
    assert len(subtitles) == 4 and all(text.endswith(machine["line"]) for text in subtitles)


def test_the_run_directory_and_mlflow_agree_cell_for_cell(swept):
    table = pd.read_csv(swept["run_dir"] / "cells.csv")
    runs = runs_of(swept["store"], swept["args"])
    cells = runs[runs["tags.cell_key"].notna()].set_index("run_id")
    assert sorted(table["mlflow_run_id"]) == sorted(cells.index)  # the runs the cells were logged into
    for row in table.to_dict("records"):
        run = cells.loc[row["mlflow_run_id"]]
        assert run["tags.cell_key"] == row["cell_key"] and run["status"] == row["status"]
        for metric in ("step_ms", "step_ci_low_ms", "step_ci_high_ms", "step_p90_ms", "device_ms", "host_frac",
                       "phase_sample_ms", "attributed_frac"):
            assert run[f"metrics.{metric}"] == row[metric], metric
        assert run["tags.mlflow.runName"] == f"b{row['batch']}-ctx{row['ctx']}"  # the parent names the rest
        duration = (run["end_time"] - run["start_time"]).total_seconds()
        assert duration == pytest.approx(row["cell_duration_s"], abs=0.01)  # the measurement's, not the logging's
    assert {c for c in table.columns if c in ("host", "device")} == set()
    assert {"hostname", "device_name", "git_sha", "vllm_version", "hostsweep_version"} <= set(table.columns)


def test_the_parent_run_describes_the_sweep_and_carries_its_figures(swept):
    runs = runs_of(swept["store"], swept["args"])
    parent = runs[runs["tags.cell_key"].isna()].iloc[0]
    note = parent["tags.mlflow.note.content"]
    assert note.startswith("**cpu/tiny-llama/eager/tp1**, 4 cells (4 FINISHED)") and parent["tags.mlflow.runName"].endswith(": cpu/tiny-llama/eager/tp1")
    assert "| batch | ctx | step_ms |" in note  # what all cells share is said once, above
    table = pd.read_csv(swept["run_dir"] / "cells.csv")
    for row in table.to_dict("records"):
        assert f"/runs/{row['mlflow_run_id']}?workflowType=machine_learning)" in note
        assert f"| {row['step_ms']:.3f} |" in note
    client = MlflowClient(swept["store"])
    figures = {a.path for a in client.list_artifacts(parent["run_id"], "figures")}
    assert figures == {"figures/split_composition.png", "figures/host_fraction_by_batch.png", "figures/step_times.png",
                       "figures/host_phases.png"}  # the fake engine writes phase scopes
    assert {"cells.csv", "summary.json"} <= {a.path for a in client.list_artifacts(parent["run_id"])}
    assert sorted(p.name for p in (swept["run_dir"] / "figures").iterdir()) == sorted(f.split("/")[1] for f in figures)
    experiment = client.get_experiment(parent["experiment_id"])
    assert "workflowType=machine_learning" in experiment.tags["mlflow.note.content"]


def test_a_long_description_is_cut_under_mlflows_limit_with_a_pointer_to_cells_csv(study, tmp_path, capsys):
    args, store = study
    many = [*args, "batch=[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16]", "ctx=[16,24,32,40,48]", "measure.reps=2",
            "split.enabled=false"]
    assert sweep.run(compose_raw(many), tmp_path / "run", FakeBackend(tmp_path / "work", cell_s=0.1)) == 0
    runs = runs_of(store, many)
    note = runs[runs["tags.cell_key"].isna()].iloc[0]["tags.mlflow.note.content"]
    assert len(note) <= 8000 and note.count("](#/experiments/") < 80
    assert "of 80 cells shown: every cell is in `cells.csv`" in note


def test_a_failed_cell_is_one_console_line_with_its_reason_and_worker_log(study, tmp_path, caplog):
    args, store = study
    grid = build_cells(compose_typed(args))
    log_file = worker_log_path(tmp_path / "run" / "workers", grid[0].engine.label)
    log_file.parent.mkdir(parents=True)
    log_file.write_text("INFO starting\nTraceback (most recent call last):\nRuntimeError: the engine said no\n")
    backend = FakeBackend(tmp_path / "work", fates={grid[0].key: ["worker-dies", "worker-dies"]})
    with caplog.at_level(logging.INFO):
        assert sweep.run(compose_raw(args), tmp_path / "run", backend) == 1
    failed = [r for r in caplog.records if "FAILED" in r.getMessage()]
    assert len(failed) == 1 and failed[0].levelno == logging.WARNING
    line = failed[0].getMessage()
    assert "\n" not in line and "actor died" in line and f"(worker log: {log_file})" in line
    runs = runs_of(store, args)
    run_id = runs[runs["tags.cell_key"] == grid[0].key].iloc[0]["run_id"]
    tail = MlflowClient(store).download_artifacts(run_id, "worker_log_tail.txt", str(tmp_path))
    assert "the engine said no" in open(tail).read()


def test_a_study_logged_before_these_outputs_still_resumes(study, tmp_path):
    """Runs as the previous hostsweep logged them: names sku/model/mode/tp/b/ctx, unrounded
    metrics, no percentiles, an experiment without a description."""
    args, store = study
    grid = build_cells(compose_typed(args))
    client = MlflowClient(store)
    name = [a for a in args if a.startswith("study=")][0].split("=", 1)[1]
    experiment = client.create_experiment(f"hostsweep-{name}")
    parent = client.create_run(experiment, run_name=f"{name}: cpu/tiny-llama/eager @ 2026-11-29/18-39-17").info.run_id
    for cell in grid[:3]:
        run = client.create_run(experiment, run_name=f"cpu/tiny-llama/eager/tp1/b{cell.batch}/ctx{cell.ctx}",
                                tags={PARENT_TAG: parent, "cell_key": cell.key, "hostname": "oldhost",
                                      "device_name": "old cpu", "regime": "host-bound", "git_sha": "0ld"})
        for param, value in cell.params().items():
            client.log_param(run.info.run_id, param, str(value))
        for metric, value in {"step_ms": 3.1234567, "step_ci_low_ms": 2.9, "step_ci_high_ms": 3.3,
                              "device_ms": 1.0000004, "host_ms": 2.1234563, "host_frac": 0.6798}.items():
            client.log_metric(run.info.run_id, metric, value)
        client.set_terminated(run.info.run_id, "FINISHED")
    client.set_terminated(parent, "FINISHED")
    backend = FakeBackend(tmp_path / "work")
    assert sweep.run(compose_raw(args), tmp_path / "run", backend) == 0
    assert backend.measured == [grid[3].key]  # the three old cells are resumed, not measured again
    table = pd.read_csv(tmp_path / "run" / "cells.csv")
    old = table[table["resumed"]]
    assert len(old) == 3 and set(old["hostname"]) == {"oldhost"} and set(old["step_ms"]) == {3.123}
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert [c["resumed"] for c in summary["cells"]] == [True, True, True, False]
    assert summary["cells"][0]["step_ms"]["p90"] is None  # not measured then: null, not invented


def test_a_rerun_with_resume_false_measures_everything_again_and_its_opening_thread_ends_cleanly(
        study, tmp_path, monkeypatch):
    import threading

    args, _ = study
    assert sweep.run(compose_raw(args), tmp_path / "first", FakeBackend(tmp_path / "w1")) == 0
    failures = []
    monkeypatch.setattr(threading, "excepthook", failures.append)
    again = FakeBackend(tmp_path / "w2")
    assert sweep.run(compose_raw([*args, "resume=false"]), tmp_path / "again", again) == 0
    assert len(again.measured) == 4 and not failures
    resumed = FakeBackend(tmp_path / "w3")
    assert sweep.run(compose_raw(args), tmp_path / "resumed", resumed) == 0
    assert resumed.measured == [] and not failures
    table = pd.read_csv(tmp_path / "resumed" / "cells.csv")
    assert len(table) == 4 and table["resumed"].all()
