"""Test-only fault injection: die at a named point of the recording path, as kill -9 would.

TEST-ONLY, kept in the package on purpose: the process it kills is a real driver (a
subprocess the crash tests start, `python -m hostsweep` in the integration one), so the
points must be in the code that records, and only an environment variable reaches that
process. Nothing else belongs here; what the tests check after a crash is in
tests/crashes.py. Production never sets the variable.

HOSTSWEEP_CRASH_AT=<point>:<n> (environment, read once when this module is imported) makes
the process `os._exit(137)` the n-th time any thread reaches `point`: no cleanup, no
flush, no atexit, no finally, which is what a kill -9, an OOM kill or a power cut leaves.
tests/unit/test_crash_recording.py uses it to prove that a finished cell is never lost
nor measured twice whatever the moment the driver dies. The points, in a cell's order:

    journaled   its journal line is written through to the OS; cells.csv has no row yet
    tabled      cells.csv has its row; MLflow has not been asked
    uploading   MLflow has its run with metrics, params and tags, still RUNNING (the
                background logger's thread dies mid-upload)
    uploaded    MLflow has its run FINISHED; the journal does not yet say it was logged

Unset (always, outside these tests), reaching a point costs one comparison. The callers:
recorder.py (journaled, tabled, uploaded) and cellruns.py (uploading).
"""
from __future__ import annotations

import os
import threading
from typing import Optional

ENV = "HOSTSWEEP_CRASH_AT"
POINTS = ("journaled", "tabled", "uploading", "uploaded")
EXIT_CODE = 137  # what a shell reports for a process killed by SIGKILL


def _target(value: str) -> Optional[tuple[str, int]]:
    if not value:
        return None
    point, _, nth = value.partition(":")
    if point not in POINTS or not nth.isdigit() or int(nth) < 1:
        raise ValueError(f"{ENV}={value!r}: expected <point>:<n> with point one of {', '.join(POINTS)} and n >= 1")
    return point, int(nth)


_TARGET = _target(os.environ.get(ENV, ""))
_reached = 0
_lock = threading.Lock()


def reached(point: str) -> None:
    """Die here if HOSTSWEEP_CRASH_AT names this point and this is its n-th arrival."""
    global _reached
    if _TARGET is None or _TARGET[0] != point:
        return
    with _lock:
        _reached += 1
        if _reached == _TARGET[1]:
            os.write(2, f"hostsweep: {ENV}={point}:{_reached} reached, exiting {EXIT_CODE}\n".encode())
            os._exit(EXIT_CODE)
