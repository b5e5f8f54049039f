"""Ending the workers and the local cluster beside the sweep's last recording (run/winddown.py)."""
from __future__ import annotations

import threading

import pytest

from hostsweep.run.winddown import WindDown


def test_begun_steps_run_once_in_order_in_another_thread_and_finish_waits_for_them():
    release = threading.Event()
    ran: list[tuple[str, str]] = []

    def slow_close() -> None:
        release.wait(5)
        ran.append(("close", threading.current_thread().name))

    wind_down = WindDown(slow_close, lambda: ran.append(("shutdown", threading.current_thread().name)))
    wind_down.begin()
    wind_down.begin()
    assert ran == []  # begin() does not wait: the sweep records meanwhile
    release.set()
    wind_down.finish()
    assert ran == [("close", "wind-down"), ("shutdown", "wind-down")]


def test_steps_never_begun_run_in_finish_and_every_step_runs_even_after_a_failure():
    ran: list[str] = []

    def failing_close() -> None:
        ran.append("close")
        raise RuntimeError("worker lost")

    wind_down = WindDown(failing_close, lambda: ran.append("shutdown"))
    with pytest.raises(RuntimeError, match="worker lost"):
        wind_down.finish()
    assert ran == ["close", "shutdown"]
    wind_down.finish()
    assert ran == ["close", "shutdown"]


def test_a_failure_in_the_background_is_logged_and_the_later_steps_still_run(caplog):
    ran: list[str] = []

    def failing_close() -> None:
        raise RuntimeError("worker lost")

    wind_down = WindDown(failing_close, lambda: ran.append("shutdown"))
    wind_down.begin()
    wind_down.finish()
    assert ran == ["shutdown"]
    assert "ending the sweep's workers failed" in caplog.text
