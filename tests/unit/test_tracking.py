"""MLflow recording against a real sqlite store: a sweep's parent and cell runs, what a
resumed sweep reads back, and the measured-cell frame the model stage reads."""
from __future__ import annotations

import mlflow
import pandas as pd
import pytest

from hostsweep.measure.protocol import CellMeasurement, RepTiming
from hostsweep.measure.results import CellResult, cell_row
from hostsweep.measure.split import SplitResult
from hostsweep.record.claims import PARENT_TAG
from hostsweep.record.read.readback import read_cells
from hostsweep.record.tracking import SweepTracker
from hostsweep.record.views import experiment_description

PARAMS = {"sku": "cpu", "model": "tiny-llama", "mode": "eager", "tp": 1, "batch": 2, "ctx": 128,
          "T": 33, "reps": 2, "warmups": 1, "dtype": "float32", "engine": "fake", "tp_executor": "mp"}
REPS = (RepTiming(0, True, 0.010, 0.106, 0.003), RepTiming(1, False, 0.011, 0.107, 0.003))
SPLIT = SplitResult("cpu-ops", 1.25, 1.75, 0.5833, 0.01, 0.0, 0.0, 3.5, 1.1667, "host-bound", (1.25,),
                    (("aten::addmm", 1.0),))


@pytest.fixture
def tracker(tmp_path, new_store):
    tracker = SweepTracker(new_store(tmp_path / "store" / "mlflow.db"), "hostsweep-unit", experiment_description("unit"))
    tracker.start_sweep("unit sweep", "study: unit\n", {"n_cells": 2}, {"git_sha": "abc"})
    return tracker


def test_a_finished_and_a_failed_cell_become_child_runs_of_the_sweep(tracker):
    ok = CellResult("key-ok", PARAMS, "FINISHED", CellMeasurement(3.0, 2.9, 3.1, 10.5, 106.5, REPS), None,
                    {"hostname": "vm"}, 1.5, SPLIT)
    bad = CellResult("key-bad", {**PARAMS, "batch": 4}, "FAILED", None, "OOM: no memory", {})
    ok_id, bad_id = tracker.log_cell(ok, {}), tracker.log_cell(bad, {})
    tracker.finish_sweep("FAILED", {"cells_done": 2.0})
    client = tracker.client
    ok_run, bad_run = client.get_run(ok_id), client.get_run(bad_id)
    assert ok_run.data.tags["mlflow.parentRunId"] == tracker.parent_run_id
    assert ok_run.info.status == "FINISHED" and bad_run.info.status == "FAILED"
    assert ok_run.data.metrics["step_ms"] == 3.0 and ok_run.data.metrics["device_ms"] == 1.25
    assert ok_run.data.tags["regime"] == "host-bound" and ok_run.data.params["batch"] == "2"
    assert bad_run.data.tags["failure_reason"].startswith("OOM")
    artifacts = {a.path for a in client.list_artifacts(ok_id)}
    assert {"raw_timings.csv", "top_ops.csv"} <= artifacts
    assert client.get_run(tracker.parent_run_id).info.status == "FAILED"


def test_finished_cells_read_back_as_the_rows_they_were_logged_with(tracker):
    result = CellResult("key-ok", PARAMS, "FINISHED", CellMeasurement(3.0, 2.9, 3.1, 10.5, 106.5, REPS), None,
                        {"hostname": "vm", "device_name": "cpu-x"}, 1.5, SPLIT)
    run_id = tracker.log_cell(result, {})
    tracker.log_cell(CellResult("key-bad", PARAMS, "FAILED", None, "boom", {}), {})
    finished = tracker.finished_cells()
    assert set(finished) == {"key-ok"}  # a FAILED cell is measured again on resume
    logged, written = finished["key-ok"], cell_row(result, run_id)
    for column in ("step_ms", "step_p90_ms", "device_ms", "host_frac", "regime", "hostname", "device_name",
                   "cell_key", "mlflow_run_id"):
        assert logged[column] == written[column], column  # rounded alike: equal, not approximately


def test_read_cells_gives_the_model_stage_one_row_per_finished_cell_with_its_ci(tracker):
    for batch in (1, 2, 4):
        params = {**PARAMS, "batch": batch}
        tracker.log_cell(CellResult(f"k{batch}", params, "FINISHED",
                                    CellMeasurement(2.0 + batch, 1.9, 2.1 + batch, 10.0, 100.0, REPS), None, {}), {})
    frame = read_cells(tracker.tracking_uri, ["hostsweep-unit"])
    assert sorted(frame["batch"]) == [1, 2, 4] and sorted(frame["step_ms"]) == [3.0, 4.0, 6.0]
    by_batch = frame.set_index("batch")
    assert list(by_batch.loc[[1, 2, 4], "step_ci_high_ms"]) == [3.1, 4.1, 6.1]  # the falsification rule reads it
    assert list(by_batch.loc[[1, 2, 4], "step_ci_low_ms"]) == [1.9, 1.9, 1.9]
    assert frame["tp"].dtype.kind == "i" and set(frame["sku"]) == {"cpu"}
    mlflow.set_tracking_uri(None)


def test_runs_table_link_opens_the_runs_view_not_the_genai_overview(tracker):
    url = tracker.runs_table_url(5001)
    assert url == f"http://127.0.0.1:5001/#/experiments/{tracker.experiment_id}/runs?workflowType=machine_learning"
    assert tracker.run_url("abc").endswith(f"/#/experiments/{tracker.experiment_id}/runs/abc?workflowType=machine_learning")


def test_links_to_a_tracking_server_point_at_the_server_without_its_credentials():
    from hostsweep.record.views import runs_table_url, ui_base

    base = ui_base("https://alice:s3cret@mlflow.example.org:8443/")
    assert base == "https://mlflow.example.org:8443"
    assert runs_table_url("7", base=base).startswith(base + "/#/experiments/7/runs?workflowType=machine_learning")


def test_the_ui_command_quotes_an_absolute_store_path(tmp_path, monkeypatch):
    from hostsweep.record.views import ui_command

    monkeypatch.chdir(tmp_path)
    command = ui_command("sqlite:///outputs/mlflow.db")
    assert f"--backend-store-uri sqlite:///{tmp_path}/outputs/mlflow.db" in command
    assert "--host 127.0.0.1 --port 5000" in command
    assert "sqlite:////abs/m.db" in ui_command("sqlite:////abs/m.db")


def test_the_ui_command_of_a_servers_database_shows_the_servers_files_and_no_password(monkeypatch):
    from hostsweep.record import store
    from hostsweep.record.views import ui_command

    monkeypatch.setattr(store, "_served_artifacts", None)
    store.serve_artifacts_from("s3://bucket/hostsweep")
    command = ui_command("postgresql+psycopg2://mlflow:s3cret@127.0.0.1:5432/mlflow")
    assert "--artifacts-destination s3://bucket/hostsweep --host 127.0.0.1" in command and "s3cret" not in command


def test_the_experiment_says_what_it_holds_and_how_to_open_its_runs_table(tracker):
    experiment = tracker.client.get_experiment(tracker.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    assert "workflowType=machine_learning" in experiment.tags["mlflow.note.content"]
    assert "hostsweep study `unit`" in experiment.tags["mlflow.note.content"]


def test_a_measured_cell_run_starts_and_ends_with_its_measurement_and_replaces_an_old_claim_run(tracker):
    claims, _ = tracker.claim({"key-ok": PARAMS}, 300)
    assert claims == {"key-ok": None}  # batched claims: no run until the cell is logged
    # a journal written before batched claims names a claim run: the measured cell's run replaces it
    old_claim = tracker.client.create_run(tracker.experiment_id, tags={PARENT_TAG: tracker.parent_run_id,
                                                                       "cell_key": "key-ok"}).info.run_id
    measured = CellResult("key-ok", PARAMS, "FINISHED", CellMeasurement(3.0, 2.9, 3.1, 10.5, 106.5, REPS), None,
                          {}, 8.25, SPLIT, started_at=1_700_000_000.0, ended_at=1_700_000_008.25)
    run_id = tracker.log_cell(measured, {"journal_entry": "e1"}, old_claim)
    again = tracker.log_cell(measured, {"journal_entry": "e1"}, old_claim)  # a retried delivery
    run = tracker.client.get_run(run_id)
    assert again == run_id and run_id != old_claim
    assert (run.info.start_time, run.info.end_time) == (1_700_000_000_000, 1_700_000_008_250)
    assert tracker.client.get_run(old_claim).info.lifecycle_stage == "deleted"
    assert run.info.run_name == "b2-ctx128-eager-tp1-cpu-tiny-llama"  # no sweep context: every axis
    assert run.data.tags["mlflow.note.content"].startswith("**b2 ctx128 on cpu/tiny-llama/eager/tp1**: 3.000 ms")
    assert list(tracker.finished_cells()) == ["key-ok"]


def test_a_cell_is_recorded_in_one_create_run_one_log_batch_and_its_end(tracker, monkeypatch):
    """MLflow's API, as against a server (a database store is written in one transaction)."""
    monkeypatch.setattr(tracker, "direct_writes", False)
    calls = []
    for name in ("create_run", "log_batch", "set_tag", "set_terminated", "delete_run", "log_param", "log_metric"):
        real = getattr(tracker.client, name)
        monkeypatch.setattr(tracker.client, name, lambda *a, _real=real, _name=name, **k: (calls.append(_name),
                                                                                           _real(*a, **k))[1])
    measured = CellResult("key-ok", PARAMS, "FINISHED", CellMeasurement(3.0, 2.9, 3.1, 10.5, 106.5, REPS), None,
                          {}, 8.25, SPLIT, started_at=1_700_000_000.0, ended_at=1_700_000_008.25)
    run = tracker.client.get_run(tracker.log_cell(measured, {"journal_entry": "e1", "git_sha": "abc"}))
    assert calls == ["create_run", "log_batch", "set_terminated"]
    assert run.data.tags["cell_key"] == "key-ok" and run.data.tags["git_sha"] == "abc"
    assert run.data.params["batch"] == "2" and run.data.metrics["step_ms"] == 3.0


def test_a_database_store_gets_a_cell_in_one_transaction_the_same_run_as_through_the_api(tracker, monkeypatch):
    """sqlite (a SqlAlchemyStore): no API call per cell, and the run reads back as the API's
    run does: status, times, name, tags, params, metrics, latest metrics, artifacts."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    calls = []
    for name in ("create_run", "log_batch", "set_tag", "set_terminated", "log_text", "log_artifact"):
        real = getattr(tracker.client, name)
        monkeypatch.setattr(tracker.client, name, lambda *a, _real=real, _name=name, **k: (calls.append(_name),
                                                                                           _real(*a, **k))[1])
    commits = []
    store = tracker.client._tracking_client.store
    assert isinstance(store, SqlAlchemyStore)
    monkeypatch.setattr(store, "ManagedSessionMaker", lambda *a, _real=store.ManagedSessionMaker, **k: (
        commits.append(k), _real(*a, **k))[1])
    runs = {}
    for direct, status in ((True, "FINISHED"), (False, "FINISHED"), (True, "FAILED"), (False, "FAILED")):
        monkeypatch.setattr(tracker, "direct_writes", direct)
        calls.clear()
        commits.clear()
        result = CellResult(f"key-{direct}-{status}", PARAMS, status, CellMeasurement(3.0, 2.9, 3.1, 10.5, 106.5, REPS),
                            "boom" if status == "FAILED" else None, {"hostname": "vm"}, 8.25, SPLIT,
                            started_at=1_700_000_000.0, ended_at=1_700_000_008.25)
        run_id = tracker.log_cell(result, {"journal_entry": f"e-{direct}-{status}", "git_sha": "abc"})
        tracker.delivered(f"e-{direct}-{status}")
        if direct:
            # one writing session (the first cell also reads the experiment once), no call of MLflow's API
            assert calls == [] and [k for k in commits if k] == [{"read_only": False}]
        runs[direct, status] = tracker.client.get_run(run_id)
    for status in ("FINISHED", "FAILED"):
        new, api = runs[True, status], runs[False, status]
        assert (new.info.status, new.info.start_time, new.info.end_time, new.info.run_name) == (
            api.info.status, api.info.start_time, api.info.end_time, api.info.run_name)
        assert new.data.params == api.data.params and new.data.metrics == api.data.metrics
        drop = {"cell_key", "journal_entry"}
        assert {k: v for k, v in new.data.tags.items() if k not in drop} == {
            k: v for k, v in api.data.tags.items() if k not in drop}
        history = tracker.client.get_metric_history(new.info.run_id, "step_ms")
        assert [(m.value, m.step) for m in history] == [(3.0, 0)]
        assert new.info.artifact_uri.endswith(f"{new.info.run_id}/artifacts")
        listed = lambda run: sorted(a.path for a in tracker.client.list_artifacts(run.info.run_id))  # noqa: E731
        assert listed(new) == listed(api) and "raw_timings.csv" in listed(new)
    assert runs[True, "FAILED"].data.tags["failure_reason"] == "boom"
    # a delivery retried after its run was written (the answer lost) writes nothing twice
    again = CellResult("key-again", PARAMS, "FINISHED", CellMeasurement(3.0, 2.9, 3.1, 10.5, 106.5, REPS), None, {},
                       8.25, SPLIT, started_at=1_700_000_000.0, ended_at=1_700_000_008.25)
    monkeypatch.setattr(tracker, "direct_writes", True)
    writer = tracker._direct_writer()
    real_write = writer.write_many

    def write_then_lose_the_answer(*args, **kwargs):
        real_write(*args, **kwargs)
        monkeypatch.setattr(writer, "write_many", real_write)
        raise ConnectionError("the answer was lost")

    monkeypatch.setattr(writer, "write_many", write_then_lose_the_answer)
    first = tracker.log_cell(again, {"journal_entry": "e-again"})  # the write is found there: no error
    assert tracker.log_cell(again, {"journal_entry": "e-again"}) == first  # a retry anyway writes nothing
    assert len(tracker.client.search_runs([tracker.experiment_id], "tags.cell_key = 'key-again'")) == 1
    assert tracker._direct_writer() is writer  # still writing directly


def measured_cell(key: str) -> CellResult:
    return CellResult(key, PARAMS, "FINISHED", CellMeasurement(3.0, 2.9, 3.1, 10.5, 106.5, REPS), None, {}, 8.25,
                      SPLIT, started_at=1_700_000_000.0, ended_at=1_700_000_008.25)


def test_a_direct_write_the_database_refuses_falls_back_to_the_api_for_this_and_every_later_cell(
        tracker, monkeypatch, caplog):
    """A database laid out by another MLflow: the INSERTs fail while the store answers. The
    batch is logged through MLflow's API, once, and so is every later cell."""
    from sqlalchemy.exc import ProgrammingError

    writer = tracker._direct_writer()
    refused = []

    def another_layout(runs):
        refused.append(len(runs))
        raise ProgrammingError("INSERT INTO runs", {}, Exception('column "name" does not exist'))

    monkeypatch.setattr(writer, "write_many", another_layout)
    cells = [(measured_cell(f"key-{i}"), {"journal_entry": f"e{i}"}, None) for i in range(3)]
    ids = tracker.log_cells(cells)
    later = tracker.log_cell(measured_cell("key-later"), {"journal_entry": "e-later"})
    assert refused == [3]  # tried once, then the API
    assert "MLflow's API logs them from now on" in caplog.text and 'column "name"' in caplog.text
    for key, run_id in zip([*(f"key-{i}" for i in range(3)), "key-later"], [*ids, later]):
        (run,) = tracker.client.search_runs([tracker.experiment_id], f"tags.cell_key = '{key}'")
        assert run.info.run_id == run_id and run.info.status == "FINISHED"
        assert run.data.metrics["step_ms"] == 3.0
        assert "raw_timings.csv" in {a.path for a in tracker.client.list_artifacts(run_id)}


def test_a_direct_write_while_the_database_is_down_is_an_outage_the_uploader_retries(tracker):
    from sqlalchemy.exc import OperationalError

    writer = tracker._direct_writer()
    down = OperationalError("SELECT", {}, Exception("could not connect to server"))
    for name in ("write_many", "existing"):  # instance attributes over the class's methods, deleted below
        setattr(writer, name, lambda *a, _e=down: (_ for _ in ()).throw(_e))
    with pytest.raises(OperationalError):
        tracker.log_cell(measured_cell("key-down"), {"journal_entry": "e-down"})
    del writer.write_many, writer.existing
    run_id = tracker.log_cell(measured_cell("key-down"), {"journal_entry": "e-down"})  # back: the retry
    assert tracker._direct_writer() is writer  # an outage does not switch direct writes off
    assert [r.info.run_id for r in tracker.client.search_runs([tracker.experiment_id],
                                                               "tags.cell_key = 'key-down'")] == [run_id]


def test_direct_writes_false_logs_a_database_store_through_the_api(tmp_path, new_store):
    tracker = SweepTracker(new_store(tmp_path / "mlflow.db"), "hostsweep-api", direct_writes=False)
    tracker.start_sweep("api", "", {}, {})
    assert tracker._direct_writer() is False and tracker.cells_per_write() == 1
    assert tracker.client.get_run(tracker.log_cell(measured_cell("key-api"), {})).info.status == "FINISHED"


def test_claims_are_batched_on_the_parent_run_and_a_second_sweep_skips_them(tmp_path, new_store):
    from hostsweep.record import liveruns

    uri = new_store(tmp_path / "store" / "mlflow.db")
    first, second = (SweepTracker(uri, "hostsweep-claims") for _ in range(2))
    first.start_sweep("first", "", {}, {})
    calls = []
    log_batch = first.client.log_batch
    first.client.log_batch = lambda *a, **k: (calls.append(len(k.get("tags", []))), log_batch(*a, **k))[1]
    keys = [f"cpu/tiny-llama/eager/tp1/b{i}/ctx{i}/T33/0123456789" for i in range(3000)]
    mine, others = first.claim(((key, {}) for key in keys), 300)
    assert list(mine) == keys and others == {}
    assert len(calls) == 1 and calls[0] <= liveruns.BATCH_TAGS  # 3,000 cells claimed in one call
    tags = first.client.get_run(first.parent_run_id).data.tags
    assert all(len(v) <= liveruns.TAG_VALUE_LIMIT for k, v in tags.items() if k.startswith("claims."))
    assert not first.client.search_runs([first.experiment_id], "tags.cell_key != ''")  # no run per cell
    second.start_sweep("second", "", {}, {})
    mine2, others2 = second.claim(((key, {}) for key in [*keys[:5], "new-cell"]), 300)
    assert list(mine2) == ["new-cell"] and others2 == dict.fromkeys(keys[:5], first.parent_run_id)
    assert set(second.live_claims(300)) == {*keys, "new-cell"}


def test_of_two_sweeps_claiming_at_once_the_earlier_claim_wins_on_both_sides(tmp_path, new_store, monkeypatch):
    uri = new_store(tmp_path / "store" / "mlflow.db")
    first, second = (SweepTracker(uri, "hostsweep-race") for _ in range(2))
    first.start_sweep("first", "", {}, {})
    second.start_sweep("second", "", {}, {})
    # both read the claims before either writes: both claim "k"
    live = first.live_claims
    monkeypatch.setattr(first, "live_claims", lambda s, calls=[]: (calls.append(1), {} if len(calls) == 1
                                                                     else live(s))[1])
    mine1, _ = first.claim([("k", {}), ("a", {})], 300)   # written first: the earlier claim
    mine2, others2 = second.claim([("k", {}), ("b", {})], 300)
    assert "k" not in mine2 and others2 == {"k": first.parent_run_id} and "b" in mine2
    assert set(mine1) == {"k", "a"}
    again, others1 = first.claim([], 300)
    assert others1 == {}  # the first sweep still holds "k"


def test_cell_run_names_lead_with_what_varies_in_the_sweep():
    from hostsweep.record.views import cell_run_name, varying_axes

    cells = [{**PARAMS, "batch": b, "mode": m, "workload": "random"} for b in (1, 4) for m in ("eager", "graph")]
    assert varying_axes(cells) == ("mode",)
    assert cell_run_name(cells[3], varying_axes(cells)) == "b4-ctx128-graph"
    assert cell_run_name(cells[0], varying_axes(cells[:1])) == "b1-ctx128"
    assert cell_run_name({**PARAMS, "workload": "repeat"}, ("tp", "workload")) == "b2-ctx128-tp1-repeat"


def test_a_sweep_description_and_figures_land_on_the_parent_run(tracker, tmp_path):
    (tmp_path / "figures").mkdir()
    png = tmp_path / "figures" / "step_times.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n")
    (tmp_path / "cells.csv").write_text("batch,step_ms\n1,3.0\n")
    tracker.describe_sweep("### unit\n| batch | step_ms |\n|---|---|\n| 1 | 3.000 |")
    tracker.log_sweep_files([tmp_path / "cells.csv"], [png])
    parent = tracker.client.get_run(tracker.parent_run_id)
    assert parent.data.tags["mlflow.note.content"].startswith("### unit")
    assert {a.path for a in tracker.client.list_artifacts(tracker.parent_run_id, "figures")} == {"figures/step_times.png"}
    assert "cells.csv" in {a.path for a in tracker.client.list_artifacts(tracker.parent_run_id)}


def test_a_skipped_cell_is_a_killed_run_with_its_reason_and_is_not_resumed(tracker):
    from hostsweep.measure.results import skipped_result

    reason = "mode fp8 needs CUDA compute capability >= 8.9; sku cpu has no GPU"
    run_id = tracker.log_cell(skipped_result("key-fp8", {**PARAMS, "mode": "fp8"}, reason), {})
    run = tracker.client.get_run(run_id)
    assert run.info.status == "KILLED"
    assert run.data.tags["skipped"] == "true" and run.data.tags["skip_reason"] == reason
    assert "failure_reason" not in run.data.tags and run.data.params["mode"] == "fp8"
    assert "key-fp8" not in tracker.finished_cells()


def test_the_study_summary_lands_on_the_parent_run(tracker, tmp_path):
    import pandas as pd

    tables = {"graph_vs_eager": pd.DataFrame({"batch": [1, 2], "reduction": [0.3, 0.1]})}
    tracker.log_study_summary(tables, {"graph_vs_eager/mean_reduction": 0.2, "graph_vs_eager/x": float("nan")})
    parent = tracker.client.get_run(tracker.parent_run_id)
    assert parent.data.metrics == {"graph_vs_eager/mean_reduction": 0.2}
    path = tracker.client.download_artifacts(tracker.parent_run_id, "study/graph_vs_eager.csv", str(tmp_path))
    assert list(pd.read_csv(path)["reduction"]) == [0.3, 0.1]


def test_a_retried_delivery_reuses_its_run_and_a_delivered_cell_leaves_nothing_behind(tracker):
    measured = CellResult("key-ok", PARAMS, "FINISHED", CellMeasurement(3.0, 2.9, 3.1, 10.5, 106.5, REPS), None,
                          {}, 1.0, started_at=1_700_000_000.0, ended_at=1_700_000_001.0)
    first = tracker.log_cell(measured, {"journal_entry": "e1"})
    assert tracker.log_cell(measured, {"journal_entry": "e1"}) == first  # retried: same run
    tracker.delivered("e1")
    assert tracker.logged_into == {}  # a 10,000-cell sweep keeps nothing per logged cell


def _paged(tracker, monkeypatch, page: int) -> list[list]:
    """Make the tracker read `page` runs per search; returns weak references to each page's
    runs, and asserts on every search that no page before the previous one is still alive."""
    import gc
    import weakref

    from hostsweep.record import experimentruns

    monkeypatch.setattr(experimentruns, "SEARCH_PAGE", page)
    pages: list[list] = []
    search = tracker.client.search_runs

    def search_runs(*args, **kwargs):
        gc.collect()
        assert not any(ref() is not None for old in pages[:-1] for ref in old), "an earlier page is still held"
        found = search(*args, **kwargs)
        assert kwargs["max_results"] == page
        pages.append([weakref.ref(run) for run in found])
        return found

    monkeypatch.setattr(tracker.client, "search_runs", search_runs)
    return pages


def _measured_twice(tracker) -> None:
    for i, key in enumerate(["a", "b", "a", "c", "b"]):  # a and b measured twice, later runs newer
        tracker.log_cell(CellResult(key, {**PARAMS, "batch": i}, "FINISHED",
                                    CellMeasurement(3.0, 2.9, 3.1, 10.5, 106.5, REPS), None, {}, 1.0,
                                    started_at=1_700_000_000.0 + i, ended_at=1_700_000_000.5 + i), {})


def test_reading_back_finished_cells_holds_one_page_of_runs_at_a_time_newest_first(tracker, monkeypatch):
    _measured_twice(tracker)
    monkeypatch.setattr(tracker, "direct_reads", False)  # MLflow's search (a server's path)
    pages = _paged(tracker, monkeypatch, 2)
    finished = tracker.finished_runs()
    assert len(pages) == 3 and sum(len(p) for p in pages) == 5
    newest_first = {key: [int(row["batch"]) for row in rows] for key, rows in finished.items()}
    assert newest_first == {"a": [2, 0], "b": [4, 1], "c": [3]}


def test_a_database_store_is_read_back_a_page_at_a_time_with_plain_selects_as_search_runs_would(
        tracker, monkeypatch):
    from hostsweep.record.read import dbread, readback

    _measured_twice(tracker)
    tracker.log_cell(CellResult("d", PARAMS, "FAILED", None, "boom", {}, 1.0), {})  # not FINISHED: not read
    pages = []
    stored_runs = dbread.stored_runs
    monkeypatch.setattr("hostsweep.record.experimentruns.stored_runs",
                        lambda *a, **k: (pages.append(1), stored_runs(*a, **{**k, "page": 2}))[1])
    monkeypatch.setattr(tracker.client, "search_runs", None)  # never asked
    direct = tracker.finished_runs()
    assert len(pages) == 1 and {key: [int(r["batch"]) for r in rows] for key, rows in direct.items()} == {
        "a": [2, 0], "b": [4, 1], "c": [3]}
    monkeypatch.undo()
    monkeypatch.setattr(tracker, "direct_reads", False)
    assert tracker.finished_runs() == direct  # the same rows as MLflow's search gives

    frame = readback.read_cells(tracker.tracking_uri, ["hostsweep-unit"])
    monkeypatch.setattr(readback, "direct_runs", lambda *a: None)
    searched = readback.read_cells(tracker.tracking_uri, ["hostsweep-unit"])
    key = ["cell_key"]
    pd.testing.assert_frame_equal(frame.sort_values(key).reset_index(drop=True)[sorted(frame)],
                                  searched.sort_values(key).reset_index(drop=True)[sorted(searched)])
    assert sorted(frame["cell_key"]) == ["a", "b", "c"]


def test_read_back_falls_back_to_mlflows_search_when_the_database_read_fails(tracker, monkeypatch):
    _measured_twice(tracker)
    monkeypatch.setattr("hostsweep.record.experimentruns.stored_runs", lambda *a, **k: 1 / 0)
    assert sorted(tracker.finished_runs()) == ["a", "b", "c"]


def test_claims_read_across_pages_keep_only_the_tags_liveness_reads(tracker, monkeypatch):
    from hostsweep.record.liveruns import LIVENESS_TAGS

    pages = _paged(tracker, monkeypatch, 2)
    mine, others = tracker.claim(((f"k{i}", {**PARAMS, "batch": i}) for i in range(5)), 300)
    assert set(mine) == {f"k{i}" for i in range(5)} and others == {}
    assert [len(page) for page in pages] == [1, 1]  # before and after claiming: the parent (claims are its tags)
    for i in range(3):  # cells being logged: RUNNING cell runs, read across pages
        tracker.client.create_run(tracker.experiment_id, tags={PARENT_TAG: tracker.parent_run_id,
                                                               "cell_key": f"k{i}", "other": "x"})
    views, known = tracker.running_runs()
    assert len(views) == 4 and all(set(v.tags) <= set(LIVENESS_TAGS) for v in views if v.run_id != tracker.parent_run_id)
    assert set(tracker.live_claims(300)) == set(mine)


def test_resume_decides_on_a_narrow_read_that_agrees_with_the_full_one_and_reads_the_rows_it_keeps(
        tracker, monkeypatch):
    _measured_twice(tracker)
    with_split = CellResult("e", PARAMS, "FINISHED", CellMeasurement(3.0, 2.9, 3.1, 10.5, 106.5, REPS), None, {},
                            1.5, SPLIT)
    tracker.log_cell(with_split, {})
    tracker.log_cell(CellResult("d", PARAMS, "FAILED", None, "boom", {}, 1.0), {})  # not FINISHED: not read
    full = tracker.finished_runs()
    monkeypatch.setattr(tracker.client, "search_runs", None)  # a database store: never MLflow's search
    index = tracker.finished_index(["device_ms", "pyspy_idle_frac"])
    assert {key: [run.run_id for run in runs] for key, runs in index.items()} == {
        key: [row["mlflow_run_id"] for row in rows] for key, rows in full.items()}  # newest first, alike
    assert index["e"][0].metric_keys == {"device_ms"} and index["a"][0].metric_keys == frozenset()
    kept = [index["e"][0].run_id, index["a"][0].run_id]
    rows = tracker.resumed_rows(kept)
    assert rows == [full["e"][0], full["a"][0]]  # in the order asked (the grid's)
    monkeypatch.undo()

    monkeypatch.setattr(tracker, "direct_reads", False)  # a server: one full read, its rows kept for resumed_rows
    searched = tracker.finished_index(["device_ms", "pyspy_idle_frac"])
    assert searched == index
    monkeypatch.setattr(tracker.client, "search_runs", None)
    assert tracker.resumed_rows(kept) == rows


def test_a_server_proxied_artifact_uri_maps_into_the_servers_destination(monkeypatch):
    from hostsweep.config.schema import ConfigError
    from hostsweep.record import store

    monkeypatch.setattr(store, "_served_artifacts", None)
    with pytest.raises(ConfigError, match="tracking.artifacts"):
        store.served_location("mlflow-artifacts:/3/abc/artifacts")
    assert store.served_location("file:///srv/a/3") is None  # not the server's: unchanged
    store.serve_artifacts_from("s3://bucket/hostsweep/")
    assert store.served_location("mlflow-artifacts:/3/abc/artifacts") == "s3://bucket/hostsweep/3/abc/artifacts"
    assert store.served_location("mlflow-artifacts://head:5000/3/abc") == "s3://bucket/hostsweep/3/abc"


def test_into_a_servers_database_cell_files_go_where_the_server_serves_them(tmp_path, new_store, monkeypatch):
    """A driver writing straight into a tracking server's database: an experiment the server
    made (artifacts proxied, mlflow-artifacts:/...) gets its cells' files in the server's
    destination, and MLflow's client of the same URI lists them; without the destination
    the tracker refuses at once, before a cell is measured."""
    from hostsweep.config.schema import ConfigError
    from hostsweep.record import store

    uri = new_store(tmp_path / "store" / "mlflow.db")
    MlflowClient = mlflow.tracking.MlflowClient
    MlflowClient(uri).create_experiment("hostsweep-served", artifact_location="mlflow-artifacts:/7")
    monkeypatch.setattr(store, "_served_artifacts", None)
    assert SweepTracker(uri, "hostsweep-served").finished_runs() == {}  # reading needs no destination
    with pytest.raises(ConfigError, match="--artifacts-destination"):
        SweepTracker(uri, "hostsweep-served").check_artifacts()
    destination = tmp_path / "served"
    store.serve_artifacts_from(destination.as_uri())
    tracker = SweepTracker(uri, "hostsweep-served")
    tracker.start_sweep("unit sweep", "study: unit\n", {"n_cells": 1}, {})
    result = CellResult("key-ok", PARAMS, "FINISHED", CellMeasurement(3.0, 2.9, 3.1, 10.5, 106.5, REPS), None, {},
                        1.5, SPLIT)
    run_id = tracker.log_cell(result, {})
    assert tracker.client.get_run(run_id).info.artifact_uri == f"mlflow-artifacts:/7/{run_id}/artifacts"
    assert (destination / "7" / run_id / "artifacts" / "raw_timings.csv").is_file()
    assert {"raw_timings.csv", "top_ops.csv"} <= {a.path for a in tracker.client.list_artifacts(run_id)}
    new = SweepTracker(uri, "hostsweep-made-here")  # an experiment made here is laid out as the server would
    assert new.client.get_experiment(new.experiment_id).artifact_location == "mlflow-artifacts:/hostsweep-made-here"


def test_a_tracking_server_is_named_as_the_ui_never_as_a_backend_store():
    """`mlflow ui --backend-store-uri http://…` cannot work (a server is not a store, and
    the password is starred out): the server already is the UI."""
    from hostsweep.record.views import open_ui_line

    line = open_ui_line("http://alice:s3cret@127.0.0.1:5005")
    assert line == "open the UI: http://127.0.0.1:5005 (the tracking server serves it)"
    assert "--backend-store-uri" not in line and "alice" not in line and "s3cret" not in line
    assert "--backend-store-uri sqlite:///" in open_ui_line("sqlite:///m.db")
