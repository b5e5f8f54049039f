"""kill -9 of vLLM's EngineCore mid-sweep, through the real CLI, Ray and the vLLM CPU engine.

The engine is killed in the middle of its group's interleaved rounds, once every cell has
timed pairs in its round file. vLLM's client then blocks in generate forever; the worker's
watch reports the dead process, the driver replaces the worker and retries the cell it had
asked for, and the new worker continues every cell from the pairs the killed one saved.
One engine start and one restart. Figure: 3 cells expected, 3 finished once, 0 duplicated,
0 lost, no timed pair measured twice. The sweep records into `mlflow server` on PostgreSQL
(tests/integration/conftest.py), so the real engine's cells also take the service's path.
"""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

import mlflow
import psutil
import pytest

from hostsweep.run.liveness import engine_processes, process_label


pytestmark = pytest.mark.integration


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def sweep_workers(procs: list[psutil.Process]) -> list[psutil.Process]:
    """The sweep's worker actors, known by the scratch folder each makes (hostsweep-<pid>-*),
    not by Ray's title: titles have been seen not to take in clean-clone CI runs."""
    return [p for p in procs if any(Path(tempfile.gettempdir()).glob(f"hostsweep-{p.pid}-*"))]


def engine_cores(procs: list[psutil.Process]) -> list[psutil.Process]:
    """vLLM's EngineCore below each worker: found as the sweep finds its engine
    (liveness.engine_processes: the VLLM:: titled processes, or, where setproctitle did not
    take, the worker's new children less multiprocessing's helpers), then the one the worker
    started itself (its VLLM::Worker is the EngineCore's child)."""
    cores = []
    for worker in sweep_workers(procs):
        cores += [p for p in engine_processes(worker.pid, ()) if p.ppid() == worker.pid]
    return cores


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def saved_pairs(pending: Path) -> list[int]:
    """Timed pairs in each cell's round file (a header line, then one line a pair)."""
    return [len(path.read_text().splitlines()) - 1 for path in pending.glob("*/rounds/*.jsonl")]


REPS = 8


def test_a_killed_engine_core_is_detected_its_cell_retried_and_every_cell_measured_once(tmp_path, pg_server):
    # Recorded into the PostgreSQL-backed server (conftest.py): the real-engine sweep into the
    # service as a cluster runs it, here with a fault on the way.
    uri = pg_server.uri
    run_dir, pending = tmp_path / "run", tmp_path / "pending"
    # T and reps keep the rounds going for several seconds after the first: on a loaded machine
    # this test must still find the engine alive once every cell has a pair saved.
    command = [sys.executable, "-m", "hostsweep", "+sku=cpu", "batch=[1,2,3]", "ctx=[32]", "measure.T=49",
               f"measure.reps={REPS}", "measure.warmups=1", "split.enabled=false", "measure.replicate_first=false",
               "measure.remeasure_unstable=0",
               f"tracking.uri={uri}", "study=enginedeath", f"hydra.run.dir={run_dir}", f"output.pending_dir={pending}"]
    driver = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and driver.poll() is None:  # a round of every cell is saved...
            saved = saved_pairs(pending)
            if len(saved) == 3 and min(saved) >= 1:
                break
            time.sleep(0.1)
        # ...and the next rounds are being timed: kill its engine.
        tree = descendants(driver.pid)
        cores = engine_cores(tree)
        assert len(cores) == 1, (f"EngineCore processes found: {len(cores)}; driver exit {driver.poll()}; "
                                 f"pairs saved {saved_pairs(pending)}; below the driver: "
                                 f"{[(p.pid, process_label(p)) for p in tree]}")
        (core,) = cores
        core_title = process_label(core)
        before = saved_pairs(pending)
        workers = sweep_workers(tree)
        core.send_signal(signal.SIGKILL)
        killed_at = time.time()
        out, _ = driver.communicate(timeout=600)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 0, out[-5000:]

    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=["hostsweep-enginedeath"])
    mlflow.set_tracking_uri(None)
    cells = runs[runs["tags.cell_key"].notna()]
    finished = Counter(cells[cells["status"] == "FINISHED"]["tags.cell_key"])
    assert (len(finished), sum(n > 1 for n in finished.values())) == (3, 0)  # 3 finished, 0 duplicated, 0 lost
    assert set(cells["metrics.reps_used"]) == {REPS} and 0 < max(before) < REPS
    worker_log = "".join(path.read_text() for path in (run_dir / "workers").glob("*.log"))
    continued = re.findall(r"continuing from (\d+) timed pair", worker_log)
    assert len(continued) == 3 and sum(map(int, continued)) >= sum(before)  # none timed twice
    assert not list(pending.glob("*/rounds/*.jsonl"))  # handed over: nothing left to continue
    retried = cells[cells["tags.attempt"] == "2"]
    assert len(retried) == 1 and set(cells["tags.attempt"]) == {"1", "2"}
    reason = retried.iloc[0]["tags.retry_reasons"]
    # Named by its title where setproctitle took (VLLM::EngineCore), else as the kernel names it.
    assert f"{core_title} (pid {core.pid}) killed by signal 9 (SIGKILL)" in reason
    print(f"the killed engine process, as the retry reason names it: {core_title}")
    assert "engine died" in reason
    # Noticed at once (the driver polls every 2 s), not at the cell timeout (10+ min).
    assert len([line for line in out.splitlines() if "retrying on a new worker" in line]) == 1
    # hostsweep.log has the full timestamp (the console shows the time of day only)
    (retry_line,) = [line for line in (run_dir / "hostsweep.log").read_text().splitlines()
                     if "retrying on a new worker" in line]
    stamp = datetime.strptime(retry_line[1:24], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    print(f"engine death noticed {stamp - killed_at:.1f} s after the kill: {retry_line}")
    assert stamp - killed_at < 20

    # The killed worker left nothing behind: its vLLM processes and its scratch folder.
    assert workers
    for worker in workers:
        assert not list(Path(tempfile.gettempdir()).glob(f"hostsweep-{worker.pid}-*"))
    time.sleep(5)
    assert not [p for p in tree if alive(p)], "processes of the sweep outlived it"
