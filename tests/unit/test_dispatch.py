"""The dispatcher's fault handling, with the fake backend on a fake clock (no Ray): every
fault and what it costs, as cells expected / finished / duplicated / lost."""
from __future__ import annotations

import re
from collections import Counter

import pytest

from hostsweep.config.grid import build_cells, group_by_engine
from hostsweep.measure.results import MeasureOptions
from hostsweep.run.dispatch import Dispatcher
from hostsweep.run.faults import FaultPolicy, decode_steps
from tests.conftest import compose_typed
from tests.fakes import ENGINE_KILLED, FakeBackend

FAST = ["+sku=cpu", "engine.name=fake", "measure.T=5", "measure.reps=3", "measure.warmups=1", "ctx=[16]",
        "split.enabled=false"]
POLICY = FaultPolicy(cell_timeout_s=60.0, max_retries=1, poll_s=2.0)


def cells(*overrides: str):
    return build_cells(compose_typed([*FAST, *overrides]))


def options(*overrides: str) -> MeasureOptions:
    return MeasureOptions.of(compose_typed([*FAST, *overrides]).config)


def dispatch(backend: FakeBackend, grid, policy: FaultPolicy = POLICY, should_stop=lambda: None):
    results = []
    dispatcher = Dispatcher(grid, options(), results.append, backend, policy, should_stop=should_stop)
    dispatcher.run()
    return results, dispatcher


def tally(grid, results, backend) -> tuple[int, int, int, int]:
    """(expected, finished, duplicated, lost)."""
    reported, measured = Counter(r.key for r in results), Counter(backend.measured)
    finished = {r.key for r in results if r.status == "FINISHED"}
    duplicated = sum(1 for c in grid if reported[c.key] > 1 or measured[c.key] > 1)
    lost = sum(1 for c in grid if reported[c.key] == 0)
    return len(grid), len(finished), duplicated, lost


FOUR = ("batch=[1,2,3,4]",)


def test_a_clean_sweep_measures_every_cell_once_on_one_worker(tmp_path):
    grid = cells(*FOUR)
    backend = FakeBackend(tmp_path)
    results, _ = dispatch(backend, grid)
    assert tally(grid, results, backend) == (4, 4, 0, 0)
    assert len(backend.workers) == 1 and all(r.attempt == 1 and not r.retry_reasons for r in results)


def test_a_worker_gets_its_next_cell_before_its_last_result_is_recorded_and_the_last_before_its_close(tmp_path):
    grid = cells(*FOUR)
    backend = FakeBackend(tmp_path)
    seen = []  # per result handed on: cells submitted by then, and whether the engine was closed

    def record(result):
        seen.append((result.key, len(backend.pending), any(e.startswith("close") for e in backend.events)))

    Dispatcher(grid, options(), record, backend, POLICY).run()
    assert [key for key, _, _ in seen] == [c.key for c in grid]
    assert [submitted for _, submitted, _ in seen] == [2, 3, 4, 4]  # the next was already asked for
    assert not any(closed for _, _, closed in seen)


@pytest.mark.parametrize("fate,reason", [
    ("worker-dies", "actor died"),
    ("engine-dies", f"engine died: {ENGINE_KILLED}"),  # generate blocks forever: only the watch sees it
    ("engine-raises", f"engine died: {ENGINE_KILLED}"),
    # b2 was timed in b1's rounds (interleaved): its own call has one cell's work left
    ("hangs", "timed out after 60 s (faults.cell_timeout_s)"),
])
def test_a_cell_lost_mid_measurement_is_retried_on_a_new_worker_and_measured_once(tmp_path, fate, reason):
    grid = cells(*FOUR)
    backend = FakeBackend(tmp_path, fates={grid[1].key: [fate]})
    results, dispatcher = dispatch(backend, grid)
    assert tally(grid, results, backend) == (4, 4, 0, 0)
    assert len(backend.workers) == 2 and backend.workers[0].released  # the lost worker was replaced
    (retried,) = [r for r in results if r.key == grid[1].key]
    assert retried.attempt == 2 and len(retried.retry_reasons) == 1 and reason in retried.retry_reasons[0]
    assert all(r.attempt == 1 for r in results if r.key != grid[1].key)


def test_a_hang_in_a_groups_rounds_times_out_at_the_whole_groups_limit(tmp_path):
    grid = cells(*FOUR)
    backend = FakeBackend(tmp_path, fates={grid[0].key: ["hangs"]})
    results, _ = dispatch(backend, grid)
    assert tally(grid, results, backend) == (4, 4, 0, 0)
    (retried,) = [r for r in results if r.key == grid[0].key]
    assert retried.retry_reasons == ("timed out after 240 s for 4 cells timed together (faults.cell_timeout_s)",)


def submitted_groups(backend: FakeBackend) -> list[tuple[int, list[int]]]:
    """Per cell submitted, in order: its batch and its companions' batches (wraps submit)."""
    groups, submit = [], backend.submit

    def noting(worker, cell, options, companions=()):
        groups.append((cell.batch, [c.batch for c in companions]))
        return submit(worker, cell, options, companions)

    backend.submit = noting
    return groups


def noting_rounds(monkeypatch) -> list[list[int]]:
    """The batches of each group of cells a worker times in rounds, in order."""
    from hostsweep.run.worker import SweepWorker

    rounds, measure_group = [], SweepWorker._measure_group
    monkeypatch.setattr(SweepWorker, "_measure_group",
                        lambda self, group, opts: rounds.append([c.batch for c in group]) or measure_group(self, group, opts))
    return rounds


def test_a_cell_timed_in_an_earlier_cells_rounds_is_sent_without_companions(tmp_path, monkeypatch):
    rounds = noting_rounds(monkeypatch)
    grid = cells("batch=[1,2,3,4,5,6]")
    backend = FakeBackend(tmp_path)
    groups, results = submitted_groups(backend), []
    Dispatcher(grid, options("measure.interleave_max_cells=3"), results.append, backend, POLICY).run()
    assert groups == [(1, [2, 3]), (2, []), (3, []), (4, [5, 6]), (5, []), (6, [])]
    assert rounds == [[1, 2, 3], [4, 5, 6]]  # still timed in groups, each cell once
    assert tally(grid, results, backend) == (6, 6, 0, 0)


def test_after_a_failed_cell_each_cell_brings_its_companions_until_a_new_worker_starts(tmp_path, monkeypatch):
    rounds = noting_rounds(monkeypatch)
    grid = cells("batch=[1,2,3,4,5,6]")
    # b1 fails: its rounds may have failed with it, and whether the worker keeps b2 and b3 is
    # not known, so every cell goes with its companions (the worker times those it lacks);
    # b4 loses its worker: the new one keeps nothing, and what it keeps is known again
    backend = FakeBackend(tmp_path, fates={grid[0].key: ["raises"], grid[3].key: ["worker-dies"]})
    groups, results = submitted_groups(backend), []
    Dispatcher(grid, options("measure.interleave_max_cells=3"), results.append, backend, POLICY).run()
    assert groups == [(1, [2, 3]), (2, [3, 4]), (3, [4, 5]), (4, [5, 6]), (4, [5, 6]), (5, []), (6, [])]
    assert rounds == [[2, 3, 4], [4, 5, 6]]  # no cell timed alone
    assert tally(grid, results, backend)[1:] == (5, 0, 0)


def test_a_dead_engine_is_noticed_within_two_polls_not_at_the_timeout(tmp_path):
    grid = cells("batch=[1]")
    backend = FakeBackend(tmp_path, fates={grid[0].key: ["engine-dies"]}, start_s=5.0, cell_s=10.0)
    dispatch(backend, grid, FaultPolicy(cell_timeout_s=3600.0, poll_s=2.0))
    died_at = 5.0 + 10.0 / 2
    second = backend.workers[1]
    assert second.ready_at - backend.start_s <= died_at + 2 * 2.0  # replaced within two polls of the death


def test_a_cell_lost_on_every_attempt_fails_with_each_reason_and_the_rest_finish(tmp_path):
    grid = cells(*FOUR)
    backend = FakeBackend(tmp_path, fates={grid[2].key: ["engine-dies", "worker-dies"]})
    results, _ = dispatch(backend, grid, FaultPolicy(cell_timeout_s=60.0, max_retries=1))
    assert tally(grid, results, backend) == (4, 3, 0, 0)
    (failed,) = [r for r in results if r.status == "FAILED"]
    assert failed.key == grid[2].key and failed.attempt == 2
    assert "engine died" in failed.retry_reasons[0] and "actor died" in failed.retry_reasons[1]
    assert "attempt 2 of 2" in failed.error and "faults.max_retries" in failed.error


def test_max_retries_zero_fails_a_lost_cell_at_once(tmp_path):
    grid = cells(*FOUR)
    backend = FakeBackend(tmp_path, fates={grid[0].key: ["worker-dies"]})
    results, _ = dispatch(backend, grid, FaultPolicy(cell_timeout_s=60.0, max_retries=0))
    assert tally(grid, results, backend) == (4, 3, 0, 0)


@pytest.mark.parametrize("fate,needle", [("raises", "boom"), ("call-fails", "object lost")])
def test_a_cell_that_fails_by_itself_is_failed_once_and_the_worker_kept(tmp_path, fate, needle):
    grid = cells(*FOUR)
    backend = FakeBackend(tmp_path, fates={grid[0].key: [fate]})
    results, _ = dispatch(backend, grid)
    assert tally(grid, results, backend) == (4, 3, 0, 0)
    (failed,) = [r for r in results if r.status == "FAILED"]
    assert needle in failed.error and failed.attempt == 1 and len(backend.workers) == 1


def test_an_engine_that_cannot_start_fails_its_cells_once_and_other_engines_go_on(tmp_path):
    grid = cells("batch=[1,2]", "tp=[1,2]")
    broken = grid[0].engine.label
    backend = FakeBackend(tmp_path, start_fails=frozenset({broken}))
    results, _ = dispatch(backend, grid)
    assert tally(grid, results, backend) == (4, 2, 0, 0)
    assert all("failed to start" in r.error for r in results if r.status == "FAILED")
    assert sum(w.spec.label == broken for w in backend.workers) == 1  # no retry loop


def test_an_engine_not_ready_by_the_start_timeout_fails_its_cells(tmp_path):
    grid = cells("batch=[1,2]")
    backend = FakeBackend(tmp_path, start_s=500.0)
    results, _ = dispatch(backend, grid, FaultPolicy(cell_timeout_s=60.0, engine_start_timeout_s=100.0))
    assert tally(grid, results, backend) == (2, 0, 0, 0)
    assert all("engine not ready after 100 s" in r.error for r in results)
    assert backend.clock < 500.0


def test_the_cell_timeout_counts_from_engine_ready_not_from_submission(tmp_path):
    grid = cells("batch=[1]")
    backend = FakeBackend(tmp_path, start_s=100.0, cell_s=30.0)
    results, _ = dispatch(backend, grid, FaultPolicy(cell_timeout_s=50.0))
    assert tally(grid, results, backend) == (1, 1, 0, 0)


def test_workers_of_different_engines_measure_at_once(tmp_path):
    grid = cells("batch=[1,2]", "tp=[1,2]")
    backend = FakeBackend(tmp_path, start_s=5.0, cell_s=10.0)
    results, _ = dispatch(backend, grid)
    assert tally(grid, results, backend) == (4, 4, 0, 0)
    assert backend.clock == pytest.approx(5.0 + 2 * 10.0)  # two engines in parallel, not 2 x 25 s


def test_an_engine_with_no_cells_left_is_closed_before_the_sweep_goes_on_and_the_last_one_while_it_records(
        tmp_path):
    """A closed worker frees its node for the next spec's (waiting) worker, so the sweep waits
    for that close; the last close is only begun, and finishes while results are written."""
    grid = cells("batch=[1,2]", "tp=[1,2]")
    first, last = group_by_engine(grid)
    short = [c for c in grid if c.engine == last] + [c for c in grid if c.engine == first][:1]
    backend = FakeBackend(tmp_path, start_s=5.0, cell_s=10.0)
    results, _ = dispatch(backend, short)
    assert tally(short, results, backend) == (3, 3, 0, 0)
    assert sorted(backend.events[:2]) == [f"start {first.label}", f"start {last.label}"]
    assert backend.events[2:] == [f"close {first.label}", f"end {first.label}", f"close {last.label}"]
    assert [w.spec for w in backend.closing] == [last]
    backend.finish_closing()
    assert backend.events[-1] == f"end {last.label}" and all(w.released for w in backend.workers)


def test_a_stop_request_abandons_cells_in_flight_and_measures_nothing_more(tmp_path):
    """Tracking down too long: the sweep stops once the first cell is in; the rest are left
    to the next sweep (not lost: never measured, so never reported)."""
    grid = cells(*FOUR)
    backend = FakeBackend(tmp_path)
    results = []
    dispatcher = Dispatcher(grid, options(), results.append, backend, POLICY,
                            should_stop=lambda: "MLflow has not answered for 120 s" if results else None)
    dispatcher.run()
    assert dispatcher.stopped == "MLflow has not answered for 120 s"
    assert tally(grid, results, backend)[:3] == (4, 1, 0)
    assert len(backend.measured) <= 2  # at most the cell in flight was measured (and abandoned)
    assert all(w.released for w in backend.workers)


def test_the_derived_timeout_grows_with_the_work_of_the_cell():
    (cell,) = cells("batch=[1]")
    base = options()
    policy = FaultPolicy(timeout_base_s=600.0, timeout_per_step_s=0.25)
    # (the group warm-up's most rounds, measure.warmup_max_rounds 6, + reps 3) pairs of a T=1
    # and a T=5 generate, each with a prefill step
    assert decode_steps(cell, base) == 9 * (1 + 5 + 2)
    assert policy.timeout_for(cell, base) == pytest.approx(600.0 + 0.25 * 72)
    with_split = options("split.enabled=true", "split.reps=2")
    assert decode_steps(cell, with_split) == 11 * 8
    lin = options("linearity.enabled=true", "linearity.T=[8,16,32]", "linearity.reps=2")
    assert decode_steps(cell, lin) == 72 + 2 * (9 + 17 + 33)
    assert FaultPolicy(cell_timeout_s=42.0).timeout_for(cell, lin) == 42.0


def test_an_interrupt_kills_the_workers_at_once_instead_of_waiting_for_their_cells(tmp_path):
    grid = cells(*FOUR)

    def interrupt_at_second(cell, seen=[]):
        seen.append(cell)
        if len(seen) == 2:
            raise KeyboardInterrupt

    backend = FakeBackend(tmp_path, on_measure=interrupt_at_second)
    results = []
    with pytest.raises(KeyboardInterrupt):
        Dispatcher(grid, options(), results.append, backend, POLICY).run()
    assert len(results) == 1 and all(w.released for w in backend.workers) and backend.closed == []


def test_an_engine_that_did_not_start_is_reported_by_the_error_it_raised_not_rays_wrapper():
    from hostsweep.run.faults import root_cause

    ray_text = (
        "The actor died because of an error raised in its creation task, \x1b[36mray::SweepWorker.__init__()\x1b[39m "
        "(pid=693, ip=127.0.0.1)\n  File \"/x/worker.py\", line 84, in __init__\n"
        "Traceback (most recent call last):\n  File \"/v/core.py\", line 1, in run\n"
        "RuntimeError: Worker failed with error 'No common block size for 7 (CPU_ATTN: [MultipleOf(32)]).', "
        "please check the stack trace above for the root cause\n\nThe above exception was the direct cause of the "
        "following exception:\n\nray.exceptions.RayTaskError(RuntimeError): wrapped\n"
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n")
    assert root_cause(ray_text).startswith("RuntimeError: Worker failed with error 'No common block size for 7")
    assert root_cause("The actor died unexpectedly before finishing this task.") == \
        "The actor died unexpectedly before finishing this task."


def test_a_pydantic_validation_error_keeps_the_field_and_what_it_wants():
    from hostsweep.run.faults import root_cause

    log = ("Traceback (most recent call last):\n  File \"/v/arg_utils.py\", line 9, in create_engine_config\n"
           "pydantic_core._pydantic_core.ValidationError: 1 validation error for CacheConfig\ncache_dtype\n"
           "  Input should be 'auto' or 'fp8' [type=literal_error, input_value='fp3', input_type=str]\n"
           "    For further information visit https://errors.pydantic.dev/2.14/v/literal_error\n"
           "RuntimeError: Engine core initialization failed.\n")
    assert root_cause(log) == ("ValidationError: 1 validation error for CacheConfig: cache_dtype='fp3': "
                               "Input should be 'auto' or 'fp8'")


def test_an_engine_start_failure_is_reported_by_the_first_error_in_its_workers_log(tmp_path):
    grid = cells("batch=[1,2]")
    label = grid[0].engine.label
    from hostsweep.run.worklog import worker_log_path

    log = worker_log_path(tmp_path / "workers", label)
    log.parent.mkdir()
    log.write_text("===== 2026-11-29 worker (pid 1)\n(Worker pid=1) ERROR x ValueError: an earlier start\n"
                   "===== 2026-11-30 worker (pid 2)\n(MainProcess pid=2) INFO loading\n"
                   "(Worker pid=3) ERROR 11-30 10:09:29 [multiproc_executor.py:1063] ValueError: No common block size "
                   "for 7 (CPU_ATTN: [MultipleOf(32)]).\nRuntimeError: Engine core initialization failed.\n")
    backend = FakeBackend(tmp_path, start_fails=frozenset({label}))
    results = []
    Dispatcher(grid, options(), results.append, backend, POLICY, log_dir=tmp_path / "workers").run()
    assert [r.status for r in results] == ["FAILED", "FAILED"]
    assert results[0].error == f"worker for {label} failed to start: ValueError: No common block size for 7 " \
                               "(CPU_ATTN: [MultipleOf(32)])."
    assert results[0].host["worker_log"] == str(log) and "Engine core initialization failed" in results[0].log_tail


def test_the_dispatcher_keeps_nothing_of_a_cell_once_it_is_reported(tmp_path):
    grid = cells(*FOUR)
    backend = FakeBackend(tmp_path, fates={grid[1].key: ["worker-dies"], grid[2].key: ["engine-dies", "worker-dies"]})
    results, dispatcher = dispatch(backend, grid)
    assert tally(grid, results, backend) == (4, 3, 0, 0)
    assert [len(r.retry_reasons) for r in sorted(results, key=lambda r: grid.index(
        next(c for c in grid if c.key == r.key)))] == [0, 1, 2, 0]  # the reasons still reach the results
    # 10,000-cell sweeps: no per-cell entry outlives its report (a defaultdict grows one on every lookup)
    assert not dispatcher.attempts and not dispatcher.reasons and not dispatcher.inflight


PAIRED = ("+pair.against.debug.delay_phase=sample", "+pair.against.debug.delay_ms=0.1", "pair.starts=3")


def test_a_paired_studys_sides_take_turns_abba_one_engine_at_a_time(tmp_path):
    grid = cells(*FOUR, *PAIRED)
    backend = FakeBackend(tmp_path)
    results, _ = dispatch(backend, grid)
    assert sorted(r.key for r in results) == sorted(c.key for c in grid)  # each reported once, merged
    assert Counter(backend.measured) == {c.key: 3 for c in grid}  # in each of its side's 3 engine starts
    starts = [e.split()[1].rsplit("/", 1)[1] for e in backend.events if e.startswith("start")]
    assert starts == ["a", "b", "b", "a", "a", "b"]
    # each engine ends before the next starts: both sides meet the machine in turn, never together
    lifetimes = [e for e in backend.events if e.startswith(("start", "end"))]
    assert all(kind.startswith("start") == (i % 2 == 0) for i, kind in enumerate(lifetimes))
    by_key = {r.key: r for r in results}
    assert all(len(by_key[c.key].stability.start_medians_ms) == 3 for c in grid)
    # the merged cell keeps its design record: the canary over all its starts (the diff reads it)
    assert all(by_key[c.key].stability.design.canary_ms > 0 for c in grid)


def test_a_paired_side_whose_engine_cannot_start_fails_its_cells_and_the_other_side_still_takes_its_turns(tmp_path):
    grid = cells(*FOUR, *PAIRED)
    b_label = next(c.engine.label for c in grid if c.engine.side == "b")
    backend = FakeBackend(tmp_path, start_fails=frozenset({b_label}))
    results, _ = dispatch(backend, grid)
    status = Counter((r.params["side"], r.status) for r in results)
    assert status == {("a", "FINISHED"): 4, ("b", "FAILED"): 4}
    assert sum(1 for e in backend.events if e.startswith("start") and e.endswith("/a")) == 3



class QueuedBackend(FakeBackend):
    """A fake worker queued for its node until `placed_s` (placed() False, or None where the
    backend cannot tell), then starting its engine."""

    placed_s: float = 40.0
    tells: bool = True

    def placed(self, worker):
        return self.clock >= self.placed_s if self.tells else None


class Phases:
    """A progress reporter that keeps every phase it was shown."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def update(self, done, current, *args) -> None:
        self.seen.extend(current.values())

    def close(self) -> None:
        pass


def phases_and_ready_line(backend: QueuedBackend, caplog) -> tuple[list[str], str]:
    progress = Phases()
    dispatcher = Dispatcher(cells("batch=[1]"), options(), [].append, backend, POLICY, progress=progress)
    with caplog.at_level("INFO", logger="hostsweep.run.dispatch"):
        dispatcher.run()
    ready = next(r.getMessage() for r in caplog.records if "engine ready" in r.getMessage())
    return list(dict.fromkeys(progress.seen)), ready


def test_a_worker_not_yet_placed_is_said_to_wait_for_ray_and_its_ready_line_counts_that_wait_apart(
        tmp_path, caplog):
    said, ready = phases_and_ready_line(QueuedBackend(tmp_path, start_s=100.0), caplog)
    assert said[:2] == ["b1 ctx16: waiting for Ray to place its worker", "b1 ctx16: starting engine"]
    queued = float(re.search(r"\(([\d.]+) s of it waiting for Ray to place the worker\)", ready).group(1))
    assert 40.0 <= queued <= 40.0 + 2 * POLICY.poll_s


def test_a_backend_that_cannot_tell_the_queue_from_the_start_says_both(tmp_path, caplog):
    backend = QueuedBackend(tmp_path, start_s=100.0)
    backend.tells = False
    said, ready = phases_and_ready_line(backend, caplog)
    assert said[0] == "b1 ctx16: starting engine (or waiting for Ray to place its worker)" and "place" not in ready
