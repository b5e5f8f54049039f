"""Process hygiene: keep the harness from changing what it measures.

Driver side (local clusters): Ray's daemons are found and put under SCHED_IDLE. Worker
side: the thread caps, niceness, scheduling policy and CPU affinity Ray hands its actors
are undone before an engine starts, and each is recorded.
"""
from __future__ import annotations

import gc
import logging
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator, MutableMapping

import psutil

from hostsweep.run.liveness import process_title

log = logging.getLogger(__name__)

# Ray exports OMP_NUM_THREADS=<num_cpus> into actors it schedules. The engine's compute
# threads must be sized as in a plain process, or the harness changes what it measures
# (seen here: 2.9 -> 4.5 ms per step with num_cpus=1).
RAY_THREAD_ENV = ("OMP_NUM_THREADS",)
# Set by cluster.connect when it confines Ray's daemons to one core: every core of the node.
WORKER_AFFINITY_ENV = "HOSTSWEEP_WORKER_AFFINITY"


def release_ray_thread_limits(environ: dict[str, str]) -> dict[str, str]:
    """Drop the thread caps Ray sets for actors; return what was dropped, for the record."""
    return {key: environ.pop(key) for key in RAY_THREAD_ENV if key in environ}


def restore_affinity() -> None:
    """Take back every core of the node when the driver confined Ray's daemons (and so
    this worker, their child) to one; vLLM binds its threads from this set."""
    cores = os.environ.get(WORKER_AFFINITY_ENV)
    if cores:
        os.sched_setaffinity(0, {int(c) for c in cores.split(",")})


def restore_priority() -> str:
    """Undo the niceness Ray gives its workers (15 by default), which the engine's
    processes would inherit; returns what the worker runs at, for the record."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    if before > 0:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
        except PermissionError:  # unprivileged: start Ray with RAY_worker_niceness=0
            log.warning("worker runs at niceness %d and may not lower it", before)
    return f"{before}->{os.getpriority(os.PRIO_PROCESS, 0)}"


def restore_scheduler() -> str:
    """Run under the normal scheduling policy, whatever process started this one (a child
    inherits SCHED_IDLE: a cluster started by other means may have idled the raylet, the
    workers' parent); an engine under another policy would not measure what a plain process
    does, so that is an error."""
    if os.sched_getscheduler(0) != os.SCHED_OTHER:
        try:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        except PermissionError:
            raise RuntimeError(
                f"worker runs under scheduling policy {os.sched_getscheduler(0)}, not SCHED_OTHER, "
                "and may not leave it: its timings would not be a plain process's"
            ) from None
    return "other"


def process_name(pid: int) -> str:
    try:
        return process_title(psutil.Process(pid))
    except psutil.Error:
        return ""


def daemons_to_idle(pids: Iterable[int]) -> list[int]:
    """The processes ray.init started, less the raylet. The raylet starts the workers, and a
    child keeps its parent's SCHED_IDLE (and the confined daemons' one core): a worker of an
    idled raylet started its process and imports under SCHED_IDLE beside the driver opening
    MLflow, 2.1-3.2 s in four runs here against 1.4-2.6 s in three without, before it
    restores the normal policy; and idling the raylet bought nothing measurable while cells
    run (README, Benchmarks)."""
    return sorted(pid for pid in pids if process_name(pid) != "raylet")


def idle_process(pid: int) -> None:
    """SCHED_IDLE for every thread of `pid`: the policy is per thread, and the daemons'
    gRPC and event-loop threads already exist."""
    try:
        threads = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        return
    for tid in threads:
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except ProcessLookupError:
            pass
        except PermissionError as exc:
            log.warning("could not idle Ray process %d: %s", pid, exc)
            return


def descendant_pids(pid: int) -> list[int]:
    """Every live process below `pid`: here, the daemons ray.init started or an engine's
    EngineCore and its workers."""
    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


SCRATCH_PREFIX = "hostsweep-"


def new_scratch_folder() -> Path:
    """A worker's scratch folder in the node's temp dir, named for the worker's pid so a
    later worker can tell a dead one's leftovers (remove_stale_scratch)."""
    return Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-"))


# vLLM names its ZMQ IPC sockets after VLLM_RPC_BASE_PATH and its file-store rendezvous
# (vllm_dist_<hex>) in the system temp folder, and removes neither when its engine is closed
# or killed: 165 socket files were left in /tmp after one suite run and a few sweeps.
VLLM_IPC_ENV = "VLLM_RPC_BASE_PATH"


@contextmanager
def engine_temp_folder(folder: Path, environ: MutableMapping[str, str] = os.environ) -> Iterator[None]:
    """While an engine starts, have vLLM put its IPC sockets and rendezvous files in the
    worker's scratch folder, which goes with the worker (closed, killed, or reaped later).

    VLLM_RPC_BASE_PATH stays set (vLLM reads it when it opens a socket). The temp folder is
    redirected only while the engine starts, in this process (tempfile.tempdir, inherited
    by a forked EngineCore) and in the environment (TMPDIR, read by a spawned one): the
    worker's own temp files stay where other sweeps look for them."""
    environ[VLLM_IPC_ENV] = str(folder)
    before_env, before_dir = environ.get("TMPDIR"), tempfile.tempdir
    environ["TMPDIR"], tempfile.tempdir = str(folder), str(folder)
    try:
        yield
    finally:
        tempfile.tempdir = before_dir
        if before_env is None:
            environ.pop("TMPDIR", None)
        else:
            environ["TMPDIR"] = before_env


def remove_engine_temp_folder(folder: Path, environ: MutableMapping[str, str] = os.environ) -> None:
    """Remove an engine's scratch folder, and VLLM_RPC_BASE_PATH with it where it still names
    that folder: left set, the next vLLM process this one starts (another engine, or the
    all-reduce calibration's ranks, which inherit the environment) binds its sockets in a
    folder that no longer exists and fails."""
    shutil.rmtree(folder, ignore_errors=True)
    if environ.get(VLLM_IPC_ENV) == str(folder):
        environ.pop(VLLM_IPC_ENV)


@contextmanager
def scratch_for_vllm() -> Iterator[Path]:
    """A scratch folder that vLLM processes started inside the block put their IPC sockets
    and rendezvous files in (engine_temp_folder), removed with VLLM_RPC_BASE_PATH after."""
    folder = new_scratch_folder()
    try:
        with engine_temp_folder(folder):
            yield folder
    finally:
        remove_engine_temp_folder(folder)


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed worker whose parent died too may stay one a while)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def remove_stale_scratch(root: Path | None = None) -> list[Path]:
    """Remove scratch folders of workers that are gone (killed before they could clean up)."""
    root = root or Path(tempfile.gettempdir())
    removed = []
    for folder in root.glob(f"{SCRATCH_PREFIX}*"):
        match = re.match(rf"{SCRATCH_PREFIX}(\d+)-", folder.name)
        if folder.is_dir() and match and not _running(int(match.group(1))):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def release_shared_memory(timeout_s: float = 5.0) -> bool:
    """Let multiprocessing's resource tracker unlink what a closed engine left in /dev/shm;
    True if it did within timeout_s.

    vLLM's processes create their message queues as shared memory (160-250 MiB each) and
    register them with the tracker of the process that started the engine; a killed
    engine (every close, engines/vllm_engine.py) never unregisters them, and the tracker
    unlinks them when its last user closes it. But when a Ray worker ends, Ray SIGKILLs its
    child processes, the tracker among them, so each engine left its segments behind (23
    per test-suite run here). Call once the engine's processes are gone: a segment still
    registered by a live process would be unlinked too. The tracker restarts on next use.
    """
    import threading
    from multiprocessing import resource_tracker

    stop = getattr(getattr(resource_tracker, "_resource_tracker", None), "_stop", None)
    if stop is None:  # a Python without it (private API): leave the tracker to Ray
        return False
    # _stop waits for the tracker's exit, which waits for every holder of its pipe.
    waiter = threading.Thread(target=stop, daemon=True, name="release-shared-memory")
    waiter.start()
    waiter.join(timeout_s)
    return not waiter.is_alive()


def freeze_long_lived() -> None:
    """Collect, then freeze what lives now (libraries, the engine, the plan): a full garbage
    collection, which in a worker may fall inside a timed generate, then walks only what
    cells allocate. Collected first, so no garbage is frozen; frozen objects are still freed
    when nothing refers to them, but a cycle among them never is (a worker freezes only in
    an actor process of its own, not in a test's)."""
    gc.collect()
    gc.freeze()
