"""Nothing of a local-cluster sweep outlives its driver: a watchdog, and the next sweep's sweep-up.

A driver killed with SIGKILL cannot stop what it started. Ray's own daemons die with it
(Ray starts them with PR_SET_PDEATHSIG), but its agents wait for a GCS that is gone (40 s
and more here), the worker's engine lingers until vLLM notices, and the shared memory of
vLLM's message queues (160-250 MiB each, registered with a resource tracker Ray kills too)
stays in /dev/shm until reboot. So:

- ray.init's daemons start with a marker in their environment (MARKER_ENV: the driver's
  pid and start time), which tells them from what the driver starts later;
- a watchdog process (`python -m hostsweep.run.reaper`), started with the cluster, notes
  every second the cluster's processes (the marked daemons and everything below them:
  agents, workers, engines) in a ledger file, and waits for the driver to die
  (PR_SET_PDEATHSIG, and polled) or for the cluster's shutdown (SIGTERM). Then it kills
  them, unlinks the /dev/shm segments they mapped that no live process maps, and removes
  the scratch folders of dead workers;
- the next local sweep reclaims what even the watchdog could not (it was killed too):
  the processes in the ledgers of dead drivers (or still showing their marker: a process
  that sets its title, as Ray's and vLLM's do, may overwrite it), /dev/shm/psm_* segments
  no live process maps, scratch folders of dead workers and the Ray session folders of
  dead hostsweep clusters.
What a live process uses is never touched: a process is killed only once the driver of its
sweep is gone (pid and start time), a segment only while no process maps it (and, unless
its killer just saw it mapped, once it is SEGMENT_MIN_AGE_S old: it may be between its
creation and its mapping).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable, Optional

import psutil

from hostsweep.run.hygiene import remove_stale_scratch
from hostsweep.run.leftovers import (
    SEGMENT_MIN_AGE_S, mapped_segments, orphan_segments, remove_dead_sessions, unlink_unmapped,
)

log = logging.getLogger(__name__)

MARKER_ENV = "HOSTSWEEP_SWEEP"
POLL_S = 1.0
PR_SET_PDEATHSIG = 1


def marker_of(pid: int) -> str:
    """'<pid>:<start time>': unique to one process on this machine (pids are reused)."""
    return f"{pid}:{psutil.Process(pid).create_time():.2f}"


def marker_alive(marker: str) -> bool:
    """Whether the driver a marker names still runs."""
    pid, _, started = marker.partition(":")
    try:
        return pid.isdigit() and f"{psutil.Process(int(pid)).create_time():.2f}" == started
    except psutil.Error:
        return False


def environ_marker(pid: int) -> Optional[str]:
    """The sweep marker in a process's (initial) environment, or None."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    key = f"{MARKER_ENV}=".encode()
    for entry in raw.split(b"\0"):
        if entry.startswith(key):
            return entry[len(key):].decode(errors="replace")
    return None


def marked_pids(marker: Optional[str] = None) -> dict[int, str]:
    """Processes whose environment still shows `marker` (any marker when None), less this
    one: pid -> marker. Not every one of a sweep: a process that sets its title
    (setproctitle: Ray's workers and agents, vLLM's) overwrites its environment's record."""
    found = {}
    for pid in psutil.pids():
        if pid != os.getpid():
            mark = environ_marker(pid)
            if mark is not None and (marker is None or mark == marker):
                found[pid] = mark
    return found


def parent_map() -> dict[int, list[int]]:
    """Children by parent pid, from one pass over /proc."""
    children: dict[int, list[int]] = {}
    for proc in psutil.process_iter(["ppid"]):
        children.setdefault(proc.info["ppid"], []).append(proc.pid)
    return children


def with_descendants(pids: Iterable[int], children: dict[int, list[int]]) -> set[int]:
    found, todo = set(), list(pids)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo += children.get(pid, [])
    return found


def _started(pid: int) -> Optional[str]:
    try:
        return f"{psutil.Process(pid).create_time():.2f}"
    except psutil.Error:
        return None


def cluster_processes(driver: int, marker: str, known: dict[int, str]) -> dict[int, str]:
    """pid -> start time of the cluster's processes: the driver's children that carry the
    marker (ray.init's daemons: a child of the driver's that started without it is not the
    cluster's), the ones already known and still the same, everything below them."""
    children = parent_map()
    roots = [pid for pid in children.get(driver, []) if environ_marker(pid) == marker]
    roots += [pid for pid, started in known.items() if _started(pid) == started]
    found = {}
    for pid in with_descendants(roots, children) - {os.getpid()}:
        started = _started(pid)
        if started is not None:
            found[pid] = started
    return found


def _living(pids: Iterable[int]) -> list[psutil.Process]:
    procs = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                procs.append(proc)
        except psutil.Error:
            pass
    return procs


def kill_sweep(marker: str, known: dict[int, str], timeout_s: float = 10.0) -> tuple[list[int], set[Path]]:
    """SIGKILL the sweep's processes (the known ones still the same, what they started,
    and whatever shows the marker) until none is left; the pids killed and the segments
    they mapped."""
    killed: list[int] = []
    segments: set[Path] = set()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        same = [pid for pid, started in known.items() if _started(pid) == started]
        procs = _living((with_descendants(same, parent_map()) | set(marked_pids(marker))) - {os.getpid()})
        if not procs:
            break
        segments |= mapped_segments(p.pid for p in procs)  # read before the kill: the maps go with it
        for proc in procs:
            try:
                proc.kill()
                killed.append(proc.pid)
            except psutil.Error:
                pass
        psutil.wait_procs(procs, timeout=1.0)
    return killed, segments


# What each live sweep's watchdog knows of its cluster, for the next sweep should the
# watchdog be killed too: one file per sweep, {"marker": ..., "processes": {pid: start}}.
# Per user, private: a ledger names processes to kill.
LEDGER = Path(tempfile.gettempdir()) / f"hostsweep-sweeps-{os.getuid()}"


def ledger_file(marker: str) -> Path:
    return LEDGER / f"{marker.replace(':', '_')}.json"


def write_ledger(marker: str, known: dict[int, str]) -> None:
    """Best effort: without a ledger, only a live watchdog (and the marker) finds them."""
    try:
        LEDGER.mkdir(mode=0o700, exist_ok=True)
        path = ledger_file(marker)
        partial = path.with_suffix(".tmp")
        partial.write_text(json.dumps({"marker": marker, "processes": known}))
        partial.replace(path)
    except OSError as exc:
        log.debug("could not write the ledger of %s: %s", marker, exc)


def read_ledgers() -> dict[str, dict[int, str]]:
    """marker -> the processes its watchdog last saw."""
    found: dict[str, dict[int, str]] = {}
    try:
        if LEDGER.stat().st_uid != os.getuid() or LEDGER.stat().st_mode & 0o022:
            return found  # not this user's own: trust none of it
    except OSError:
        return found
    for path in LEDGER.glob("*.json"):
        try:
            entry = json.loads(path.read_text())
            found[entry["marker"]] = {int(pid): started for pid, started in entry["processes"].items()}
        except (OSError, ValueError, KeyError, AttributeError):
            continue
    return found


def kill_orphaned() -> list[int]:
    """Kill the processes of sweeps whose driver is gone (their watchdog killed too): the
    ones its ledger names, and those showing its marker; their pids."""
    ledgers = read_ledgers()
    dead = {mark for mark in set(ledgers) | set(marked_pids().values()) if not marker_alive(mark)}
    killed = []
    for mark in dead:
        killed += kill_sweep(mark, ledgers.get(mark, {}))[0]
        ledger_file(mark).unlink(missing_ok=True)
    return killed


def sweep_over(marker: str) -> bool:
    """Its driver is gone, and every process it left."""
    return not marker_alive(marker) and marker not in read_ledgers() and not marked_pids(marker)


def reclaim_leftovers() -> dict[str, int]:
    """What killed sweeps left on this machine, reclaimed (called before a local cluster
    starts): counts of processes killed, segments unlinked, scratch and session folders removed."""
    return {
        "processes": len(kill_orphaned()),
        "segments": len(unlink_unmapped(orphan_segments(), SEGMENT_MIN_AGE_S)),
        "scratch folders": len(remove_stale_scratch()),
        "Ray session folders": len(remove_dead_sessions(sweep_over)),
    }


def reap(marker: str, known: dict[int, str]) -> dict[str, int]:
    """Kill what is left of the sweep, then free its segments (those its processes mapped;
    and any old orphan, in case they were gone before they could be read) and the scratch
    folders of its dead workers."""
    killed, segments = kill_sweep(marker, known)
    freed = unlink_unmapped(segments) + unlink_unmapped(orphan_segments(), SEGMENT_MIN_AGE_S)
    ledger_file(marker).unlink(missing_ok=True)
    return {"processes": len(killed), "segments": len(freed), "scratch folders": len(remove_stale_scratch())}


# The driver's side.

def start_watchdog(marker: str) -> subprocess.Popen:
    """The watchdog of the local cluster this driver starts: its own session (a Ctrl-C in
    the terminal is the driver's to handle), output to /dev/null."""
    return subprocess.Popen([sys.executable, "-m", "hostsweep.run.reaper", "--driver", str(os.getpid()),
                             "--marker", marker], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)


def stop_watchdog(watchdog: Optional[subprocess.Popen], timeout_s: float = 15.0) -> None:
    """The cluster is shut down: the watchdog kills whatever of it is left, and exits."""
    if watchdog is None or watchdog.poll() is not None:
        return
    watchdog.send_signal(signal.SIGTERM)
    try:
        watchdog.wait(timeout_s)
    except subprocess.TimeoutExpired:
        watchdog.kill()


# The watchdog's side.

def _die_with(parent: int) -> None:
    """SIGUSR1 when the parent (the driver) dies; blocked, so it is waited for, not handled."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGTERM})
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGUSR1), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the poll below still notices
        pass


def watch(driver: int, marker: str) -> None:
    """Note the cluster's processes every POLL_S (a ledger for the next sweep) until the
    driver dies or its shutdown sends SIGTERM, then reap."""
    _die_with(driver)
    known: dict[int, str] = {}
    try:
        while os.getppid() == driver:
            now = cluster_processes(driver, marker, known)
            if now != known:
                known = now
                write_ledger(marker, known)
            if signal.sigtimedwait({signal.SIGUSR1, signal.SIGTERM}, POLL_S) is not None:
                break
    finally:
        reap(marker, known)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--driver", type=int, required=True)
    parser.add_argument("--marker", required=True)
    args = parser.parse_args(argv)
    watch(args.driver, args.marker)


if __name__ == "__main__":
    main()
