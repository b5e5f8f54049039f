"""What a killed sweep leaves on its machine besides processes, and how to tell it is dead.

vLLM's message queues are shared memory (/dev/shm/psm_*, 160-250 MiB each) registered with
a resource tracker that dies with the worker, so a killed engine's segments stay until
reboot; a segment no live process maps (every vLLM process of a live engine maps its
queues) is a dead engine's. Ray keeps a session folder per local cluster in its temp dir;
the ones hostsweep started are marked (SESSION_MARK) so only theirs are removed.
run/reaper.py decides when.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable

import psutil

log = logging.getLogger(__name__)

SHM = Path("/dev/shm")
# multiprocessing.shared_memory's names: vLLM's message queues are made this way.
SEGMENT_PREFIX = "psm_"
# A segment younger than this may be between its creation and its mapping.
SEGMENT_MIN_AGE_S = 30.0
RAY_TEMP = Path(tempfile.gettempdir()) / "ray"
# Written into the Ray session folder of a local cluster a sweep started: whose it is.
SESSION_MARK = "hostsweep-sweep"


def mapped_segments(pids: Iterable[int]) -> set[Path]:
    """The /dev/shm files the processes map."""
    found = set()
    for pid in pids:
        try:
            lines = Path(f"/proc/{pid}/maps").read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(f"{SHM}/") and not fields[5].endswith(" (deleted)"):
                found.add(Path(fields[5]))
    return found


def unlink_unmapped(segments: Iterable[Path], min_age_s: float = 0.0) -> list[Path]:
    """Unlink the segments of this user no live process maps (older than min_age_s)."""
    candidates = []
    for path in segments:
        try:
            info = path.stat()
        except OSError:
            continue
        if info.st_uid == os.getuid() and time.time() - info.st_ctime >= min_age_s:
            candidates.append(path)
    if not candidates:
        return []
    in_use = mapped_segments(psutil.pids())
    removed = []
    for path in candidates:
        if path not in in_use:
            try:
                path.unlink()
                removed.append(path)
            except OSError:
                pass
    return removed


def orphan_segments() -> list[Path]:
    """Every /dev/shm/psm_* segment: candidates for unlink_unmapped, which keeps those of
    other users and those a live process maps."""
    try:
        return sorted(SHM.glob(f"{SEGMENT_PREFIX}*"))
    except OSError:
        return []


def mark_session(session_dir: str, marker: str) -> None:
    """Note in a local cluster's Ray session folder which sweep started it."""
    try:
        (Path(session_dir) / SESSION_MARK).write_text(marker)
    except OSError as exc:
        log.debug("could not mark the Ray session folder %s: %s", session_dir, exc)


def remove_dead_sessions(is_over: Callable[[str], bool], root: Path = RAY_TEMP) -> list[Path]:
    """Remove the Ray session folders of this machine's hostsweep clusters whose sweep
    `is_over` (by its marker: driver and processes gone): sockets, runtime resources and
    Ray's own logs (a sweep's logs are in its run folder). Other clusters' are left alone."""
    removed = []
    for mark in root.glob(f"session_*/{SESSION_MARK}"):
        session = mark.parent
        if session.is_symlink():  # session_latest: its target is seen under its own name
            continue
        try:
            if session.stat().st_uid != os.getuid():
                continue
        except OSError:
            continue
        try:
            marker = mark.read_text().strip()
        except OSError:
            continue
        if not is_over(marker):
            continue
        shutil.rmtree(session, ignore_errors=True)
        removed.append(session)
    latest = root / "session_latest"
    if latest.is_symlink() and not latest.exists():
        latest.unlink(missing_ok=True)
    return removed
