"""The progress line: counts, elapsed, ETA and the cell each worker is on."""
from __future__ import annotations

import io

from hostsweep.run.progress import ProgressReporter, format_duration, progress_line


def test_progress_line_extrapolates_eta_from_finished_cells():
    line = progress_line(3, 6, 90.0, {"cpu/tiny-llama/eager/tp1": "b2 ctx512"}, width=10)
    assert line == "[#####.....] 3/6 cells  1m30s elapsed  ETA 1m30s | cpu/tiny-llama/eager/tp1: b2 ctx512"


def test_eta_is_unknown_before_the_first_cell():
    assert "ETA ?" in progress_line(0, 4, 12.0, {})


def test_durations_format_hours():
    assert format_duration(3725) == "1h02m05s" and format_duration(59.6) == "1m00s"


def test_reporter_prints_on_change_only():
    out = io.StringIO()
    reporter = ProgressReporter(total=2, stream=out, interval_s=3600)
    reporter.update(0, {"w": "b1"})
    reporter.update(0, {"w": "b1"})
    reporter.update(1, {"w": "b2"})
    assert len(out.getvalue().splitlines()) == 2
