"""Run py-spy over a process tree while a workload runs; None when py-spy is absent."""
from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import pandas as pd

from hostsweep.measure.threadstates import thread_states

log = logging.getLogger(__name__)


def pyspy_binary() -> Optional[str]:
    """py-spy on PATH, or beside this interpreter (a virtualenv not on PATH)."""
    beside = Path(sys.executable).parent / "py-spy"
    return shutil.which("py-spy") or (str(beside) if beside.is_file() else None)


def _recorder(binary: str, pid: int, seconds: float, output: Path, idle: bool) -> subprocess.Popen:
    command = [binary, "record", "--pid", str(pid), "--subprocesses", "--threads", "--format", "raw",
               "--rate", "100", "--duration", str(max(1, round(seconds))), "--nonblocking",
               "--output", str(output)]
    if idle:
        command.append("--idle")
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def record_thread_states(pid: int, seconds: float, workload: Callable[[], None]) -> Optional[pd.DataFrame]:
    """Thread states of `pid` and its children while `workload` runs repeatedly."""
    binary = pyspy_binary()
    if binary is None:
        log.info("py-spy is not installed: skipping the thread-state view")
        return None
    with tempfile.TemporaryDirectory() as folder:
        every, active = Path(folder) / "all.txt", Path(folder) / "active.txt"
        recorders = [_recorder(binary, pid, seconds, every, idle=True),
                     _recorder(binary, pid, seconds, active, idle=False)]
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline or any(r.poll() is None for r in recorders):
            workload()
            if time.monotonic() > deadline + 30:
                break
        for recorder in recorders:
            _, err = recorder.communicate(timeout=60)
            if recorder.returncode != 0:
                log.warning("py-spy failed (%s): %s", recorder.returncode, err.strip()[-500:])
                return None
        states = thread_states(every.read_text(), active.read_text())
        if states["pid"].nunique() < 2:
            # py-spy attaches to each child in turn; on a loaded machine that can take the
            # whole window, and the view then holds the worker but not its engine.
            log.warning("py-spy sampled only process %s in %.0f s, not its engine's: raise split.pyspy_seconds",
                        pid, seconds)
        return states
