"""The service as a cluster runs it: `mlflow server` on PostgreSQL, on loopback.

A throwaway PostgreSQL cluster (Debian's postgresql package: `make test-postgres` installs
it) in a temporary folder, `mlflow server --backend-store-uri postgresql://...` on
127.0.0.1 with proxied artifacts (`--artifacts-destination`), and fake-engine sweeps into
it: the server is killed and restarted mid-sweep (figures: 10 expected, 10 finished once,
0 duplicated, 0 lost), two drivers of one study run at once (no cell measured twice),
everything is read back the way the fit stage reads it, through the server and straight
from the database, `stage=fit` itself fits a sweep's cells read through the server, and a
driver writing straight into the server's database (a driver on the head) leaves runs and
files the server serves.
The server and PostgreSQL are tests/integration/conftest.py's, one for the session: a real
vLLM sweep records into it too (test_engine_death.py).
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from hostsweep.config.resolve import resolve
from hostsweep.record.journal import JOURNAL_FILE, read_entries, unlogged
from hostsweep.record.read.readback import read_cells
from hostsweep.stages import sweep
from tests.conftest import compose_raw
from tests.fakes import FakeBackend
from tests.integration.mlflow_server import MlflowServer, fake_sweep_into
from tests.integration.test_tracking_outage import when_first_cell_is_logged

pytestmark = pytest.mark.integration

CELLS = 10


def args(server: MlflowServer, study: str) -> list[str]:
    return [*fake_sweep_into(server.uri, CELLS, study), "tracking.outage_s=120", "tracking.stale_after_s=150",
            "tracking.exit_wait_s=120"]  # the restarted server may take a minute on a busy machine


def finished(server: MlflowServer, study: str) -> Counter:
    client = MlflowClient(server.uri)
    experiment = client.get_experiment_by_name(f"hostsweep-{study}")
    runs = client.search_runs([experiment.experiment_id], "attributes.status = 'FINISHED'", max_results=1000)
    return Counter(r.data.tags["cell_key"] for r in runs if "cell_key" in r.data.tags)


def test_a_sweep_into_a_postgresql_backed_server_that_is_killed_and_restarted_loses_and_duplicates_nothing(
        pg_server, postgres, tmp_path, monkeypatch):
    server = pg_server
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"

    def outage_then_back():
        server.kill()
        threading.Thread(target=lambda: (time.sleep(2), server.start()), daemon=True).start()

    backend = FakeBackend(tmp_path / "work", on_measure=when_first_cell_is_logged(run_dir, outage_then_back))
    assert sweep.run(compose_raw(args(server, "pg-outage")), run_dir, backend) == 0
    counts = finished(server, "pg-outage")
    # figure: expected 10, finished 10, duplicated 0, lost 0
    assert (len(counts), sum(n > 1 for n in counts.values()), CELLS - len(counts)) == (CELLS, 0, 0)
    assert not unlogged(read_entries(run_dir / JOURNAL_FILE))
    # read back as the fit stage reads it: through the server, and straight from PostgreSQL
    through_server = read_cells(server.uri, ["hostsweep-pg-outage"])
    from_database = read_cells(postgres.uri, ["hostsweep-pg-outage"])
    assert len(through_server) == len(from_database) == CELLS
    assert sorted(through_server["run_id"]) == sorted(from_database["run_id"])
    assert (through_server.set_index("run_id")["step_ms"].sort_index()
            == from_database.set_index("run_id")["step_ms"].sort_index()).all()


def test_two_drivers_of_one_study_at_once_measure_no_cell_twice(pg_server, tmp_path, monkeypatch):
    server = pg_server
    monkeypatch.chdir(tmp_path)
    second: dict[str, object] = {}

    def start_second_driver_midway(cell):
        if not second:
            second["backend"] = FakeBackend(tmp_path / "work2")
            second["code"] = sweep.run(compose_raw(args(server, "pg-two")), tmp_path / "run2", second["backend"])

    first = FakeBackend(tmp_path / "work1", on_measure=start_second_driver_midway)
    assert sweep.run(compose_raw(args(server, "pg-two")), tmp_path / "run1", first) == 0
    assert second["code"] == 0
    measured = first.measured + second["backend"].measured
    assert sorted(measured) == sorted(set(measured))  # no cell measured twice
    counts = finished(server, "pg-two")
    assert (len(counts), sum(n > 1 for n in counts.values())) == (CELLS, 0)


def test_the_fit_stage_reads_its_cells_back_through_the_server(pg_server, tmp_path, monkeypatch):
    """stage=fit on a sweep recorded into the server: the cells come back through the
    server's API (no database URI is given), and the model is logged into the server."""
    server = pg_server
    import json

    import yaml

    from hostsweep.stages import fit

    monkeypatch.chdir(tmp_path)
    calibration = tmp_path / "calibration.yaml"  # the CPU's terms given, so nothing is microbenchmarked
    calibration.write_text(yaml.safe_dump({"allreduce": {"cpu": {"latency_us": 40.0, "bandwidth_gbps": 5.0, "path": "engine"}},
                                           "roofs": {"cpu": {"measured_tflops": 0.5, "measured_bandwidth_gbps": 20.0}},
                                           "host": {"s0_ms": 0.5, "s1_ms": 0.0}}))
    study = [f"tracking.uri={server.uri}", "study=pg-fit", "tp=[1,2]", "batch=[1,2]", "ctx=[16]", "+sku=cpu",
             "engine.name=fake", "ray.exclusive=false"]
    sweep_args = [*study, "measure.T=5", "measure.reps=3", "measure.warmups=0",
                  "split.enabled=false"]
    assert sweep.run(compose_raw(sweep_args), tmp_path / "sweep", FakeBackend(tmp_path / "work")) == 0
    fit_args = [*study, "stage=fit", "fit.resamples=200", f"fit.calibration_file={calibration}", "fit.host=calibration",
                "fit.exclude_unstable=false"]  # fake cells on a busy test machine: the fit runs whatever their spread
    assert fit.run(compose_raw(fit_args), tmp_path / "fit") == 0
    (fitted,) = (tmp_path / "fit").rglob("fit.json")
    report = json.loads(fitted.read_text())
    run_ids = {run.info.run_id for run in MlflowClient(server.uri).search_runs(
        [MlflowClient(server.uri).get_experiment_by_name("hostsweep-pg-fit").experiment_id], "tags.cell_key != ''")}
    assert len(run_ids) == 4 and len(report["cells"]) == 4  # every cell, read through the server
    assert {cell["run_id"] for cell in report["cells"]} == run_ids
    client = MlflowClient(server.uri)
    models = client.get_experiment_by_name(resolve(compose_raw(fit_args)).config.fit.models_experiment)
    assert client.search_runs([models.experiment_id])  # the model went to the server too


def test_a_driver_writing_into_the_servers_database_leaves_what_the_server_serves(
        pg_server, postgres, tmp_path, monkeypatch):
    """A driver on the head: tracking.uri the server's PostgreSQL, tracking.artifacts its
    --artifacts-destination. A study the server made (a remote driver's first sweep) goes
    on from the database, and what it measures there (runs, files) the server serves like
    its own."""
    import pandas as pd

    server = pg_server
    monkeypatch.chdir(tmp_path)
    study = "pg-direct"
    first = FakeBackend(tmp_path / "work1")
    assert sweep.run(compose_raw(fake_sweep_into(server.uri, 3, study)), tmp_path / "remote", first) == 0
    direct = [*fake_sweep_into(postgres.uri, 6, study), f"tracking.artifacts={(server.root / 'artifacts').as_uri()}"]
    second = FakeBackend(tmp_path / "work2")
    assert sweep.run(compose_raw(direct), tmp_path / "head", second) == 0
    assert len(second.measured) == 3  # the three the server has are resumed
    counts = finished(server, study)
    assert (len(counts), max(counts.values())) == (6, 1)
    rows = pd.read_csv(tmp_path / "head" / "cells.csv")
    client = MlflowClient(server.uri)
    for run_id in rows.loc[~rows["resumed"], "mlflow_run_id"]:
        assert "raw_timings.csv" in {a.path for a in client.list_artifacts(run_id)}
        timings = Path(client.download_artifacts(run_id, "raw_timings.csv", str(tmp_path)))
        assert timings.read_text().startswith("rep,") and len(timings.read_text().splitlines()) > 1
    parent = client.get_run(rows.loc[~rows["resumed"], "mlflow_run_id"].iloc[0]).data.tags["mlflow.parentRunId"]
    assert "cells.csv" in {a.path for a in client.list_artifacts(parent)}
    # a study the driver on the head begins itself is laid out as the server would lay it out
    made_here = [*fake_sweep_into(postgres.uri, 2, "pg-direct-new"),
                 f"tracking.artifacts={(server.root / 'artifacts').as_uri()}"]
    assert sweep.run(compose_raw(made_here), tmp_path / "head-new", FakeBackend(tmp_path / "work3")) == 0
    new_rows = pd.read_csv(tmp_path / "head-new" / "cells.csv")
    assert all("raw_timings.csv" in {a.path for a in client.list_artifacts(run_id)}
               for run_id in new_rows["mlflow_run_id"])
