"""What hostsweep prints on the console, also written into the run's log file (hostsweep.log).

Log records reach the console and Hydra's file handler both; what a stage prints (the
results lines, the cell table, the stability and design lines, a verdict, an error, a
library's own prints and warnings) is not a log record. While a job runs, the entry point
wraps stdout and stderr in `LoggedStream`s (`console_to_log_file`): each complete line
written to them goes on to the console unchanged and, as a record of the `hostsweep.console`
logger, to the root logger's file handlers only. Hydra's console handler keeps the stream
it was given before the wrap, so a log record is neither written twice to the console nor
twice to the file. Pure: it knows of logging's handlers, not of Hydra.
"""
from __future__ import annotations

import logging
import sys
from contextlib import contextmanager
from typing import Iterator, TextIO

CONSOLE_LOGGER = "hostsweep.console"  # the name the printed lines carry in the log file
_log = logging.getLogger(CONSOLE_LOGGER)
_log.propagate = False  # its records go to the log files alone (log_file_only), never to a console handler
_log.setLevel(logging.INFO)


def log_files() -> list[logging.FileHandler]:
    """The file handlers of the root logger: Hydra's hostsweep.log in a run (none elsewhere)."""
    return [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]


_busy: list[bool] = []  # set while log_file_only writes: a file handler's own error report is not logged again


def log_file_only(text: str) -> None:
    """Write `text`'s non-blank lines into the run's log files, not to the console."""
    if _busy:
        return
    _busy.append(True)
    try:
        # Looked up on every call: Hydra opens a new file handler for each job of a multirun.
        _log.handlers = list(log_files())
        for line in text.splitlines():
            if line.strip():
                _log.info(line.rstrip())
    finally:
        _busy.clear()


class LoggedStream:
    """A console stream whose complete lines also go to the run's log files (log_file_only).
    Everything else (flush, isatty, fileno, encoding) is the wrapped stream's."""

    def __init__(self, stream: TextIO) -> None:
        self.wrapped = stream
        self._partial = ""

    def write(self, text: str) -> int:
        written = self.wrapped.write(text)
        *lines, self._partial = (self._partial + text).split("\n")
        if lines:
            log_file_only("\n".join(lines))
        return written

    def writelines(self, lines: list[str]) -> None:
        for line in lines:
            self.write(line)

    def close_line(self) -> None:
        """Log what was written after the last newline (a prompt, a last line without one)."""
        if self._partial:
            log_file_only(self._partial)
            self._partial = ""

    def __getattr__(self, name: str) -> object:
        return getattr(self.wrapped, name)


def unwrapped(stream: TextIO) -> TextIO:
    """The console stream under a LoggedStream (itself otherwise): a live display redrawn in
    place writes there, since its redraws are not lines of the log."""
    return stream.wrapped if isinstance(stream, LoggedStream) else stream  # type: ignore[return-value]


@contextmanager
def console_to_log_file() -> Iterator[None]:
    """While it is open, every line printed on stdout or stderr is also in the log files."""
    originals = sys.stdout, sys.stderr
    logged = LoggedStream(sys.stdout), LoggedStream(sys.stderr)
    sys.stdout, sys.stderr = logged
    try:
        yield
    finally:
        for stream in logged:
            stream.close_line()
        sys.stdout, sys.stderr = originals
