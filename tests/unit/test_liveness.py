"""The worker's watch over its engine's processes, and the lifetime of its scratch folder and
of the shared memory its engine leaves."""
from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from hostsweep.config.grid import build_cells
from hostsweep.measure.results import MeasureOptions
from hostsweep.run.faults import EngineDied
from hostsweep.run.hygiene import VLLM_IPC_ENV, engine_temp_folder, remove_stale_scratch
from hostsweep.run.liveness import EngineWatch, describe_exit, engine_processes
from hostsweep.run.worker import SweepWorker
from tests.conftest import compose_typed

FAKE = ["+sku=cpu", "engine.name=fake", "measure.T=5", "measure.reps=2", "measure.warmups=0",
        "split.enabled=false", "ctx=[16]", "batch=[1]"]


def sleeper(script: str = "import time; time.sleep(60)") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script])


def wait_for(predicate, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    return predicate()


@pytest.mark.parametrize("how,expected", [
    (lambda p: p.send_signal(signal.SIGKILL), "killed by signal 9 (SIGKILL)"),
    (lambda p: p.send_signal(signal.SIGTERM), "killed by signal 15 (SIGTERM)"),
])
def test_a_killed_engine_process_is_reported_with_its_signal(how, expected):
    child = sleeper()
    watch = EngineWatch([psutil.Process(child.pid)])
    assert watch.fault() is None
    how(child)
    reason = wait_for(watch.fault)
    assert reason is not None and f"(pid {child.pid}) {expected}" in reason
    child.wait()


def test_an_engine_process_that_exits_is_reported_with_its_code():
    child = sleeper("import sys; sys.exit(3)")
    watch = EngineWatch([psutil.Process(child.pid)])
    assert "exited with code 3" in wait_for(watch.fault)
    child.wait()


def test_an_engine_closed_on_purpose_is_no_fault():
    child = sleeper()
    watch = EngineWatch([psutil.Process(child.pid)])
    watch.kill()  # what abort does
    child.wait()
    assert watch.fault() is None


def test_closing_waits_until_the_engine_processes_are_gone():
    child = sleeper("import time; time.sleep(0.5)")
    watch = EngineWatch([psutil.Process(child.pid)])
    started = time.monotonic()
    assert watch.wait_gone(10.0) == []
    assert 0.3 < time.monotonic() - started < 5.0
    child.wait()


def test_engine_processes_still_there_after_the_wait_are_named_and_killed():
    child = sleeper()
    proc = psutil.Process(child.pid)
    name = proc.name()
    watch = EngineWatch([proc])
    assert watch.wait_gone(0.2) == [f"{name} (pid {child.pid})"]
    assert child.wait(timeout=5) == -signal.SIGKILL


# A killed child leaves its registered shared memory to the parent's resource tracker, as
# a closed vLLM engine does (run/hygiene.release_shared_memory).
LEAVES_SHARED_MEMORY = """
import multiprocessing as mp, os, sys, time
from multiprocessing import shared_memory
from hostsweep.run.hygiene import release_shared_memory

def child(names):
    names.put(shared_memory.SharedMemory(create=True, size=1 << 20).name)
    time.sleep(60)

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    names = ctx.Queue()
    proc = ctx.Process(target=child, args=(names,))
    proc.start()
    name = names.get(timeout=60)
    proc.kill()
    proc.join()
    left = os.path.exists("/dev/shm/" + name)
    released = release_shared_memory() if sys.argv[1] == "release" else None
    print(left, released, os.path.exists("/dev/shm/" + name))
    os._exit(0)  # as Ray ends a worker: the tracker gets no chance of its own
"""


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_shared_memory_a_killed_engine_left_is_unlinked_once_it_is_gone(tmp_path):
    script = tmp_path / "leaves_shared_memory.py"
    script.write_text(LEAVES_SHARED_MEMORY)
    run = subprocess.run([sys.executable, str(script), "release"], capture_output=True, text=True, timeout=120,
                         cwd=os.getcwd())
    assert run.stdout.split() == ["True", "True", "False"], run.stderr


def test_the_engine_is_what_started_after_the_snapshot_less_multiprocessing_helpers():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    old = sleeper()
    before.add(old.pid)
    new = sleeper()
    try:
        assert [p.pid for p in engine_processes(os.getpid(), before)] == [new.pid]
    finally:
        for child in (old, new):
            child.kill()
            child.wait()


def test_describe_exit_names_signals_and_codes():
    assert describe_exit(os.CLD_KILLED, 9) == "killed by signal 9 (SIGKILL)"
    assert describe_exit(os.CLD_EXITED, 1) == "exited with code 1"


def worker_with_engine_child(tmp_path):
    (cell,) = build_cells(compose_typed(FAKE))
    worker = SweepWorker(cell.engine, str(tmp_path))
    child = sleeper()
    worker.watch = EngineWatch([psutil.Process(child.pid)])  # as if the engine had started it
    return worker, cell, child


def test_a_worker_whose_engine_died_raises_engine_died_instead_of_failing_the_cell(tmp_path):
    worker, cell, child = worker_with_engine_child(tmp_path)
    options = MeasureOptions.of(compose_typed(FAKE).config)
    assert worker.measure(cell, options).status == "FINISHED"
    child.kill()
    wait_for(worker.engine_health)
    with pytest.raises(EngineDied, match="SIGKILL"):
        worker.measure(cell, options)
    child.wait()


def test_a_generate_that_fails_because_the_engine_died_raises_engine_died(tmp_path):
    worker, cell, child = worker_with_engine_child(tmp_path)

    def generate(prompts, tokens):
        child.kill()
        wait_for(lambda: psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE)
        raise RuntimeError("EngineCore encountered an issue")

    worker.engine.generate = generate
    with pytest.raises(EngineDied, match="SIGKILL"):
        worker.measure(cell, MeasureOptions.of(compose_typed(FAKE).config))
    child.wait()


def test_a_worker_removes_its_scratch_folder_when_closed_or_aborted(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    (cell,) = build_cells(compose_typed(FAKE))
    for end in ("close", "abort"):
        worker = SweepWorker(cell.engine)
        assert worker.scratch.is_dir() and worker.scratch.name.startswith(f"hostsweep-{os.getpid()}-")
        getattr(worker, end)()
        assert not worker.scratch.exists(), end


@pytest.mark.parametrize("end", ["close", "abort"])
def test_a_worker_ends_its_engines_processes_then_releases_their_shared_memory(tmp_path, monkeypatch, end):
    released = []
    monkeypatch.setattr("hostsweep.run.worker.release_shared_memory", lambda: released.append(True) or True)
    (cell,) = build_cells(compose_typed(FAKE))
    worker = SweepWorker(cell.engine, str(tmp_path))
    engine_process = sleeper("import time; time.sleep(0.3)" if end == "close" else "import time; time.sleep(60)")
    worker.watch = EngineWatch([psutil.Process(engine_process.pid)])
    getattr(worker, end)()
    assert engine_process.poll() is not None  # gone (exited, or killed by abort) before the release
    assert released == [True]
    engine_process.wait()


def test_scratch_folders_of_dead_workers_are_removed_and_live_ones_kept(tmp_path):
    dead = sleeper("pass")
    dead.wait()
    stale, live = tmp_path / f"hostsweep-{dead.pid}-abc", tmp_path / f"hostsweep-{os.getpid()}-def"
    for folder in (stale, live):
        (folder / "models").mkdir(parents=True)
    assert remove_stale_scratch(tmp_path) == [stale]
    assert live.is_dir() and not stale.exists()


def test_an_engine_process_reaped_by_its_starter_before_the_watch_looks_still_reports_its_signal():
    """vLLM joins its dead EngineCore as soon as it notices: the status then comes from the
    multiprocessing handle, whichever of the two reads it first."""
    import multiprocessing

    child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
    child.start()
    watch = EngineWatch([psutil.Process(child.pid)])
    child.kill()
    child.join()  # reaped, as vLLM's shutdown does
    assert f"(pid {child.pid}) killed by signal 9 (SIGKILL)" in wait_for(watch.fault)


def test_an_engine_started_in_its_temp_folder_names_its_sockets_and_rendezvous_there(tmp_path, monkeypatch):
    """vLLM's IPC sockets (VLLM_RPC_BASE_PATH) and vllm_dist_* files (the temp folder, in a
    forked or a spawned EngineCore) go to the worker's scratch folder while the engine starts;
    afterwards the worker's own temp folder is what it was."""
    monkeypatch.delenv("TMPDIR", raising=False)
    monkeypatch.delenv(VLLM_IPC_ENV, raising=False)
    before = tempfile.gettempdir()
    with engine_temp_folder(tmp_path):
        assert tempfile.gettempdir() == str(tmp_path)
        for method in ("fork", "spawn"):
            with multiprocessing.get_context(method).Pool(1) as pool:
                assert pool.apply(tempfile.gettempdir) == str(tmp_path), method
    assert tempfile.gettempdir() == before and "TMPDIR" not in os.environ
    assert os.environ[VLLM_IPC_ENV] == str(tmp_path)  # vLLM reads it each time it opens a socket


def test_removing_an_engines_scratch_folder_unsets_the_ipc_path_that_names_it(tmp_path, monkeypatch):
    """A closed engine's folder must not stay named in VLLM_RPC_BASE_PATH: the next vLLM
    process this one starts (the all-reduce calibration's ranks) would bind its sockets in a
    folder that is gone. A path set to another folder is left alone."""
    from hostsweep.run.hygiene import remove_engine_temp_folder, scratch_for_vllm

    monkeypatch.delenv(VLLM_IPC_ENV, raising=False)
    folder = tmp_path / "engine"
    folder.mkdir()
    with engine_temp_folder(folder):
        pass
    remove_engine_temp_folder(folder)
    assert not folder.exists() and VLLM_IPC_ENV not in os.environ
    monkeypatch.setenv(VLLM_IPC_ENV, str(tmp_path / "someone-elses"))
    folder.mkdir()
    remove_engine_temp_folder(folder)
    assert os.environ[VLLM_IPC_ENV] == str(tmp_path / "someone-elses")
    monkeypatch.delenv(VLLM_IPC_ENV)
    with scratch_for_vllm() as scratch:
        assert scratch.is_dir() and os.environ[VLLM_IPC_ENV] == str(scratch)
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            assert pool.apply(os.getenv, (VLLM_IPC_ENV,)) == str(scratch)
    assert not scratch.exists() and VLLM_IPC_ENV not in os.environ


@pytest.mark.parametrize("kernel_name, command, title", [
    ("python", ["VLLM::EngineCore", "", ""], "VLLM::EngineCore"),  # the kernel's name not yet the title
    ("VLLM::EngineCor", ["/usr/bin/python3", "-c", "x"], "VLLM::EngineCor"),  # the command line not rewritten
    ("python", ["/usr/bin/python3", "-m", "hostsweep"], "python"),
])
def test_a_process_is_named_by_its_vllm_title_wherever_it_shows(kernel_name, command, title):
    from hostsweep.run.liveness import process_title

    class Seen:
        def name(self) -> str:
            return kernel_name

        def cmdline(self) -> list[str]:
            return command

    assert process_title(Seen()) == title
