"""A worker's output, and its engine processes', goes to its log file, not the console."""
from __future__ import annotations

import subprocess
import sys
import textwrap

from hostsweep.run.worklog import FALLBACK_FOLDER, choose_log_file, log_tail, worker_log_path


def test_the_log_of_a_spec_is_named_for_it_in_the_workers_folder(tmp_path):
    assert worker_log_path(tmp_path, "cpu/tiny-llama/eager/tp1") == tmp_path / "cpu-tiny-llama-eager-tp1.log"


def test_stdout_stderr_and_child_processes_all_land_in_the_file(tmp_path):
    log = tmp_path / "workers" / "w.log"
    log.parent.mkdir()
    script = textwrap.dedent(f"""
        import subprocess, sys
        from pathlib import Path
        from hostsweep.run.worklog import redirect_output
        print("before the redirect")
        used = redirect_output(Path({str(log)!r}), "worker for cpu/x")
        print("python stdout")
        print("python stderr", file=sys.stderr)
        subprocess.run([sys.executable, "-c", "import os; os.write(1, b'child fd 1\\\\n'); os.write(2, b'child fd 2\\\\n')"])
        sys.stdout.flush()
        print(used, file=sys.__stderr__)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "before the redirect\n" and proc.stderr == ""  # nothing after it reaches the console
    text = log.read_text()
    assert text.startswith("===== ") and "worker for cpu/x" in text.splitlines()[0]
    for line in ("python stdout", "python stderr", "child fd 1", "child fd 2"):
        assert line in text


def test_a_worker_without_the_drivers_folder_logs_to_its_node_temp_folder(tmp_path):
    chosen = choose_log_file(tmp_path / "not-here" / "workers" / "cpu-x.log")
    assert chosen.parent == FALLBACK_FOLDER and chosen.name.startswith("cpu-x-")
    assert choose_log_file(tmp_path / "w.log") == tmp_path / "w.log"


def test_the_tail_starts_at_a_line_and_ends_with_the_log(tmp_path):
    log = tmp_path / "w.log"
    log.write_text("".join(f"line {i}\n" for i in range(1000)))
    tail = log_tail(log, max_bytes=100)
    assert tail.startswith("line ") and tail.endswith("line 999\n") and len(tail) <= 100
    assert log_tail(tmp_path / "missing.log") == "" and log_tail(None) == ""
