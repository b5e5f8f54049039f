"""Sweep progress: cells done / total, elapsed, ETA, and what each worker is measuring."""
from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    minutes, secs = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def progress_line(done: int, total: int, elapsed_s: float, current: dict[str, str], width: int = 20) -> str:
    """'[#####.....] 3/6 cells  1m12s elapsed  ETA 1m12s | cpu/tiny/eager/tp1: b2 ctx512'.

    The ETA extrapolates the mean time per finished cell; it is '?' before the first.
    """
    filled = int(width * done / total) if total else width
    eta = format_duration(elapsed_s / done * (total - done)) if done else "?"
    workers = "; ".join(f"{spec}: {cell}" for spec, cell in sorted(current.items()))
    line = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} cells  {format_duration(elapsed_s)} elapsed  ETA {eta}"
    return f"{line} | {workers}" if workers else line


class ProgressReporter:
    """Prints a progress line on every change, and at most every `interval_s` otherwise."""

    def __init__(self, total: int, stream: Optional[TextIO] = None, interval_s: float = 30.0) -> None:
        self.total, self.done = total, 0
        self.stream = stream or sys.stderr
        self.interval_s = interval_s
        self.started = time.monotonic()
        self.last_print = float("-inf")
        self.last_state: tuple = ()

    def update(self, done: int, current: dict[str, str]) -> None:
        self.done = done
        state = (done, tuple(sorted(current.items())))
        if state != self.last_state or time.monotonic() - self.last_print >= self.interval_s:
            line = progress_line(done, self.total, time.monotonic() - self.started, current)
            print(line, file=self.stream, flush=True)
            self.last_print, self.last_state = time.monotonic(), state
