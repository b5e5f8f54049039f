"""What a user sees when the MLflow server dies mid-sweep, through the real command line:
one clear line as soon as the store stops answering (measuring goes on, the cells are kept
in the journal), none of the HTTP library's retry chatter on the console (it goes to
hostsweep.log), a final summary that says the cells were not recorded to MLflow instead of
a normal-looking MLflow line, and an exit bounded by tracking.exit_wait_s once measuring
is over, not by the whole tracking.outage_s.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest

from tests.integration.mlflow_server import MlflowServer as Server

pytestmark = pytest.mark.integration

CELLS = 4
EXIT_WAIT_S = 5


@pytest.fixture
def server(tmp_path, new_store):
    server = Server(tmp_path / "server")
    server.root.mkdir()
    new_store(server.root / "mlflow.db")
    server.start()
    yield server
    if server.proc.poll() is None:
        server.kill()


def kill_once_every_cell_is_claimed(server: Server, run_dir: Path, killed: list[float]) -> None:
    """Measuring starts once the sweep has claimed its cells and checked its claims against
    other sweeps': it logs "planned:" then. The outage falls after that, while the cells are
    measured (killed between the claims and their check, the sweep would stop before
    measuring, as it should)."""
    log = run_dir / "hostsweep.log"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if log.is_file() and "planned:" in log.read_text():
            server.kill()
            killed.append(time.monotonic())
            return
        time.sleep(0.1)


def test_an_outage_is_said_at_once_kept_off_the_console_and_ends_within_the_exit_wait(server, tmp_path):
    killed: list[float] = []
    run_dir = tmp_path / "run"
    watcher = threading.Thread(target=kill_once_every_cell_is_claimed, args=(server, run_dir, killed), daemon=True)
    watcher.start()
    # the kill falls once the cells are claimed, before the first is measured (the engine
    # takes seconds to start; the fake engine slowed 20 times keeps the cells in flight)
    command = [sys.executable, "-m", "hostsweep", "+sku=cpu", "engine.name=fake", "measure.T=5", "measure.reps=3",
               "measure.warmups=0", "ctx=[16]", f"batch=[{','.join(map(str, range(1, CELLS + 1)))}]",
               "split.enabled=false", "ray.exclusive=false", "study=outage-cli", f"tracking.uri={server.uri}",
               "tracking.heartbeat_s=1", "tracking.outage_s=120", f"tracking.exit_wait_s={EXIT_WAIT_S}",
               f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HOSTSWEEP_FAKE_TIME_SCALE": "20"}
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    ended = datetime.now()
    console = proc.stdout + proc.stderr
    assert killed, console[-3000:]
    assert proc.returncode == 1, console[-3000:]
    assert "Traceback" not in console

    # one clear line, at once: the store is unreachable and what happens to the cells
    (first,) = [line for line in console.splitlines() if "MLflow is unreachable" in line]
    assert "Measuring goes on" in first and "kept in the journal" in first
    # the HTTP library's retries are in the log file, not on the console
    assert "Retrying (" not in console
    log = (run_dir / "hostsweep.log").read_text()
    assert "MLflow is unreachable" in log and "urllib3.connectionpool][WARNING] - Retrying (" in log
    # the final summary says where the cells are instead of naming a parent run
    assert "not recorded to MLflow" in console and "kept in the journal" in console
    assert "parent run" not in console
    assert (run_dir / "journal.jsonl").is_file()
    # from the last measured cell to the exit: the exit wait, the results (figures) and Ray's
    # stop, not the 120 s of tracking.outage_s (before tracking.exit_wait_s: 123 s)
    (last,) = [line for line in console.splitlines() if f"[{CELLS}/{CELLS}]" in line and "ms/step" in line]
    measured = datetime.combine(ended.date(), datetime.strptime(last.split()[0], "%H:%M:%S").time())
    assert (ended - measured).total_seconds() < EXIT_WAIT_S + 25, f"{ended - measured} from the last cell to the exit"
