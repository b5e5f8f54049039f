"""The reaper (run/reaper.py) with real processes and real /dev/shm segments, no Ray: the
watchdog kills a dead driver's marked processes and frees what they mapped; the next
sweep's sweep-up takes only what dead drivers left, never what a live process uses."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import psutil
import pytest

from hostsweep.run import leftovers, reaper

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir() or sys.platform != "linux", reason="Linux only")

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]

# A stand-in driver: marks its environment as cluster.connect does, starts the watchdog,
# then a marked process mapping a segment (an engine) and one started once the marker is
# gone (not the cluster's); prints their pids and the segment, and waits to be killed.
DRIVER = textwrap.dedent("""
    import os, subprocess, sys, time
    from hostsweep.run import reaper
    marker = reaper.marker_of(os.getpid())
    os.environ[reaper.MARKER_ENV] = marker
    watchdog = reaper.start_watchdog(marker)
    engine = subprocess.Popen([sys.executable, "-c", '''
    import sys, time
    from multiprocessing import resource_tracker, shared_memory
    seg = shared_memory.SharedMemory(create=True, size=1 << 20)
    resource_tracker.unregister(seg._name, "shared_memory")  # as a SIGKILLed tracker would leave it
    print(seg.name, flush=True)
    time.sleep(120)
    '''], stdout=subprocess.PIPE, text=True)
    segment = engine.stdout.readline().strip()
    del os.environ[reaper.MARKER_ENV]
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    print(engine.pid, other.pid, watchdog.pid, segment, flush=True)
    time.sleep(120)
""")


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_until(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def orphan_segment() -> Path:
    """A segment nobody maps or tracks: what a SIGKILLed engine and tracker leave."""
    seg = shared_memory.SharedMemory(create=True, size=4096)
    resource_tracker.unregister(seg._name, "shared_memory")
    seg.close()
    return Path("/dev/shm") / seg.name


def test_the_watchdog_kills_a_dead_drivers_marked_processes_and_frees_their_segments():
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True)
    engine = other = watchdog = 0
    try:
        engine, other, watchdog, name = driver.stdout.readline().split()
        engine, other, watchdog = int(engine), int(other), int(watchdog)
        segment = Path("/dev/shm") / name
        assert segment.exists() and alive(engine)
        driver.send_signal(signal.SIGKILL)
        driver.wait(10)
        assert wait_until(lambda: not alive(engine) and not alive(watchdog), 5.0)
        assert not segment.exists()
        assert alive(other)  # started without the marker: not the cluster's
    finally:
        for pid in (engine, other, watchdog):
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        driver.kill()


def test_a_segment_is_unlinked_only_when_no_live_process_maps_it_and_it_is_old_enough():
    mapped = shared_memory.SharedMemory(create=True, size=4096)
    orphan = orphan_segment()
    try:
        assert leftovers.unlink_unmapped([orphan], min_age_s=60) == []  # too young: may be about to be mapped
        assert leftovers.unlink_unmapped([Path("/dev/shm") / mapped.name, orphan]) == [orphan]
        assert (Path("/dev/shm") / mapped.name).exists()
    finally:
        orphan.unlink(missing_ok=True)
        mapped.close()
        mapped.unlink()


def env_with(marker: str) -> dict[str, str]:
    return {**os.environ, reaper.MARKER_ENV: marker}


def test_the_next_sweep_kills_only_processes_whose_driver_is_gone():
    live = reaper.marker_of(os.getpid())
    dead = f"{os.getpid()}:1.00"  # this pid, another start time: a driver long gone
    procs = {m: subprocess.Popen(SLEEPER, env=env_with(m)) for m in (live, dead)}
    try:
        assert wait_until(lambda: reaper.environ_marker(procs[dead].pid) == dead)
        assert reaper.marker_alive(live) and not reaper.marker_alive(dead)
        assert procs[dead].pid in reaper.kill_orphaned()
        assert wait_until(lambda: not alive(procs[dead].pid))
        assert procs[live].poll() is None
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


def test_only_the_ray_sessions_of_dead_hostsweep_clusters_are_removed(tmp_path):
    sessions = {name: tmp_path / f"session_2026-12-01_00-00-00_000000_{i}" for i, name in
                enumerate(("dead", "live", "not ours"))}
    for folder in sessions.values():
        (folder / "sockets").mkdir(parents=True)
    (sessions["dead"] / leftovers.SESSION_MARK).write_text(f"{os.getpid()}:1.00")
    (sessions["live"] / leftovers.SESSION_MARK).write_text(reaper.marker_of(os.getpid()))
    (tmp_path / "session_latest").symlink_to(sessions["dead"])
    assert leftovers.remove_dead_sessions(reaper.sweep_over, tmp_path) == [sessions["dead"]]
    assert sessions["live"].exists() and sessions["not ours"].exists()
    assert not (tmp_path / "session_latest").is_symlink()  # dangling once its session went
