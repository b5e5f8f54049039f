"""The Makefile's front door: a Python below 3.11, or none, is refused in one line before a
venv is made (README, Quick start)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
@pytest.mark.parametrize("version, shown", [("Python 3.10.12", "is Python 3.10.12"), (None, "is not found")])
def test_make_refuses_a_python_below_3_11_in_one_line(tmp_path, version, shown):
    python = tmp_path / "python"
    if version is not None:  # answers --version, fails the version check as a 3.10 would
        python.write_text(f'#!/bin/sh\nif [ "$1" = "--version" ]; then echo "{version}"; exit 0; fi\nexit 1\n')
        python.chmod(0o755)
    venv = tmp_path / "venv"
    result = subprocess.run(["make", "-s", f"VENV={venv}", f"PYTHON={python}", "setup"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and not venv.exists()
    refusal = [line for line in result.stderr.splitlines() if line.startswith("make: hostsweep")]
    assert len(refusal) == 1 and "needs Python 3.11 or newer" in refusal[0] and shown in refusal[0]
