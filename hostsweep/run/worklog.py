"""Where a worker's output goes: its own log file, not the driver's console.

vLLM logs to stdout from each of its processes (the worker, its EngineCore, the model's
Worker), C++ and Triton warnings go to fd 2 directly, and Ray forwards every worker's
fds 1 and 2 to the driver when `log_to_driver` is on. Pointing fds 1 and 2 at a file
before the engine starts catches all of it: the engine's processes inherit them.

The driver names the file (`workers/<engine spec>.log` in the Hydra run directory). A
worker on another node, where that folder does not exist, writes to its node's temp
folder instead and ships the end of the log back with a failed cell.
"""
from __future__ import annotations

import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

LOG_FOLDER = "workers"
# The end of a worker's log sent with a failed cell: vLLM's traceback and what led to it.
TAIL_BYTES = 16_000
FALLBACK_FOLDER = Path(tempfile.gettempdir()) / "hostsweep-logs"


def worker_log_folder(run_dir: Path, verbose: bool) -> Optional[Path]:
    """Where workers log: run_dir/workers, made here; None with verbose=true (their output
    streams to the driver's console)."""
    if verbose:
        return None
    folder = run_dir / LOG_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def worker_log_path(log_dir: Path, label: str) -> Path:
    """The log of the worker serving an engine spec, e.g. workers/cpu-tiny-llama-eager-tp1.log."""
    return log_dir / f"{re.sub(r'[^A-Za-z0-9._-]+', '-', label).strip('-')}.log"


def choose_log_file(requested: Path) -> Path:
    """`requested` where its folder exists on this node (the driver's run directory, here or
    on a shared file system), else a file of the same name in this node's temp folder."""
    if requested.parent.is_dir():
        return requested
    FALLBACK_FOLDER.mkdir(parents=True, exist_ok=True)
    return FALLBACK_FOLDER / f"{requested.stem}-{os.getpid()}.log"


def redirect_output(requested: Path, header: str) -> Path:
    """Send this process's fds 1 and 2 (and those of every process it starts) to the log
    file, appended (a replaced worker continues its spec's log). Returns the file used."""
    path = choose_log_file(requested)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, f"===== {time.strftime('%Y-%m-%d %H:%M:%S')} {header} (pid {os.getpid()})\n".encode())
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)
    return path


def last_start(path: Optional[Path], max_bytes: int = 4 * TAIL_BYTES) -> str:
    """What the log holds since its latest worker started (its '=====' header)."""
    text = log_tail(path, max_bytes)
    return text[text.rfind("===== "):] if "===== " in text else text


def log_tail(path: Optional[Path], max_bytes: int = TAIL_BYTES) -> str:
    """The last `max_bytes` of a log, from a line start; '' when there is none."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - max_bytes))
            data = handle.read()
    except OSError:
        return ""
    if size > max_bytes and b"\n" in data:
        data = data[data.index(b"\n") + 1:]
    return data.decode(errors="replace")
