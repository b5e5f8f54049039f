"""A stop signal that arrives while a cell's result is being recorded waits until the result
is journaled, tabled and queued for MLflow; a result waiting for room in a full backlog
gives way to it (the journal keeps the cell)."""
from __future__ import annotations

import os
import signal
import time

import pytest

from hostsweep.record.uploader import BackgroundLogger
from hostsweep.run import signals


@pytest.fixture
def stop_signals(monkeypatch):
    """hostsweep's handlers on SIGTERM for the test, the process's own restored after."""
    previous = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(signals, "_received", [])
    signal.signal(signal.SIGTERM, signals._stop)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_a_stop_inside_a_deferred_block_raises_when_the_block_ends_not_in_the_middle(stop_signals):
    steps = []
    with pytest.raises(KeyboardInterrupt):
        with signals.deferred():
            steps.append("journaled")
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # the handler has run by now
            steps.append("tabled")
            steps.append("queued")
    assert steps == ["journaled", "tabled", "queued"] and signals.received() == signal.SIGTERM
    with pytest.raises(KeyboardInterrupt):  # outside a deferred block: at once
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)


def test_the_dispatcher_hands_a_result_on_whole_when_a_stop_comes_midway(stop_signals):
    from hostsweep.run.dispatch import Dispatcher

    recorded = []

    def on_result(result):
        recorded.append(("journal", result))
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        recorded.append(("queue", result))

    dispatcher = Dispatcher.__new__(Dispatcher)  # only the outbox and its hand-on
    from collections import deque

    dispatcher.outbox, dispatcher.on_result = deque(["cell-a", "cell-b"]), on_result
    with pytest.raises(KeyboardInterrupt):
        dispatcher._hand_on()
    assert recorded == [("journal", "cell-a"), ("queue", "cell-a")]  # the first whole, the second not begun
    assert list(dispatcher.outbox) == ["cell-b"]


def test_a_result_waiting_for_room_in_a_full_backlog_gives_way_to_a_stop():
    blocked = BackgroundLogger(lambda item: time.sleep(60), lambda: None, outage_s=60, heartbeat_s=60, max_backlog=1)
    blocked.submit("first")  # taken by the delivery thread, which then hangs
    time.sleep(0.2)
    blocked.submit("second")  # fills the backlog
    stopping = {"now": False}
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        stopping["now"] = True
        blocked.submit("third", lambda: stopping["now"])
    assert time.monotonic() - started < 2 and blocked.pending() == 2
