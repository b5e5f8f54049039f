"""The progress display: counts, elapsed, an ETA without engine starts, what each worker
is doing; redrawn in place on a terminal, plain lines otherwise."""
from __future__ import annotations

import io
import logging

from hostsweep.config.grid import build_cells
from hostsweep.measure.results import MeasureOptions
from hostsweep.run.dispatch import Dispatcher
from hostsweep.run.faults import FaultPolicy
from hostsweep.run.progress import ProgressReporter, eta, format_duration, progress_line, worker_lines
from tests.conftest import compose_typed
from tests.fakes import FakeBackend

FAST = ["+sku=cpu", "engine.name=fake", "measure.T=5", "measure.reps=4", "measure.warmups=1", "ctx=[16]",
        "split.enabled=false", "batch=[1,2,3,4]"]


def test_eta_extrapolates_the_time_a_cell_took_once_its_engine_was_ready():
    assert progress_line(3, 6, 90.0, per_cell_s=14.0, width=10) == \
        "[#####.....] 3/6 cells  1m30s elapsed  ETA 0m42s"


def test_eta_counts_engine_starts_instead_of_guessing_them():
    assert eta(0, 4, None) == "?"
    assert eta(2, 6, 10.0, parallel=2, engine_starts=1) == "0m20s + 1 engine start"
    assert eta(0, 6, None, engine_starts=2) == "? + 2 engine starts"
    assert eta(6, 6, 10.0) == "0m00s"


def test_durations_format_hours():
    assert format_duration(3725) == "1h02m05s" and format_duration(59.6) == "1m00s"


def test_each_busy_worker_has_a_line_with_its_cell_and_phase():
    lines = worker_lines({"cpu/small/eager/tp1": "b2 ctx512: rep 3 of 12", "cpu/tiny/eager/tp2": "b1 ctx128: warm-up 1 of 2"})
    assert lines == ["  cpu/small/eager/tp1  b2 ctx512: rep 3 of 12", "  cpu/tiny/eager/tp2   b1 ctx128: warm-up 1 of 2"]


def test_plain_lines_follow_cells_not_phases():
    out = io.StringIO()
    reporter = ProgressReporter(total=2, stream=out, interval_s=3600)
    assert reporter.live is None  # a StringIO is no terminal
    reporter.update(0, {"w": "b1 ctx16: rep 1 of 4"})
    reporter.update(0, {"w": "b1 ctx16: rep 2 of 4"})  # same cell, new phase: no new line
    reporter.update(1, {"w": "b2 ctx16: rep 1 of 4"})
    reporter.close()
    text = out.getvalue()
    assert text.count("cells") == 2 and "b2 ctx16: rep 1 of 4" in text


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_the_block_is_redrawn_and_log_lines_pass_above_it():
    terminal = FakeTerminal()
    root = logging.getLogger()
    handler = logging.StreamHandler(terminal)
    root.addHandler(handler)
    try:
        import sys
        original = sys.stdout
        handler.setStream(original)  # Hydra's console handler holds the original stdout
        reporter = ProgressReporter(total=3, stream=terminal)
        assert reporter.live is not None
        assert handler.stream is not original and handler.stream is sys.stdout  # through the live display
        reporter.update(1, {"cpu/tiny/eager/tp1": "b2 ctx16: rep 3 of 4"}, per_cell_s=5.0)
        assert "1/3 cells" in reporter.render() and "rep 3 of 4" in reporter.render()
        reporter.close()
        assert handler.stream is original and sys.stdout is original  # given back
    finally:
        root.removeHandler(handler)
    assert "1/3 cells" in terminal.getvalue() and "\x1b[" in terminal.getvalue()  # drawn with cursor moves


class Recorder(ProgressReporter):
    def __init__(self, total: int) -> None:
        super().__init__(total, io.StringIO())
        self.calls: list[tuple] = []

    def update(self, done, current, per_cell_s=None, parallel=1, engine_starts=0):  # noqa: ANN001
        self.calls.append((done, dict(current), per_cell_s, engine_starts))


def test_the_dispatcher_shows_engine_start_then_reps_and_leaves_the_start_out_of_the_eta(tmp_path):
    one_by_one = [*FAST, "measure.interleave=false"]  # each cell its own 4 s
    grid = build_cells(compose_typed(one_by_one))
    backend = FakeBackend(tmp_path, start_s=30.0, cell_s=4.0)
    progress = Recorder(len(grid))
    options = MeasureOptions.of(compose_typed(one_by_one).config)
    Dispatcher(grid, options, lambda r: None, backend, FaultPolicy(poll_s=1.0), progress).run()
    label = grid[0].engine.label
    first = progress.calls[0]
    assert first[1][label] == "b1 ctx16: starting engine" and first[3] == 1 and first[2] is None
    phases = [c[1][label].split(": ", 1)[1] for c in progress.calls if c[1]]
    assert any(p.startswith("rep ") and p.endswith(" of 4") for p in phases)
    after_first = [c for c in progress.calls if c[0] >= 1 and c[2] is not None]
    assert after_first and all(c[2] == 4.0 for c in after_first)  # the cell's 4 s, not 4 s + a 30 s start
    assert all(c[3] == 0 for c in after_first)


def test_a_group_timed_together_counts_as_its_cells_in_the_eta_not_as_one_slow_cell(tmp_path):
    # The worker answers a group's first cell after the whole group's rounds (4 s a cell) and
    # hands its companions over at once: 4 s a cell throughout, not 16 s after the first.
    grid = build_cells(compose_typed(FAST))
    backend = FakeBackend(tmp_path, start_s=30.0, call_s=lambda cell, companions: 4.0 * (1 + len(companions))
                          if companions else 0.0)
    progress = Recorder(len(grid))
    Dispatcher(grid, MeasureOptions.of(compose_typed(FAST).config), lambda r: None, backend,
               FaultPolicy(poll_s=1.0), progress).run()
    estimates = [c[2] for c in progress.calls if c[0] >= 1 and c[2] is not None]
    assert estimates and all(e == 4.0 for e in estimates)
