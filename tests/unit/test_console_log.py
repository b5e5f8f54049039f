"""hostsweep.log holds what the console showed: while a job runs, printed lines (the table,
the results and design lines, errors on stderr) go to the run's log file as well, log
records reach the file once and the console once, and a live progress block's redraws stay
off the file, its last state on it."""
from __future__ import annotations

import io
import logging
import sys

import pytest

from hostsweep.config.console import CONSOLE_LOGGER, console_to_log_file, log_file_only
from hostsweep.run.progress import ProgressReporter


@pytest.fixture
def run_log(tmp_path):
    """A run's logging as Hydra sets it up: a console handler on the stream stdout was then,
    and a file handler with the long format."""
    root = logging.getLogger()
    console_stream = io.StringIO()
    console = logging.StreamHandler(console_stream)
    log_file = logging.FileHandler(tmp_path / "hostsweep.log")
    log_file.setFormatter(logging.Formatter("[%(name)s][%(levelname)s] - %(message)s"))
    old_level = root.level
    root.setLevel(logging.INFO)
    root.addHandler(console)
    root.addHandler(log_file)
    try:
        yield tmp_path / "hostsweep.log", console_stream
    finally:
        root.removeHandler(console)
        root.removeHandler(log_file)
        log_file.close()
        root.setLevel(old_level)


def test_printed_lines_and_log_records_each_reach_the_file_once_and_the_console_once(run_log, capsys):
    path, console = run_log
    with console_to_log_file():
        logging.getLogger("hostsweep.stages.sweep").info("6 cells on 1 engine(s)")
        print("results: outputs/run  (cells.csv)\n")
        print("hostsweep: error: tp=3 does not divide", file=sys.stderr)
        print("design: no cell re-measured", end="")  # a last line without its newline: logged at the end
    lines = path.read_text().splitlines()
    assert lines == ["[hostsweep.stages.sweep][INFO] - 6 cells on 1 engine(s)",
                     f"[{CONSOLE_LOGGER}][INFO] - results: outputs/run  (cells.csv)",
                     f"[{CONSOLE_LOGGER}][INFO] - hostsweep: error: tp=3 does not divide",
                     f"[{CONSOLE_LOGGER}][INFO] - design: no cell re-measured"]
    out = capsys.readouterr()
    assert out.out == "results: outputs/run  (cells.csv)\n\ndesign: no cell re-measured"
    assert out.err == "hostsweep: error: tp=3 does not divide\n"
    assert console.getvalue() == "6 cells on 1 engine(s)\n"  # the printed lines never as records there


def test_outside_a_run_nothing_is_written_and_the_streams_are_given_back(run_log, capsys):
    path, _ = run_log
    before = sys.stdout, sys.stderr
    with console_to_log_file():
        pass
    assert (sys.stdout, sys.stderr) == before
    print("after the run")
    assert "after the run" not in path.read_text()


def test_without_a_log_file_the_printed_lines_go_nowhere_but_the_console(capsys):
    log_file_only("a line")  # no file handler on the root logger: no error, nothing written
    with console_to_log_file():
        print("only here")
    assert capsys.readouterr().out == "only here\n"


def test_a_live_progress_block_keeps_its_redraws_off_the_log_and_its_last_state_on_it(run_log):
    path, _ = run_log
    terminal = io.StringIO()
    with console_to_log_file():
        progress = ProgressReporter(2, stream=terminal, live=True)
        progress.update(1, {"cpu/tiny-llama/eager/tp1": "b2 ctx512: rep: round 3 of 12, 2 cell(s)"})
        progress.update(2, {})
        progress.close()
    logged = path.read_text().splitlines()
    assert len(logged) == 1 and logged[0].startswith(f"[{CONSOLE_LOGGER}][INFO] - [####################] 2/2 cells")
    assert "2/2 cells" in terminal.getvalue()  # rich drew it on the console stream


def test_plain_progress_lines_are_lines_of_the_log(run_log):
    path, _ = run_log
    with console_to_log_file():
        progress = ProgressReporter(2, stream=sys.stderr, live=False)
        progress.update(1, {"cpu/tiny-llama/eager/tp1": "b2 ctx512: recording"})
    logged = path.read_text()
    assert "1/2 cells" in logged and "cpu/tiny-llama/eager/tp1  b2 ctx512: recording" in logged
