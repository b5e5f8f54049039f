"""The driver through the real CLI and a real local Ray cluster (fake engine): the embedded
cluster listens on loopback only, and SIGTERM (what `timeout`, SLURM and Kubernetes send)
stops a sweep the way Ctrl-C does: runs KILLED with the reason, Ray and workers gone."""
from __future__ import annotations

import ipaddress
import signal
import subprocess
import sys
import time

import mlflow
import psutil
import pytest

from hostsweep.record.journal import JOURNAL_FILE, read_entries

pytestmark = pytest.mark.integration


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def listening(procs: list[psutil.Process]) -> list[tuple[str, str, int]]:
    found = []
    for proc in procs:
        try:
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    found.append((proc.name(), conn.laddr.ip, conn.laddr.port))
        except psutil.Error:
            pass
    return found


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def test_sigterm_stops_a_sweep_like_ctrl_c_on_a_cluster_that_listens_on_loopback_only(tmp_path, new_store):
    uri = new_store(tmp_path / "mlflow.db")  # an empty store: the sweep gets to measuring sooner
    run_dir = tmp_path / "run"
    # Groups of two cells timed together: cells are still to be timed when the first is reported.
    command = [sys.executable, "-m", "hostsweep", "+sku=cpu", "engine.name=fake", "measure.T=400",
               "measure.reps=3", "measure.warmups=1", "ctx=[16]", "batch=[1,2,3,4,5,6]", "split.enabled=false",
               "measure.interleave_max_cells=2", f"tracking.uri={uri}", "study=sigterm", f"hydra.run.dir={run_dir}"]
    driver = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and driver.poll() is None:
            journal = run_dir / JOURNAL_FILE
            if journal.is_file() and any(e["event"] == "measured" for e in read_entries(journal)):
                break
            time.sleep(0.2)
        tree = psutil.Process(driver.pid).children(recursive=True)
        sockets = listening([psutil.Process(driver.pid), *tree])
        driver.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        out, err = driver.communicate(timeout=120)
        took = time.monotonic() - sent
    finally:
        if driver.poll() is None:
            driver.kill()

    assert sockets and all(is_loopback(ip) for _, ip, _ in sockets), sockets  # GCS, raylet, workers, agents
    assert driver.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("hostsweep: interrupted by SIGTERM")]
    assert took < 60
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(alive(p) for p in tree):
        time.sleep(0.5)
    assert not [p.name() for p in tree if alive(p)], "Ray or worker processes outlived the driver"

    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=["hostsweep-sigterm"])
    mlflow.set_tracking_uri(None)
    parent = runs[runs["tags.cell_key"].isna()]
    cells = runs[runs["tags.cell_key"].notna()]
    assert list(parent["status"]) == ["KILLED"]
    finished = cells[cells["status"] == "FINISHED"]
    assert len(finished) >= 1 and (cells["status"] == "FINISHED").all()  # none left RUNNING
    # the claimed cells it did not measure: counted on the parent, whose end voids its claims
    assert int(parent["tags.not_measured"].iloc[0]) == 6 - len(finished)
    assert parent["tags.not_measured_reason"].str.contains("interrupted").all()
