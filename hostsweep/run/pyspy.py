"""Run py-spy over a process tree while a workload runs; None when py-spy is absent."""
from __future__ import annotations

import logging
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import pandas as pd
import psutil

from hostsweep.measure.threadstates import label_process, thread_states
from hostsweep.run.hygiene import descendant_pids
from hostsweep.run.liveness import process_title

log = logging.getLogger(__name__)


def pyspy_binary() -> Optional[str]:
    """py-spy on PATH, or beside this interpreter (a virtualenv not on PATH)."""
    beside = Path(sys.executable).parent / "py-spy"
    return shutil.which("py-spy") or (str(beside) if beside.is_file() else None)


def _recorder(binary: str, pid: int, seconds: float, output: Path, idle: bool) -> subprocess.Popen:
    command = [binary, "record", "--pid", str(pid), "--threads", "--format", "raw", "--rate", "100",
               "--duration", str(max(1, round(seconds))), "--nonblocking", "--output", str(output)]
    if idle:
        command.append("--idle")
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def process_tree(pid: int) -> list[tuple[int, str]]:
    """(pid, name) of `pid` and every live process below it, each named by the title it gave
    itself where its kernel name or command line shows one (liveness.process_title)."""
    tree = []
    for member in [pid, *descendant_pids(pid)]:
        try:
            tree.append((member, process_title(psutil.Process(member))))
        except psutil.Error:  # gone since it was listed
            continue
    return tree


def record_thread_states(pid: int, seconds: float, workload: Callable[[], None]) -> Optional[pd.DataFrame]:
    """Thread states of `pid` and its children while `workload` runs repeatedly.

    One py-spy per process and view rather than one `--subprocesses` over the tree: that
    one starts its clock when the first process is attached and attaches the others in the
    background, which on a loaded machine took the whole window (the view then held the
    worker and not its engine). A py-spy of one process samples `seconds` from the moment
    it is attached, so the workload runs until every one has its window, however long the
    attaching takes. A process whose py-spy failed and is still alive gets one more window
    (on a loaded machine a clean-clone CI run once came back without the engine's view)."""
    binary = pyspy_binary()
    if binary is None:
        log.info("py-spy is not installed: skipping the thread-state view")
        return None
    tree = process_tree(pid)
    recorded = _record(binary, tree, seconds, workload)
    retry = [(proc, name) for proc, name in tree if proc not in recorded and psutil.pid_exists(proc)]
    if retry:
        recorded |= _record(binary, retry, seconds, workload, final=True)
    if pid not in recorded:
        return None
    views = {idle: "".join(label_process(recorded[proc][idle], proc, name) for proc, name in tree if proc in recorded)
             for idle in (True, False)}
    return thread_states(views[True], views[False])


def _record(binary: str, tree: list[tuple[int, str]], seconds: float, workload: Callable[[], None],
            final: bool = False) -> dict[int, dict[bool, str]]:
    """Both views (idle included or not) of each process of `tree` that py-spy recorded; a
    failure is logged, at WARNING on the last try."""
    with tempfile.TemporaryDirectory() as folder:
        outputs = {(proc, idle): Path(folder) / f"{proc}-{idle}.txt" for proc, _ in tree for idle in (True, False)}
        recorders = {(proc, idle): _recorder(binary, proc, seconds, output, idle)
                     for (proc, idle), output in outputs.items()}
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline or any(r.poll() is None for r in recorders.values()):
            workload()
            if time.monotonic() > deadline + ATTACH_GRACE_S:
                break
        level = logging.WARNING if final else logging.INFO
        recorded = {}
        for proc, name in tree:
            texts = {idle: _finish(recorders[(proc, idle)], outputs[(proc, idle)], proc, name, level)
                     for idle in (True, False)}
            if None not in texts.values():  # else not Python, or exited: the rest of the tree still tells
                recorded[proc] = texts
        return recorded


# How long past its window a py-spy may take to attach and finish before it is stopped
# (SIGINT: it still writes what it sampled).
ATTACH_GRACE_S = 30.0


def _finish(recorder: subprocess.Popen, output: Path, pid: int, name: str, level: int) -> Optional[str]:
    """What one py-spy recorded, or None (logged) if it failed."""
    if recorder.poll() is None:
        recorder.send_signal(signal.SIGINT)
    try:
        _, err = recorder.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        recorder.kill()
        _, err = recorder.communicate()
    if recorder.returncode != 0 or not output.is_file():
        log.log(level, "py-spy of process %s (%s) failed (%s): %s", pid, name, recorder.returncode,
                (err or "").strip()[-500:])
        return None
    return output.read_text()
