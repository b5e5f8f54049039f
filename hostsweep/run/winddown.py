"""Ending a sweep's workers (and the local Ray cluster it started) beside its last recording.

Once the last cell is measured nothing more needs Ray, but ending it takes time: the
workers' closes, then ray.shutdown, which stops Ray's daemons one after another, giving each
up to 1 s to exit (0.4 s here, 1.4 s before run/cluster.py stopped the autoscaler monitor
first). Begun in a thread when measuring ends, that overlaps the summary, the figures and
MLflow's last calls instead of following them.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

log = logging.getLogger(__name__)


class WindDown:
    """`steps` run once, in order, each even if one before it failed: in a thread from
    `begin()`, or in `finish()` if nothing began them (an error or a stop before measuring
    ended; there the first failure is raised). `finish()` returns once they are done."""

    def __init__(self, *steps: Callable[[], None]) -> None:
        self._steps = steps
        self._thread: Optional[threading.Thread] = None
        self._started = False

    def begin(self) -> None:
        if not self._started:
            self._started = True
            self._thread = threading.Thread(target=self._run_logged, name="wind-down", daemon=True)
            self._thread.start()

    def finish(self) -> None:
        if self._thread is not None:
            self._thread.join()
        elif not self._started:
            self._started = True
            self._run()

    def _run(self) -> None:
        failure: Optional[BaseException] = None
        for step in self._steps:
            try:
                step()
            except BaseException as exc:  # noqa: BLE001 - the next steps still run; the first is raised
                failure = failure or exc
        if failure is not None:
            raise failure

    def _run_logged(self) -> None:
        try:
            self._run()
        except Exception:  # noqa: BLE001 - measured cells are already safe; say what failed
            log.exception("ending the sweep's workers failed")
