"""Provenance of a number (versions, git SHA, machine) and the calibration
microbenchmarks' pure parts, with answers known in advance."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from hostsweep.calibrate.microbench import measure_roofs, roof_dtype, run_on_sku
from hostsweep.config.machine import cpu_flags, cpu_model_name, cpuinfo
from hostsweep.model.host_calibration import calibrate_host
from hostsweep.record.provenance import driver_tags, git_sha, package_version


def _head_commit_from_git_files(checkout: Path) -> str:
    """HEAD's commit read from .git's files (not through git), to check git_sha against."""
    git_dir = checkout / ".git"
    head = (git_dir / "HEAD").read_text().strip()
    if not head.startswith("ref: "):
        return head  # a detached HEAD names its commit
    ref = head.removeprefix("ref: ")
    if (git_dir / ref).is_file():
        return (git_dir / ref).read_text().strip()
    packed = (git_dir / "packed-refs").read_text().splitlines()
    return next(line.split()[0] for line in packed if line.endswith(" " + ref))


def test_git_sha_is_the_checkout_commit():
    checkout = Path(__file__).resolve().parents[2]
    if not (checkout / ".git").is_dir():
        pytest.skip("not run from a git checkout")
    assert git_sha() == _head_commit_from_git_files(checkout)


def test_a_missing_distribution_is_reported_not_raised():
    assert package_version("no-such-distribution-xyz") == "not-installed"
    assert package_version("pandas") == pd.__version__


def test_driver_tags_carry_versions_sha_and_host():
    tags = driver_tags()
    assert set(tags) == {"hostsweep_version", "ray_version", "git_sha", "driver_host"}
    assert all(tags.values())


def test_cpuinfo_is_parsed_once_for_flags_and_model_name(monkeypatch):
    reads = []
    real_read_text = Path.read_text

    def counting_read_text(self, *args, **kwargs):
        if str(self) == "/proc/cpuinfo":
            reads.append(self)
            return "processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: fpu sse2 avx512_bf16\n\nprocessor\t: 1\n"
        return real_read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", counting_read_text)
    cpuinfo.cache_clear()
    try:
        assert cpu_model_name() == "Test CPU 9000"
        assert cpu_flags() == {"fpu", "sse2", "avx512_bf16"}
        assert cpu_model_name() == "Test CPU 9000"
        assert len(reads) == 1
    finally:
        cpuinfo.cache_clear()  # the next caller reads the real file


def test_host_calibration_recovers_the_line_it_was_generated_from():
    rng = np.random.default_rng(3)
    batches = np.repeat([1, 2, 4, 8], 3)
    host_ms = 5.0 + 0.25 * (batches - 1) + rng.normal(0, 0.01, batches.size)
    cells = pd.DataFrame({"sku": "cpu", "model": "m", "tp": 1, "batch": batches, "ctx": 128, "host_ms": host_ms})
    cells = pd.concat([cells, cells.assign(tp=2, host_ms=99.0)])  # TP>1 cells are not single-device
    calibrated = calibrate_host(cells)
    fit, table = calibrated.fit, calibrated.table
    assert fit.s0_s * 1e3 == pytest.approx(5.0, abs=0.02) and fit.s1_s * 1e3 == pytest.approx(0.25, abs=0.01)
    assert len(table) == 12


def test_host_calibration_needs_two_batch_sizes():
    cells = pd.DataFrame({"sku": "cpu", "model": "m", "tp": 1, "batch": [2, 2], "ctx": 128, "host_ms": [1.0, 1.1]})
    with pytest.raises(ValueError, match="two or more batch sizes"):
        calibrate_host(cells)


def test_a_benchmark_run_apart_hands_back_its_result_its_exception_or_its_death():
    import math
    import os

    from hostsweep.calibrate.microbench import run_apart

    assert run_apart(math.factorial, 5) == 120
    with pytest.raises(ValueError, match="invalid literal"):
        run_apart(int, "not a number")
    with pytest.raises(RuntimeError, match=r"_exit ended its process without a result \(exit 3\)"):
        run_apart(os._exit, 3)


def test_the_roofs_measured_for_a_stage_leave_vllm_out_of_the_driver():
    # the engine's kernels loaded into the driver stay there to its exit, which then ends with
    # nanobind's leak report after the report's last line
    import subprocess
    import sys

    script = ("import sys\n"
              "from hostsweep.calibrate.microbench import measure_roofs, run_on_sku\n"
              "roofs = run_on_sku(measure_roofs, None, 0, None, False, 64, 1, 1, None, apart=True)\n"
              "assert roofs['measured_tflops'] > 0, roofs\n"
              "print('vllm' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "False" and "nanobind" not in proc.stderr


def test_roofs_on_the_cpu_are_positive_and_run_in_process_without_an_address():
    roofs = run_on_sku(measure_roofs, None, 0, None, False, 256, 8)
    assert roofs["measured_tflops"] > 0 and roofs["measured_bandwidth_gbps"] > 0
    assert roofs["gemm_dtype"] == roofs["dtype"] == roof_dtype(False) and roofs["device"] == "cpu"
