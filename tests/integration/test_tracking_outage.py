"""A real MLflow server on loopback that dies mid-sweep, and one that comes back.

Sweeps run in-process on the fake backend (the faults here are MLflow's, not Ray's), with
cells that take real time so the outage overlaps measuring. Figures: 10 cells expected,
10 finished once in the end, 0 duplicated, 0 lost.
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from hostsweep.record.claims import KILLED_REASON_TAG
from hostsweep.record.journal import JOURNAL_FILE, read_entries, unlogged
from hostsweep.stages import sweep
from tests.conftest import compose_raw
from tests.fakes import FakeBackend
from tests.integration.mlflow_server import MlflowServer, fake_sweep_into

pytestmark = pytest.mark.integration

CELLS = 10
CELL_S = 1.0  # real seconds each cell takes to measure


@pytest.fixture(scope="module")
def server(tmp_path_factory, new_store):
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    new_store(server.root / "mlflow.db")  # made once for the session, not migrated by this server
    server.start()
    yield server
    server.stop()


def args(server: MlflowServer, outage_s: int) -> list[str]:
    return [*fake_sweep_into(server.uri, CELLS, "outage"), f"tracking.outage_s={outage_s}",
            f"tracking.stale_after_s={outage_s + 30}"]


def when_first_cell_is_logged(run_dir: Path, action) -> "callable":
    """An on_measure hook: once the journal shows a logged cell, run `action` (once)."""
    done = []

    def hook(cell) -> None:
        if not done and any(e["event"] == "logged" for e in read_entries(run_dir / JOURNAL_FILE)):
            done.append(cell.key)
            action()
        time.sleep(CELL_S)

    return hook


def finished_counts(server: MlflowServer) -> Counter:
    client = MlflowClient(server.uri)
    experiment = client.get_experiment_by_name("hostsweep-outage")
    runs = client.search_runs([experiment.experiment_id], "attributes.status = 'FINISHED'", max_results=1000)
    return Counter(r.data.tags["cell_key"] for r in runs if "cell_key" in r.data.tags)


def test_tracking_that_dies_stops_measuring_cleanly_keeps_every_measured_cell_and_a_rerun_uploads_them(
        server, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    first_dir = tmp_path / "first"
    killed_at = []

    def kill_server():
        server.kill()
        killed_at.append(time.monotonic())

    backend = FakeBackend(tmp_path / "work", on_measure=when_first_cell_is_logged(first_dir, kill_server))
    code = sweep.run(compose_raw(args(server, outage_s=5)), first_dir, backend)
    stopped_after = time.monotonic() - killed_at[0]
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    (message,) = [line for line in err.splitlines() if line.startswith("hostsweep: stopped early")]
    assert "MLflow has not answered for" in message and "rerun the same command" in message
    assert stopped_after < 5 + 20  # bounded: not MLflow's ~4 min of retries per call
    kept = pd.read_csv(first_dir / "cells.csv")
    journal = read_entries(first_dir / JOURNAL_FILE)
    measured = [e for e in journal if e["event"] == "measured"]
    assert len(kept) == len(measured) >= 2 and unlogged(journal)  # measured means kept: csv and journal
    assert len(measured) < CELLS  # it stopped measuring

    # The server comes back; the same command uploads the journal, then measures the rest,
    # and rides out a second outage (killed and restarted mid-sweep) without losing a cell.
    server.start()
    second_dir = tmp_path / "second"

    def outage_then_back():
        server.kill()
        threading.Thread(target=lambda: (time.sleep(2), server.start()), daemon=True).start()

    rerun = FakeBackend(tmp_path / "work", on_measure=when_first_cell_is_logged(second_dir, outage_then_back))
    assert sweep.run(compose_raw(args(server, outage_s=60)), second_dir, rerun) == 0
    counts = finished_counts(server)
    # figure: expected 10, finished 10, duplicated 0, lost 0
    assert (len(counts), sum(n > 1 for n in counts.values()), CELLS - len(counts)) == (CELLS, 0, 0)
    assert len(rerun.measured) == CELLS - len(measured)  # the journal's cells were uploaded, not re-measured
    assert not unlogged(read_entries(first_dir / JOURNAL_FILE))
    client = MlflowClient(server.uri)
    parent = [r for r in client.search_runs([client.get_experiment_by_name("hostsweep-outage").experiment_id])
              if "cell_key" not in r.data.tags and r.data.tags.get("run_dir") == str(first_dir)][0]
    assert parent.info.status == "KILLED" and "marked KILLED by a later sweep" in parent.data.tags[KILLED_REASON_TAG]


def test_credentials_in_the_tracking_uri_are_in_no_file_line_or_run(server, tmp_path):
    """http://user:password@host reaches MLflow, and nothing printed, logged or saved."""
    from tests.conftest import run_hostsweep

    secret = "s3cret-pw"
    host = server.uri.split("://", 1)[1]
    proc = run_hostsweep(["+sku=cpu", "engine.name=fake", "measure.T=5", "measure.reps=2", "measure.warmups=0",
                          "ctx=[16]", "batch=[1]", "split.enabled=false", "study=secrets",
                          f"tracking.uri=http://alice:{secret}@{host}", f"hydra.run.dir={tmp_path}/run"],
                         cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert secret not in proc.stdout + proc.stderr and "alice:***@" in proc.stdout
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path
    client = MlflowClient(server.uri)
    experiment = client.get_experiment_by_name("hostsweep-secrets")
    for run in client.search_runs([experiment.experiment_id]):
        assert secret not in str(run.data.params) + str(run.data.tags)
        if "cell_key" not in run.data.tags:
            config = client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path / "dl"))
            text = Path(config).read_text()
            assert secret not in text and "alice:***@" in text
