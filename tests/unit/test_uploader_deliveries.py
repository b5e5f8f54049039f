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
    store = ConcurrentStore(failures=3)
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


def test_tracking_deliveries_defaults_to_four_for_a_server_and_one_for_a_database_store():
    from hostsweep.record.recorder import deliveries

    assert deliveries("http://mlflow:5000", None) == 4 and deliveries("https://u:p@mlflow", None) == 4
    assert deliveries("sqlite:///outputs/mlflow.db", None) == 1
    assert deliveries("postgresql+psycopg2://u@db/mlflow", None) == 1
    assert deliveries("sqlite:///outputs/mlflow.db", 3) == 3 and deliveries("http://mlflow:5000", 1) == 1


def test_tracking_deliveries_is_checked_when_the_study_is_resolved():
    import pytest

    from hostsweep.config.schema import ConfigError
    from tests.conftest import compose_typed

    assert compose_typed(["+sku=cpu", "tracking.deliveries=8"]).config.tracking.deliveries == 8
    assert compose_typed(["+sku=cpu"]).config.tracking.deliveries is None
    with pytest.raises(ConfigError, match="tracking.deliveries must be 1 to 64"):
        compose_typed(["+sku=cpu", "tracking.deliveries=0"])


def test_a_delivery_takes_the_cells_already_waiting_together_each_once_never_waiting_for_more():
    """deliver_many (a database store: one transaction for them all) gets up to `batch` of
    the items already queued; a lone item goes at once, and a refused batch is retried whole."""
    calls: list[list[int]] = []
    refusals = [1]

    def deliver_many(items: list[int]) -> None:
        if refusals and len(calls) == 1:
            refusals.pop()
            raise ConnectionError("[Errno 111] Connection refused")
        calls.append(list(items))
        time.sleep(0.02)

    store = ConcurrentStore()
    logger = BackgroundLogger(store.deliver, store.heartbeat, outage_s=30, heartbeat_s=60, deliver_many=deliver_many,
                              batch=5)
    logger.submit(0)
    while logger.pending():
        time.sleep(0.01)
    for item in range(1, 41):
        logger.submit(item)
    assert logger.close(timeout_s=30) == 0
    assert calls[0] == [0]  # alone: not held back waiting for a batch
    assert sorted(i for batch in calls for i in batch) == list(range(41))  # each once, the refused batch too
    assert max(len(batch) for batch in calls) == 5 and len(calls) < 41


def test_cells_logged_together_into_a_database_store_are_one_transaction(tmp_path, new_store, monkeypatch):
    from hostsweep.measure.protocol import CellMeasurement, RepTiming
    from hostsweep.measure.results import CellResult
    from hostsweep.record.cellruns import CELLS_PER_TRANSACTION
    from hostsweep.record.tracking import SweepTracker

    tracker = SweepTracker(new_store(tmp_path / "mlflow.db"), "hostsweep-batch")
    tracker.start_sweep("batch", "", {}, {})
    assert tracker.cells_per_write() == CELLS_PER_TRANSACTION > 1
    store = tracker.client._tracking_client.store
    sessions = []
    monkeypatch.setattr(store, "ManagedSessionMaker", lambda *a, _real=store.ManagedSessionMaker, **k: (
        sessions.append(k), _real(*a, **k))[1])
    reps = (RepTiming(0, True, 0.010, 0.106, 0.003),)
    params = {"sku": "cpu", "model": "m", "mode": "eager", "tp": 1, "ctx": 16}
    cells = [(CellResult(f"k{i}", {**params, "batch": i}, "FINISHED", CellMeasurement(3.0, 2.9, 3.1, 10.5, 106.5, reps),
                         None, {}, 1.0, started_at=1_700_000_000.0 + i, ended_at=1_700_000_001.0 + i),
              {"journal_entry": f"e{i}"}, None) for i in range(3)]
    ids = tracker.log_cells(cells)
    assert [k for k in sessions if k] == [{"read_only": False}]  # one writing session for the three
    runs = [tracker.client.get_run(run_id) for run_id in ids]
    assert [r.data.tags["cell_key"] for r in runs] == ["k0", "k1", "k2"]
    assert all(r.info.status == "FINISHED" and r.data.metrics["step_ms"] == 3.0 for r in runs)
    monkeypatch.setattr(tracker, "direct_writes", False)
    assert SweepTracker.cells_per_write(tracker) == 1  # MLflow's API (a server): one cell a call
