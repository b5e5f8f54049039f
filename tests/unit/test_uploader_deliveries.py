"""The uploader with several deliveries in flight (tracking.deliveries): every cell still
delivered exactly once, memory still bounded, outages still ridden out or given up on
after outage_s, and the heartbeat sent while busy as well as while idle."""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter

from hostsweep.record.uploader import BackgroundLogger


class ConcurrentStore:
    """Takes each item after `delay_s`, refusing the first `failures` calls; records how many
    deliveries ran at once and every item it took."""

    def __init__(self, delay_s: float = 0.0, failures: int = 0) -> None:
        self.delay_s, self.failures = delay_s, failures
        self.lock = threading.Lock()
        self.taken: list[int] = []
        self.running = self.most_running = self.beats = 0

    def deliver(self, item: int) -> None:
        with self.lock:
            if self.failures > 0:
                self.failures -= 1
                raise ConnectionError("[Errno 111] Connection refused")
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        time.sleep(self.delay_s)
        with self.lock:
            self.running -= 1
            self.taken.append(item)

    def heartbeat(self) -> None:
        with self.lock:
            self.beats += 1


def test_several_deliveries_in_flight_take_every_item_exactly_once_within_the_backlog():
    store = ConcurrentStore(delay_s=0.01)
    logger = BackgroundLogger(store.deliver, store.heartbeat, outage_s=10, heartbeat_s=60, max_backlog=8,
                              deliveries=4)
    started = time.monotonic()
    for item in range(200):
        logger.submit(item)
        assert logger.items.qsize() <= 8  # bounded memory: the backlog, plus 4 in flight
    assert logger.close(timeout_s=10) == 0 and logger.failure() is None
    assert Counter(store.taken) == Counter(range(200))  # each once, none lost
    assert store.most_running == 4  # four at once
    assert time.monotonic() - started < 200 * 0.01 * 0.6  # faster than one at a time
    assert not logger.alive()


def test_with_several_deliveries_an_outage_is_ridden_out_said_once_and_loses_nothing(caplog):
    store = ConcurrentStore(failures=9)
    logger = BackgroundLogger(store.deliver, store.heartbeat, outage_s=30, heartbeat_s=60, deliveries=3)
    with caplog.at_level(logging.WARNING, "hostsweep.record.uploader"):
        for item in range(20):
            logger.submit(item)
        assert logger.close(timeout_s=30) == 0
    assert Counter(store.taken) == Counter(range(20)) and logger.failure() is None
    messages = [r.getMessage() for r in caplog.records]
    assert sum("MLflow is unreachable" in m for m in messages) == 1  # one outage, said once
    assert sum("answers again" in m for m in messages) == 1


def test_with_several_deliveries_an_outage_longer_than_outage_s_gives_up_and_every_thread_ends():
    store = ConcurrentStore(failures=10**6)
    logger = BackgroundLogger(store.deliver, store.heartbeat, outage_s=1.0, heartbeat_s=60, deliveries=3)
    started = time.monotonic()
    for item in range(5):
        logger.submit(item)
    while logger.failure() is None and time.monotonic() - started < 10:
        time.sleep(0.05)
    assert "MLflow has not answered for" in logger.failure() and time.monotonic() - started < 5
    assert logger.close(timeout_s=1) == 5 and store.taken == [] and not logger.alive()


def test_the_heartbeat_goes_out_while_cells_keep_coming_not_only_when_idle():
    """A sweep logging without pause for longer than tracking.stale_after_s must still look
    alive to other sweeps."""
    store = ConcurrentStore(delay_s=0.01)
    logger = BackgroundLogger(store.deliver, store.heartbeat, outage_s=10, heartbeat_s=0.2, max_backlog=4,
                              deliveries=2)
    for item in range(150):  # about 0.75 s of deliveries, never idle
        logger.submit(item)
    beats_while_busy = store.beats
    assert logger.close(timeout_s=10) == 0
    assert beats_while_busy >= 2


def test_closing_an_idle_logger_with_several_deliveries_ends_every_thread_at_once():
    store = ConcurrentStore()
    logger = BackgroundLogger(store.deliver, store.heartbeat, outage_s=10, heartbeat_s=60, deliveries=4)
    logger.submit(1)
    while logger.pending():
        time.sleep(0.01)
    time.sleep(0.05)
    started = time.monotonic()
    assert logger.close(timeout_s=10) == 0
    assert time.monotonic() - started < 0.5 and not logger.alive()
