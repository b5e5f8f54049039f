"""The run directory's journal, the background MLflow logger, claim staleness and the
redaction of credentials: the pieces that keep a measured cell from being lost."""
from __future__ import annotations

import time

import pandas as pd
import pytest

from hostsweep.config.machine import hostname
from hostsweep.config.redact import redact
from hostsweep.config.schema import ConfigError
from hostsweep.measure.protocol import CellMeasurement, RepTiming
from hostsweep.measure.results import CellResult
from hostsweep.measure.split import LinearityResult, SplitResult
from hostsweep.record.claims import (
    HEARTBEAT_TAG, LIVE_HERE, OWNER_TAG, PARENT_TAG, RunView, claim_winner, stale_reason, this_owner,
)
from hostsweep.measure.speculative import SpecResult
from hostsweep.measure.phases import PhaseSplit
from hostsweep.record.journal import Journal, decode_result, encode_result, read_entries, unlogged
from hostsweep.record.uploader import BackgroundLogger

RESULT = CellResult(
    "cpu/tiny/eager/tp1/b2/ctx128/T33/abc", {"sku": "cpu", "batch": 2, "ctx": 128}, "FINISHED",
    CellMeasurement(3.0, 2.9, 3.1, 10.5, 106.5, (RepTiming(0, True, 0.010, 0.106, 0.003),)), None,
    {"hostname": "vm"}, 1.5,
    SplitResult("cpu-ops", 1.25, 1.75, 0.58, 0.01, 0.0, 0.0, 3.5, 1.17, "host-bound", (1.25, 1.3), (("aten::mm", 1.0),),
                phases=PhaseSplit({"sample": 0.1, "frontend_exposed": 0.01}, 1.0, 0.5, {"sample": (0.09, 0.11)}, 3,
                                  {"frontend_process_outputs": 0.2})),
    LinearityResult((8, 16, 32), (1.0, 2.0, 4.0), (), 0.999, float("nan"), 0.12, 0.121, 0.008),
    {"p1_rank0.pt.trace.json.gz": b"\x1f\x8b\x00binary"},
    pd.DataFrame({"process": ["EngineCore"], "samples": [10], "active_frac": [0.4]}),
    spec=SpecResult(2, 0.5, 1.0, 8.0, 16.0, 8.0, 24.0, 1.33),
    attempt=2, retry_reasons=("engine died: VLLM::EngineCore (pid 1) killed by signal 9 (SIGKILL)",),
)


def test_a_result_survives_the_journal_unchanged():
    back = decode_result(encode_result(RESULT))
    assert back.measurement == RESULT.measurement and back.split == RESULT.split
    assert back.linearity.tokens == RESULT.linearity.tokens and back.linearity.r2_wall == RESULT.linearity.r2_wall
    assert back.traces == RESULT.traces and back.attempt == 2 and back.retry_reasons == RESULT.retry_reasons
    assert back.spec == RESULT.spec
    pd.testing.assert_frame_equal(back.thread_states, RESULT.thread_states)


def test_measured_entries_stay_unlogged_until_logged_and_a_torn_line_is_skipped(tmp_path):
    journal = Journal.create(tmp_path / "run" / "journal.jsonl", tmp_path / "pending")
    first = journal.measured(RESULT, "run-1", {"git_sha": "abc"})
    second = journal.measured(RESULT, "run-2", {})
    journal.logged(first, "run-1")
    with (tmp_path / "run" / "journal.jsonl").open("a") as handle:
        handle.write('{"event": "logged", "entry": "')  # a crash mid-write
    assert [e["entry"] for e in unlogged(read_entries(journal.path))] == [second]
    assert journal.close() == 1 and journal.pointer.is_file()  # left for the next sweep


def test_a_journal_in_use_is_neither_reused_nor_uploaded_by_another_sweep(tmp_path):
    journal = Journal.create(tmp_path / "run" / "journal.jsonl", tmp_path / "pending")
    journal.measured(RESULT, None, {})
    with pytest.raises(ConfigError, match="in use by another running sweep"):
        Journal.create(tmp_path / "run" / "journal.jsonl", tmp_path / "pending")
    assert list(Journal.orphans(tmp_path / "pending")) == []  # locked: its sweep still runs
    journal.close()
    (orphan,) = Journal.orphans(tmp_path / "pending")
    (entry,) = orphan.unlogged()
    orphan.logged(entry["entry"], "run-9")
    orphan.close()
    assert not list((tmp_path / "pending").glob("*.json"))  # every cell logged: pointer gone


def test_a_sweep_reusing_a_dead_sweeps_run_dir_owns_its_unlogged_cells_and_its_stale_pointer_goes(tmp_path):
    dead = Journal.create(tmp_path / "run" / "journal.jsonl", tmp_path / "pending")
    kept = dead.measured(RESULT, "run-1", {})
    dead.handle.write('{"event": "logged", "entry": "')  # killed mid-line: no close, no newline
    dead.handle.flush()
    dead.handle.close()  # what the kernel does for a killed process: the lock goes
    rerun = Journal.create(tmp_path / "run" / "journal.jsonl", tmp_path / "pending")
    assert [e["entry"] for e in rerun.unlogged()] == [kept]  # its own to upload
    assert list(Journal.orphans(tmp_path / "pending", rerun)) == []  # not an orphan: never opened twice
    assert not dead.pointer.exists() and rerun.pointer.exists()
    rerun.logged(kept, "run-1")  # starts a line of its own after the torn one
    assert rerun.unlogged() == [] and rerun.close() == 0


def test_a_completely_logged_journal_leaves_no_pointer(tmp_path):
    journal = Journal.create(tmp_path / "run" / "journal.jsonl", tmp_path / "pending")
    journal.logged(journal.measured(RESULT, None, {}), "run-1")
    assert journal.close() == 0 and not journal.pointer.exists()


def test_one_fsync_puts_every_measured_entry_written_so_far_on_disk(tmp_path, monkeypatch):
    fsyncs = []
    monkeypatch.setattr("hostsweep.record.journal.os.fsync", fsyncs.append)
    journal = Journal.create(tmp_path / "run" / "journal.jsonl", tmp_path / "pending")
    entries = [journal.measured(RESULT, None, {}) for _ in range(3)]
    assert fsyncs == []  # written through to the OS, not yet on disk
    journal.sync()
    journal.sync()  # nothing new since: no second fsync
    assert len(fsyncs) == 1 and journal.synced == 3
    journal.logged(entries[0], "run-1")
    journal.sync()  # a logged entry is never worth an fsync
    assert len(fsyncs) == 1
    journal.measured(RESULT, None, {})
    assert journal.close() == 3 and len(fsyncs) == 2  # closing puts the last one on disk


class RecordingTracker:
    """What SweepRecorder asks of a tracker, noting how far the journal was on disk each
    time MLflow was given cells."""

    def __init__(self) -> None:
        self.journal: Journal | None = None
        self.on_disk_when_logged: list[tuple[int, int]] = []  # (entries synced, cells in the call)
        self.logged: list[str] = []

    def planned_run_id(self, result, run_id):
        return None

    def plan(self, entry, run_id):
        pass

    def heartbeat(self):
        pass

    def cells_per_write(self):
        return 50

    def delivered(self, entry):
        pass

    def log_cells(self, cells):
        time.sleep(0.01)  # a store slower than the cells arrive: batches form
        self.on_disk_when_logged.append((self.journal.synced, len(cells)))
        self.logged += [result.key for result, _, _ in cells]
        return [f"run-{result.key}" for result, _, _ in cells]


def test_mlflow_gets_a_cell_only_once_its_journal_entry_is_on_disk(tmp_path, monkeypatch):
    from dataclasses import replace

    from hostsweep.record.celltable import CellTable
    from hostsweep.record.recorder import SweepRecorder

    monkeypatch.setattr("hostsweep.record.journal.os.fsync", lambda fd: None)
    journal = Journal.create(tmp_path / "run" / "journal.jsonl", tmp_path / "pending")
    tracker = RecordingTracker()
    tracker.journal = journal
    recorder = SweepRecorder(tracker, journal, CellTable(tmp_path / "run" / "cells.csv"), {}, {}, 40,
                             outage_s=60, heartbeat_s=60)
    keys = [f"cell-{n}" for n in range(40)]
    for key in keys:
        recorder.on_result(replace(RESULT, key=key, params={**RESULT.params, "model": "tiny", "mode": "eager", "tp": 1}))
    assert recorder.close(timeout_s=10) == 0
    assert tracker.logged == keys  # each once, in order
    given = 0
    for synced, count in tracker.on_disk_when_logged:
        given += count
        assert synced >= given  # every cell MLflow has so far was fsynced first
    assert len(tracker.on_disk_when_logged) < len(keys)  # and the fsyncs were shared by batches
    journal.close()


class FlakyStore:
    """Refuses the first `failures` calls, then takes everything."""

    def __init__(self, failures: int) -> None:
        self.failures, self.taken, self.beats = failures, [], 0

    def deliver(self, item) -> None:
        if self.failures > 0:
            self.failures -= 1
            raise ConnectionError("Connection refused")
        self.taken.append(item)

    def heartbeat(self) -> None:
        self.beats += 1


def test_a_short_outage_delays_logging_but_loses_nothing_and_keeps_the_order():
    store = FlakyStore(failures=2)
    logger = BackgroundLogger(store.deliver, store.heartbeat, outage_s=30, heartbeat_s=60)
    for item in range(5):
        logger.submit(item)
    assert logger.close(timeout_s=30) == 0
    assert store.taken == [0, 1, 2, 3, 4] and logger.failure() is None


def test_an_outage_longer_than_outage_s_gives_up_and_counts_what_mlflow_did_not_get():
    store = FlakyStore(failures=10**6)
    logger = BackgroundLogger(store.deliver, store.heartbeat, outage_s=1.0, heartbeat_s=60)
    started = time.monotonic()
    for item in range(3):
        logger.submit(item)
    while logger.failure() is None and time.monotonic() - started < 10:
        time.sleep(0.05)
    assert "MLflow has not answered for" in logger.failure() and "Connection refused" in logger.failure()
    assert time.monotonic() - started < 5
    assert logger.close(timeout_s=1) == 3 and store.taken == []


def test_closing_on_an_unreachable_store_waits_down_wait_s_not_the_outage():
    """Measuring is over and MLflow is down: the sweep exits after tracking.exit_wait_s, the
    cells left in the journal, not after the whole tracking.outage_s."""
    store = FlakyStore(failures=10**6)
    logger = BackgroundLogger(store.deliver, store.heartbeat, outage_s=60, heartbeat_s=60)
    for item in range(3):
        logger.submit(item)
    while logger.down_since is None:
        time.sleep(0.01)
    started = time.monotonic()
    assert logger.close(timeout_s=60, down_wait_s=0.5) == 3
    assert 0.5 <= time.monotonic() - started < 5 and not logger.thread.is_alive()


def test_a_store_that_comes_back_within_down_wait_s_gets_every_cell():
    store = FlakyStore(failures=2)
    logger = BackgroundLogger(store.deliver, store.heartbeat, outage_s=60, heartbeat_s=60)
    for item in range(3):
        logger.submit(item)
    assert logger.close(timeout_s=60, down_wait_s=10) == 0 and store.taken == [0, 1, 2]


class SlowStore(FlakyStore):
    """Answers every call, each after `delay_s`; records the longest backlog it saw."""

    def __init__(self, delay_s: float) -> None:
        super().__init__(failures=0)
        self.delay_s, self.logger, self.most_waiting = delay_s, None, 0

    def deliver(self, item) -> None:
        time.sleep(self.delay_s)
        if self.logger is not None:
            self.most_waiting = max(self.most_waiting, self.logger.items.qsize())
        super().deliver(item)


def test_a_slow_but_answering_store_gets_every_cell_however_long_the_drain():
    """The drain outlasts timeout_s (40 x 20 ms > 0.3 s) but MLflow keeps taking cells."""
    store = SlowStore(delay_s=0.02)
    logger = BackgroundLogger(store.deliver, store.heartbeat, outage_s=0.3, heartbeat_s=60)
    for item in range(40):
        logger.submit(item)
    assert logger.close(timeout_s=0.3) == 0 and store.taken == list(range(40))


def test_an_interrupted_close_waits_timeout_s_at_most():
    store = SlowStore(delay_s=0.05)
    logger = BackgroundLogger(store.deliver, store.heartbeat, outage_s=10, heartbeat_s=60)
    for item in range(100):
        logger.submit(item)
    started = time.monotonic()
    left = logger.close(timeout_s=0.2, patient=False)
    assert 0 < left < 100 and time.monotonic() - started < 5


def test_closing_an_idle_logger_ends_its_thread_at_once():
    """The thread waits up to a second for the next cell; close wakes it instead (a sweep's
    end is not held up by that wait)."""
    store = FlakyStore(failures=0)
    logger = BackgroundLogger(store.deliver, store.heartbeat, outage_s=10, heartbeat_s=60)
    logger.submit(1)
    while logger.pending():
        time.sleep(0.01)
    time.sleep(0.05)  # the thread is now waiting on an empty queue
    started = time.monotonic()
    assert logger.close(timeout_s=10) == 0
    assert time.monotonic() - started < 0.5 and not logger.thread.is_alive()


def test_at_most_max_backlog_cells_wait_in_memory():
    store = SlowStore(delay_s=0.005)
    logger = BackgroundLogger(store.deliver, store.heartbeat, outage_s=10, heartbeat_s=60, max_backlog=5)
    store.logger = logger
    for item in range(30):
        logger.submit(item)  # waits for the store once 5 are queued
        assert logger.items.qsize() <= 5
    assert logger.close(timeout_s=5) == 0 and store.taken == list(range(30)) and store.most_waiting <= 5


def test_an_idle_logger_sends_heartbeats():
    store = FlakyStore(failures=0)
    logger = BackgroundLogger(store.deliver, store.heartbeat, outage_s=10, heartbeat_s=0.2)
    time.sleep(1.0)
    logger.close(timeout_s=1)
    assert store.beats >= 2


def sweep_run(run_id: str, status: str = "RUNNING", beat: float | None = None, owner: str = "elsewhere:1:0"):
    tags = {OWNER_TAG: owner}
    if beat is not None:
        tags[HEARTBEAT_TAG] = f"{beat:.0f}"
    return RunView(run_id, status, tags)


@pytest.mark.parametrize("parent,reason", [
    (sweep_run("p", beat=1000.0), None),
    (sweep_run("p", beat=600.0), "no heartbeat for 400 s"),
    (sweep_run("p"), "never sent a heartbeat"),
    (sweep_run("p", status="FINISHED", beat=1000.0), "its sweep ended (FINISHED)"),
    (sweep_run("p", beat=1000.0, owner=f"{hostname()}:999999999:0"), "(pid 999999999 on"),
    (None, "its sweep's run is gone"),
])
def test_a_claim_is_stale_when_its_sweep_is(parent, reason):
    claim = RunView("c", "RUNNING", {PARENT_TAG: "p", "cell_key": "k"})
    runs = {"p": parent} if parent is not None else {}
    got = stale_reason(claim, runs, now=1000.0, stale_after_s=300)
    assert got == reason if reason is None else reason in got


def test_a_sweep_of_this_process_is_live_only_while_it_runs():
    parent = RunView("mine", "RUNNING", {OWNER_TAG: this_owner(), HEARTBEAT_TAG: f"{time.time():.0f}"})
    LIVE_HERE.add("mine")
    assert stale_reason(parent, {}, time.time(), 300) is None
    LIVE_HERE.discard("mine")
    assert "ended in this process" in stale_reason(parent, {}, time.time(), 300)


def test_of_two_claims_on_one_cell_every_sweep_keeps_the_earliest():
    late, early = RunView("b", "RUNNING", {}, start_time=2), RunView("z", "RUNNING", {}, start_time=1)
    assert claim_winner([late, early]) is early and claim_winner([early, late]) is early


@pytest.mark.parametrize("text,expected", [
    ("http://alice:s3cret@mlflow:5000", "http://alice:***@mlflow:5000"),
    ("uri=https://token@host/x and sqlite:///a/b", "uri=https://***@host/x and sqlite:///a/b"),
    ("postgresql+psycopg2://u:p@db:5432/mlflow", "postgresql+psycopg2://u:***@db:5432/mlflow"),
    ("http://127.0.0.1:5000", "http://127.0.0.1:5000"),
])
def test_credentials_in_uris_are_hidden_and_nothing_else_changes(text, expected):
    assert redact(text) == expected


def test_log_records_are_redacted_once_an_entry_point_installs_its_factory():
    import logging

    from hostsweep.config.redact import redact_log_records

    before = logging.getLogRecordFactory()
    try:
        redact_log_records()
        record = logging.getLogger("x").makeRecord("x", logging.INFO, __file__, 1, "uri %s", ("http://u:pw@h",),
                                                   None)
        assert record.getMessage() == "uri http://u:***@h"
    finally:
        logging.setLogRecordFactory(before)


def test_http_retry_chatter_stays_off_the_console_but_not_out_of_the_log_file(tmp_path):
    import logging

    from hostsweep.record.store import retry_chatter_to_log_file

    root = logging.getLogger()
    console, log_file = logging.StreamHandler(), logging.FileHandler(tmp_path / "hostsweep.log")
    root.addHandler(console)
    root.addHandler(log_file)
    try:
        retry_chatter_to_log_file()
        retry = logging.getLogger("urllib3.connectionpool").makeRecord(
            "urllib3.connectionpool", logging.WARNING, __file__, 1, "Retrying (Retry(total=0))", (), None)
        failed = logging.getLogger("urllib3.connectionpool").makeRecord(
            "urllib3.connectionpool", logging.ERROR, __file__, 1, "gave up", (), None)
        ours = logging.getLogger("hostsweep.record.uploader").makeRecord(
            "hostsweep.record.uploader", logging.WARNING, __file__, 1, "MLflow is unreachable", (), None)
        assert [console.filter(r) for r in (retry, failed, ours)] == [False, True, True]
        assert log_file.filter(retry)
    finally:
        root.removeHandler(console)
        root.removeHandler(log_file)
        log_file.close()
