"""SIGINT, SIGTERM and SIGHUP all stop a sweep the same way: as Ctrl-C does.

`timeout`, SLURM and Kubernetes send SIGTERM, a closed terminal SIGHUP. The handler raises
KeyboardInterrupt, so every `finally` of the sweep runs (runs marked KILLED, engines
closed, Ray stopped); it also remembers the signal, because an exception raised inside a
garbage-collector callback is swallowed by Python: the dispatcher's loop asks `check()`
every poll and raises again there.
"""
from __future__ import annotations

import signal
from typing import Optional

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_received: list[int] = []


def _stop(signum: int, frame: object) -> None:
    _received.append(signum)
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
