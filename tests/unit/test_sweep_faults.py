"""Whole sweeps (the stage) on the fake backend and a real sqlite MLflow store: resume that
checks what was measured, claims between concurrent sweeps, stale runs of dead sweeps,
interrupts, and a tracking store that refuses cells. Each with its figure: cells
expected / finished / duplicated / lost, counted in MLflow."""
from __future__ import annotations

import logging
import time
from collections import Counter

import mlflow
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from hostsweep.record.claims import HEARTBEAT_TAG, KILLED_REASON_TAG, OWNER_TAG, PARENT_TAG
from hostsweep.record.journal import JOURNAL_FILE, read_entries, unlogged
from hostsweep.record.tracking import SweepTracker
from hostsweep.stages import sweep
from hostsweep.config.grid import build_cells
from tests.conftest import compose_raw, compose_typed
from tests.fakes import FakeBackend

FAST = ["+sku=cpu", "engine.name=fake", "measure.T=5", "measure.reps=3", "measure.warmups=1", "ctx=[16]",
        "batch=[1,2,3,4]", "split.enabled=false", "ray.exclusive=false",
        "tracking.heartbeat_s=0.5", "tracking.outage_s=1", "tracking.stale_after_s=5"]


@pytest.fixture(scope="module")
def store(tmp_path_factory, new_store):
    return new_store(tmp_path_factory.mktemp("store") / "mlflow.db")


@pytest.fixture
def study(request, store, tmp_path, monkeypatch):
    """A fresh study name per test in the shared store; the cwd (pending folder) is tmp."""
    monkeypatch.chdir(tmp_path)
    name = request.node.name.replace("[", "-").replace("]", "")[:60]
    return [*FAST, f"tracking.uri={store}", f"study={name}"]


def experiment_runs(store: str, study_args: list[str]) -> pd.DataFrame:
    name = [a for a in study_args if a.startswith("study=")][0].split("=", 1)[1]
    mlflow.set_tracking_uri(store)
    runs = mlflow.search_runs(experiment_names=[f"hostsweep-{name}"])
    mlflow.set_tracking_uri(None)
    return runs


def tally(runs: pd.DataFrame, expected: int) -> tuple[int, int, int, int]:
    """(expected, finished, duplicated, lost) over the study's FINISHED cell runs."""
    if "tags.cell_key" not in runs:  # no cell run at all (claims are the parent's tags)
        return expected, 0, 0, expected
    cells = runs[runs.get("tags.cell_key", pd.Series(dtype=str)).notna()] if len(runs) else runs
    finished = Counter(cells[cells["status"] == "FINISHED"]["tags.cell_key"]) if len(cells) else Counter()
    return expected, len(finished), sum(n > 1 for n in finished.values()), expected - len(finished)


def grid_of(args):
    return build_cells(compose_typed(args))


def run_sweep(args, run_dir, backend=None):
    return sweep.run(compose_raw(args), run_dir, backend or FakeBackend(run_dir / "work"))


def test_a_clean_sweep_records_every_cell_once_with_its_attempt(study, store, tmp_path):
    assert run_sweep(study, tmp_path / "run") == 0
    runs = experiment_runs(store, study)
    assert tally(runs, 4) == (4, 4, 0, 0)
    cells = runs[runs["tags.cell_key"].notna()]
    assert set(cells["tags.attempt"]) == {"1"}
    table = pd.read_csv(tmp_path / "run" / "cells.csv")
    assert sorted(table["mlflow_run_id"]) == sorted(cells["run_id"])  # the row names its run before MLflow has it
    assert not unlogged(read_entries(tmp_path / "run" / JOURNAL_FILE))


def test_a_retried_cell_records_its_attempt_and_why(study, store, tmp_path):
    first = grid_of(study)[0]
    backend = FakeBackend(tmp_path / "work", fates={first.key: ["engine-dies"]})
    assert run_sweep(study, tmp_path / "run", backend) == 0
    runs = experiment_runs(store, study)
    assert tally(runs, 4) == (4, 4, 0, 0)
    retried = runs[runs["tags.cell_key"] == first.key].iloc[0]
    assert retried["tags.attempt"] == "2" and "engine died" in retried["tags.retry_reasons"]


def test_resume_measures_again_a_finished_cell_that_lacks_what_this_sweep_asks_for(study, store, tmp_path, caplog):
    assert run_sweep(study, tmp_path / "nosplit") == 0  # split.enabled=false
    with_split = [*study, "split.enabled=true"]
    backend = FakeBackend(tmp_path / "work")
    with caplog.at_level(logging.INFO):
        assert run_sweep(with_split, tmp_path / "split", backend) == 0
    assert len(backend.measured) == 4  # none skipped: none had device_ms
    assert "has no split, which this sweep asks for: measuring it again" in caplog.text
    again = FakeBackend(tmp_path / "work")
    assert run_sweep(with_split, tmp_path / "again", again) == 0
    assert again.measured == []  # now every cell has its split
    assert run_sweep(study, tmp_path / "plain", FakeBackend(tmp_path / "w")) == 0  # split not asked: still complete
    table = pd.read_csv(tmp_path / "again" / "cells.csv")
    assert table["resumed"].all() and table["device_ms"].notna().all()


def test_a_second_sweep_of_the_same_study_skips_the_cells_the_first_has_claimed(study, store, tmp_path, caplog):
    second = {}

    def start_second_sweep_midway(cell):
        if not second:
            second["backend"] = FakeBackend(tmp_path / "work2")
            second["code"] = run_sweep(study, tmp_path / "run2", second["backend"])

    first = FakeBackend(tmp_path / "work1", on_measure=start_second_sweep_midway)
    with caplog.at_level(logging.WARNING):
        assert run_sweep(study, tmp_path / "run1", first) == 0
    assert second["code"] == 0 and second["backend"].measured == []
    assert caplog.text.count("is being measured by another sweep") == 4
    assert tally(experiment_runs(store, study), 4) == (4, 4, 0, 0)


def dead_sweep(store: str, study_args: list[str], keys: list[str]) -> tuple[str, list[str]]:
    """A sweep that was kill -9'ed: its parent and its claims left RUNNING, its driver gone."""
    name = [a for a in study_args if a.startswith("study=")][0].split("=", 1)[1]
    tracker = SweepTracker(store, f"hostsweep-{name}")
    parent = tracker.client.create_run(tracker.experiment_id, tags={
        HEARTBEAT_TAG: f"{time.time():.0f}", OWNER_TAG: "thishost-placeholder"})
    claims = [tracker.client.create_run(tracker.experiment_id, tags={PARENT_TAG: parent.info.run_id, "cell_key": k})
              .info.run_id for k in keys]
    return parent.info.run_id, claims


def test_runs_left_running_by_a_killed_sweep_are_marked_killed_and_their_cells_measured(study, store, tmp_path):
    from hostsweep.config.machine import hostname

    grid = grid_of(study)
    parent, claims = dead_sweep(store, study, [c.key for c in grid[:2]])
    client = MlflowClient(store)
    client.set_tag(parent, OWNER_TAG, f"{hostname()}:999999999:0")  # same host, pid gone
    backend = FakeBackend(tmp_path / "work")
    assert run_sweep(study, tmp_path / "run", backend) == 0
    assert len(backend.measured) == 4
    for run_id in [parent, *claims]:
        run = client.get_run(run_id)
        assert run.info.status == "KILLED" and "pid 999999999" in run.data.tags[KILLED_REASON_TAG]
    assert tally(experiment_runs(store, study), 4) == (4, 4, 0, 0)


def test_claims_of_a_sweep_on_another_host_are_honoured_until_its_heartbeat_is_stale(study, store, tmp_path):
    grid = grid_of(study)
    parent, _ = dead_sweep(store, study, [grid[0].key])
    client = MlflowClient(store)
    client.set_tag(parent, OWNER_TAG, "elsewhere:1:0")
    fresh = FakeBackend(tmp_path / "work")
    assert run_sweep(study, tmp_path / "run1", fresh) == 0
    assert len(fresh.measured) == 3  # the claimed cell is left to its (live) sweep
    client.set_tag(parent, HEARTBEAT_TAG, f"{time.time() - 60:.0f}")  # silent for 60 s > stale_after_s=5
    later = FakeBackend(tmp_path / "work")
    assert run_sweep(study, tmp_path / "run2", later) == 0
    assert later.measured == [grid[0].key]
    assert "no heartbeat for" in client.get_run(parent).data.tags[KILLED_REASON_TAG]
    assert tally(experiment_runs(store, study), 4) == (4, 4, 0, 0)


def test_an_interrupted_sweep_marks_its_runs_killed_and_a_rerun_measures_only_the_rest(study, store, tmp_path):
    def interrupt_at_third(cell, seen=[]):
        seen.append(cell.key)
        if len(seen) == 3:
            raise KeyboardInterrupt  # what SIGINT, SIGTERM and SIGHUP raise in the driver

    with pytest.raises(KeyboardInterrupt):
        run_sweep(study, tmp_path / "first", FakeBackend(tmp_path / "work", on_measure=interrupt_at_third))
    runs = experiment_runs(store, study)
    parent = runs[runs["tags.cell_key"].isna()].iloc[0]
    assert parent["status"] == "KILLED"
    # the cells it claimed and never measured: counted on the parent (claims are its tags), no run each
    assert parent["tags.not_measured"] == "2" and "interrupted" in parent["tags.not_measured_reason"]
    assert not (runs["tags.cell_key"].notna() & (runs["status"] != "FINISHED")).any()
    rerun = FakeBackend(tmp_path / "work")
    assert run_sweep(study, tmp_path / "second", rerun) == 0
    assert len(rerun.measured) == 2
    assert tally(experiment_runs(store, study), 4) == (4, 4, 0, 0)


def test_cells_measured_while_tracking_refuses_them_are_kept_and_uploaded_by_the_rerun(study, store, tmp_path,
                                                                                         monkeypatch):
    original = SweepTracker.log_cells

    def refuse(self, *args, **kwargs):
        raise ConnectionError("Connection refused")

    def slow_cells(cell):
        time.sleep(0.6)  # real time passes while measuring, so the outage outlasts tracking.outage_s=1

    monkeypatch.setattr(SweepTracker, "log_cells", refuse)
    assert run_sweep(study, tmp_path / "down", FakeBackend(tmp_path / "work", on_measure=slow_cells)) == 1
    kept = pd.read_csv(tmp_path / "down" / "cells.csv")
    journal = unlogged(read_entries(tmp_path / "down" / JOURNAL_FILE))
    assert 1 <= len(kept) < 4 and len(journal) == len(kept)  # stopped measuring; every measured cell kept
    assert tally(experiment_runs(store, study), 4)[1] == 0

    monkeypatch.setattr(SweepTracker, "log_cells", original)
    rerun = FakeBackend(tmp_path / "work")
    assert run_sweep(study, tmp_path / "up", rerun) == 0
    assert len(rerun.measured) == 4 - len(kept)  # the journal's cells were uploaded, not measured again
    assert tally(experiment_runs(store, study), 4) == (4, 4, 0, 0)
    assert not unlogged(read_entries(tmp_path / "down" / JOURNAL_FILE))
    assert not list((tmp_path / "outputs" / "pending").rglob("*.json"))


def test_the_plan_is_made_while_ray_starts_and_a_ray_that_fails_ends_it_failed_with_every_claim_released(
        study, store, tmp_path, monkeypatch):
    """MLflow's side is opened in a thread while Ray starts. Ray refusing to start: the
    error is the sweep's, the parent run ends FAILED with every claimed cell listed as not
    measured, and the run directory is free for the next sweep."""
    from hostsweep.config.schema import ConfigError
    from hostsweep.run import cluster

    opened_while_ray_started = []

    def refuse(*args, **kwargs):
        deadline = time.monotonic() + 60  # the plan is made meanwhile: wait for its parent run
        while time.monotonic() < deadline and experiment_runs(store, study).empty:
            time.sleep(0.05)
        opened_while_ray_started.append(not experiment_runs(store, study).empty)
        raise ConfigError("ray.address=auto: nothing answers")

    monkeypatch.setattr(cluster, "connect", refuse)
    with pytest.raises(ConfigError, match="nothing answers"):
        sweep.run(compose_raw(study), tmp_path / "run")
    assert opened_while_ray_started == [True]
    (parent,) = [row for _, row in experiment_runs(store, study).iterrows()]
    assert parent["status"] == "FAILED" and parent["tags.not_measured"] == str(len(grid_of(study)))
    assert "Ray did not start" in parent["tags.not_measured_reason"]
    backend = FakeBackend(tmp_path / "work")
    assert sweep.run(compose_raw(study), tmp_path / "run", backend) == 0  # the same run dir: not locked
    assert sorted(backend.measured) == sorted(c.key for c in grid_of(study))


def test_a_grid_a_joined_cluster_refuses_leaves_nothing_in_mlflow(tmp_path, monkeypatch):
    """Joining a cluster, the plan waits for the cluster's check: a grid it cannot run is
    bad input, refused before the study's store is even opened."""
    from hostsweep.run import cluster
    from tests.listeners import grpc_like_listener

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cluster, "connect", lambda *args, **kwargs: False)
    monkeypatch.setattr(cluster, "live_nodes", lambda: [])
    store = tmp_path / "never.db"
    with grpc_like_listener() as port:  # answers the address check as a cluster's GCS does
        args = [*FAST, f"tracking.uri=sqlite:///{store}", "study=refused", f"ray.address=127.0.0.1:{port}"]
        with pytest.raises(cluster.InfeasiblePlan, match="the cluster has"):
            sweep.run(compose_raw(args), tmp_path / "run")
    assert not store.exists()
