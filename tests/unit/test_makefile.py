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


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
@pytest.mark.parametrize("driver_answers, build", [(True, "gpu"), (False, "cpu")])
def test_make_installs_the_cuda_build_where_an_nvidia_driver_answers_else_the_cpu_one(tmp_path, driver_answers, build):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"  # a stand-in driver: answers `-L` or fails, as on a machine without GPUs
    smi.write_text(f"#!/bin/sh\nexit {0 if driver_answers else 9}\n")
    smi.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    result = subprocess.run(["make", "-n", "-B", f"VENV={tmp_path / 'venv'}", "setup"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60)
    installs = [line for line in result.stdout.splitlines() if "pip install" in line]
    assert len(installs) == 1 and f'-e ".[{build},test]"' in installs[0], result.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_make_refuses_a_build_it_does_not_know_in_one_line(tmp_path):
    result = subprocess.run(["make", "-s", "-B", f"VENV={tmp_path / 'venv'}", "BUILD=rocm", "setup"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "BUILD=rocm is not a vLLM build; allowed: cpu, gpu" in result.stderr
