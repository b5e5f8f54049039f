"""Sweep progress: cells done / total, elapsed, ETA, and what each worker is doing.

On a terminal it is one live block redrawn in place (rich), log lines scrolling above it;
otherwise (a file, a pipe, CI) plain lines, printed when a cell ends or a worker moves to
another cell, and every `interval_s` in between.

    [##########..........] 3/6 cells  1m12s elapsed  ETA 0m41s + 1 engine start
      cpu/tiny-llama/eager/tp1  b2 ctx512: rep: round 7 of 12, 6 cell(s)
"""
from __future__ import annotations

import logging
import sys
import time
from typing import Optional, TextIO

from hostsweep.config.console import log_file_only, unwrapped


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    minutes, secs = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def eta(done: int, total: int, per_cell_s: Optional[float], parallel: int = 1, engine_starts: int = 0) -> str:
    """'0m41s + 1 engine start': the cells left times the time a cell took once its engine
    was ready, spread over the workers measuring at once. Engine starts (tens of seconds to
    minutes, and unknown until one has happened) are counted, not guessed."""
    left = total - done
    if left <= 0:
        return format_duration(0)
    text = format_duration(per_cell_s * left / max(1, parallel)) if per_cell_s is not None else "?"
    if engine_starts:
        text += f" + {engine_starts} engine start{'s' if engine_starts > 1 else ''}"
    return text


def progress_line(done: int, total: int, elapsed_s: float, per_cell_s: Optional[float] = None,
                  parallel: int = 1, engine_starts: int = 0, width: int = 20) -> str:
    """'[#####.....] 3/6 cells  1m12s elapsed  ETA 0m41s + 1 engine start'."""
    filled = int(width * done / total) if total else width
    return (f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} cells  {format_duration(elapsed_s)} elapsed  "
            f"ETA {eta(done, total, per_cell_s, parallel, engine_starts)}")


def worker_lines(current: dict[str, str]) -> list[str]:
    """One line per busy worker: '  cpu/tiny-llama/eager/tp1  b2 ctx512: rep: round 7 of 12, 6 cell(s)'."""
    width = max((len(label) for label in current), default=0)
    return [f"  {label:<{width}}  {doing}" for label, doing in sorted(current.items())]


def _cell_of(doing: str) -> str:
    return doing.split(":", 1)[0]


class ProgressReporter:
    """The progress display of one sweep: `update` on every poll of the dispatcher, `close`
    at the end. `live=None` picks the live display when `stream` is a terminal."""

    def __init__(self, total: int, stream: Optional[TextIO] = None, interval_s: float = 30.0,
                 live: Optional[bool] = None) -> None:
        self.total, self.done = total, 0
        self.stream = stream or sys.stderr
        self.interval_s = interval_s
        self.started = time.monotonic()
        self.last_print = float("-inf")
        self.last_state: tuple = ()
        self.current: dict[str, str] = {}
        self.eta_inputs: tuple[Optional[float], int, int] = (None, 1, 0)
        self.live = None
        if live if live is not None else _is_terminal(self.stream):
            # redrawn in place on the console itself: a redraw is not a line of the run's log
            self.live = _LiveBlock(unwrapped(self.stream), self.render)

    def render(self) -> str:
        line = progress_line(self.done, self.total, time.monotonic() - self.started, *self.eta_inputs)
        return "\n".join([line, *worker_lines(self.current)])

    def update(self, done: int, current: dict[str, str], per_cell_s: Optional[float] = None,
               parallel: int = 1, engine_starts: int = 0) -> None:
        self.done, self.current = done, dict(current)
        self.eta_inputs = (per_cell_s, parallel, engine_starts)
        if self.live is not None:
            self.live.refresh()
            return
        # Plain lines: phases change every second or so; print when cells move, not phases.
        state = (done, tuple(sorted((label, _cell_of(doing)) for label, doing in current.items())))
        if state != self.last_state or time.monotonic() - self.last_print >= self.interval_s:
            print(self.render(), file=self.stream, flush=True)
            self.last_print, self.last_state = time.monotonic(), state

    def close(self) -> None:
        """Stop redrawing; the last state stays on screen."""
        if self.live is not None:
            self.current = {}
            self.live.stop()
            self.live = None
            log_file_only(self.render())  # the state it ended on, as the console keeps it


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class _LiveBlock:
    """rich's Live display, with the console log handlers (Hydra's, bound to the original
    stdout/stderr) pointed through it while it runs, so log lines scroll above the block
    instead of tearing it."""

    def __init__(self, stream: TextIO, render) -> None:  # noqa: ANN001 - a () -> str
        from rich.console import Console
        from rich.live import Live
        from rich.text import Text

        originals = (sys.stdout, sys.stderr)
        self.live = Live(get_renderable=lambda: Text(render()), console=Console(file=stream),
                         refresh_per_second=2, transient=False, redirect_stdout=True, redirect_stderr=True)
        self.live.start()
        proxies = {}
        for original, proxy in zip(originals, (sys.stdout, sys.stderr)):
            # Hydra's handlers hold the console streams under the run's LoggedStreams
            proxies[original] = proxies[unwrapped(original)] = proxy
        self.swapped: list[tuple[logging.StreamHandler, TextIO]] = []
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream in proxies:
                self.swapped.append((handler, handler.stream))
                handler.setStream(proxies[handler.stream])

    def refresh(self) -> None:
        self.live.refresh()

    def stop(self) -> None:
        self.live.refresh()
        self.live.stop()
        for handler, stream in self.swapped:
            handler.setStream(stream)
