"""SIGINT, SIGTERM and SIGHUP all stop a sweep the same way: as Ctrl-C does.

`timeout`, SLURM and Kubernetes send SIGTERM, a closed terminal SIGHUP. The handler raises
KeyboardInterrupt, so every `finally` of the sweep runs (runs marked KILLED, engines
closed, Ray stopped); it also remembers the signal, because an exception raised inside a
garbage-collector callback is swallowed by Python: the dispatcher's loop asks `check()`
every poll and raises again there. Inside `deferred()` (a cell's result being journaled,
tabled and queued for MLflow) the KeyboardInterrupt waits for the block to end, so a stop
never leaves a result half recorded.
"""
from __future__ import annotations

import signal
from contextlib import contextmanager
from typing import Iterator, Optional

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_received: list[int] = []
_deferring = 0  # deferred() blocks open in the main thread


def _stop(signum: int, frame: object) -> None:
    _received.append(signum)
    if not _deferring:
        raise KeyboardInterrupt


@contextmanager
def deferred() -> Iterator[None]:
    """A stop signal that arrives inside raises KeyboardInterrupt when the block ends, not in
    the middle of it. Code inside that may block long must watch received() and give up."""
    global _deferring
    before = len(_received)
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1
    if not _deferring and len(_received) > before:
        raise KeyboardInterrupt


def install() -> None:
    for signum in SIGNALS:
        signal.signal(signum, _stop)


def received() -> Optional[int]:
    """The last stop signal received, or None."""
    return _received[-1] if _received else None


def check() -> None:
    """Raise KeyboardInterrupt if a stop signal came (and was swallowed on the way)."""
    if _received:
        raise KeyboardInterrupt
