"""A password in the tracking URI stays out of everything `stage=all` prints, logs or
saves: the sweep, the fit and the comparison report (report.md, report.html, their MLflow
artifacts), the console lines that name the store, the command line quoted in the report,
and Hydra's files. Through the real command line, against a real `mlflow server` on
loopback that the URI with the password reaches.

The engine is the fake one and the fixed terms come from a calibration file, so the one
command takes the time of a local Ray start and three MLflow-logged stages (about a
minute here), not of vLLM or the calibration microbenchmarks.
"""
from __future__ import annotations

import pytest
import yaml
from mlflow.tracking import MlflowClient

from tests.conftest import run_hostsweep
from tests.integration.mlflow_server import MlflowServer as Server

pytestmark = pytest.mark.integration

SECRET = "pw-7f3a9c"


@pytest.fixture(scope="module")
def server(tmp_path_factory, new_store):
    server = Server(tmp_path_factory.mktemp("mlflow-server"))
    new_store(server.root / "mlflow.db")
    server.start()
    yield server
    if server.proc.poll() is None:
        server.kill()


@pytest.fixture(scope="module")
def stage_all(server, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("secret-all")
    calibration = root / "calibration.yaml"  # the CPU's roofs and all-reduce, so nothing is microbenchmarked
    calibration.write_text(yaml.safe_dump({"allreduce": {"cpu": {"latency_us": 40.0, "bandwidth_gbps": 5.0, "path": "engine"}},
                                           "roofs": {"cpu": {"measured_tflops": 0.5,
                                                             "measured_bandwidth_gbps": 20.0}}}))
    host = server.uri.split("://", 1)[1]
    args = ["+sku=cpu", "engine.name=fake", "stage=all", "study=pw", "tp=[1,2]", "batch=[1,2]", "ctx=[16]",
            "measure.T=5", "measure.reps=3", "measure.warmups=0",
            "fit.resamples=200", f"fit.calibration_file={calibration}", "ray.exclusive=false",
            "fit.exclude_unstable=false",  # fake cells on a busy test machine: the fit runs whatever their spread
            f"tracking.uri=http://alice:{SECRET}@{host}", f"hydra.run.dir={root}/run"]
    proc = run_hostsweep(args, cwd=root, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return {"root": root, "run": root / "run", "proc": proc, "client": MlflowClient(server.uri)}


def test_stage_all_reaches_the_store_and_names_it_without_the_password(stage_all):
    proc = stage_all["proc"]
    assert SECRET not in proc.stdout + proc.stderr
    (store_line,) = [line for line in proc.stdout.splitlines() if line.startswith("MLflow: run compare-pw")]
    assert "http://alice:***@127.0.0.1:" in store_line
    report = (stage_all["run"] / "compare" / "report.md").read_text()
    assert "Store `http://alice:***@127.0.0.1:" in report
    assert "tracking.uri=http://alice:***@127.0.0.1:" in report  # the command line it was made by


def test_no_file_of_the_run_holds_the_password(stage_all):
    files = [p for p in stage_all["root"].rglob("*") if p.is_file()]
    assert any(p.name == "report.html" for p in files) and any(p.parent.name == ".hydra" for p in files)
    assert (stage_all["run"] / "hostsweep.log").is_file() and not (stage_all["run"] / "__main__.log").exists()
    assert [p for p in files if SECRET.encode() in p.read_bytes()] == []


def test_no_run_param_tag_or_artifact_in_mlflow_holds_the_password(stage_all, tmp_path):
    client: MlflowClient = stage_all["client"]
    experiments = client.search_experiments()
    assert {"hostsweep-pw", "models", "calibration"} <= {e.name for e in experiments}
    runs = client.search_runs([e.experiment_id for e in experiments], max_results=1000)
    assert any(r.data.tags.get("hostsweep.kind") == "compare" for r in runs)
    for run in runs:
        assert SECRET not in str(run.data.params) + str(run.data.tags) + str(run.info), run.info.run_id
        folder = tmp_path / run.info.run_id
        client.download_artifacts(run.info.run_id, "", str(folder))
        leaks = [p for p in folder.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
        assert leaks == [], leaks
