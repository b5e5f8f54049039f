"""Provenance of a number (versions, git SHA, machine) and the calibration
microbenchmarks' pure parts, with answers known in advance."""
from __future__ import annotations

import re

import numpy as np
import pandas as pd
import pytest

from hostsweep.config.machine import cpu_flags, cpu_model_name, cpuinfo
from hostsweep.model.calibrate import host_calibration, measure_roofs, run_on_sku
from hostsweep.record.provenance import driver_tags, git_sha, package_version


def test_git_sha_is_the_checkout_commit():
    assert re.fullmatch(r"[0-9a-f]{40}", git_sha())


def test_a_missing_distribution_is_reported_not_raised():
    assert package_version("no-such-distribution-xyz") == "not-installed"
    assert package_version("pandas") == pd.__version__


def test_driver_tags_carry_versions_sha_and_host():
    tags = driver_tags()
    assert set(tags) == {"hostsweep_version", "ray_version", "git_sha", "driver_host"}
    assert all(tags.values())


def test_cpuinfo_is_parsed_once_for_flags_and_model_name():
    if not cpuinfo():
        pytest.skip("no /proc/cpuinfo")
    assert cpu_model_name() == cpuinfo()["model name"]
    assert "fpu" in cpu_flags() or "fp" in " ".join(cpu_flags())


def test_host_calibration_recovers_the_line_it_was_generated_from():
    rng = np.random.default_rng(3)
    batches = np.repeat([1, 2, 4, 8], 3)
    host_ms = 5.0 + 0.25 * (batches - 1) + rng.normal(0, 0.01, batches.size)
    cells = pd.DataFrame({"sku": "cpu", "model": "m", "tp": 1, "batch": batches, "ctx": 128, "host_ms": host_ms})
    cells = pd.concat([cells, cells.assign(tp=2, host_ms=99.0)])  # TP>1 cells are not single-device
    fit, table = host_calibration(cells)
    assert fit.s0_s * 1e3 == pytest.approx(5.0, abs=0.02) and fit.s1_s * 1e3 == pytest.approx(0.25, abs=0.01)
    assert len(table) == 12


def test_host_calibration_needs_two_batch_sizes():
    cells = pd.DataFrame({"sku": "cpu", "model": "m", "tp": 1, "batch": [2, 2], "ctx": 128, "host_ms": [1.0, 1.1]})
    with pytest.raises(ValueError, match="two or more batch sizes"):
        host_calibration(cells)


def test_roofs_on_the_cpu_are_positive_and_run_in_process_without_an_address():
    roofs = run_on_sku(measure_roofs, None, 0, None, False, 256, 8)
    assert roofs["measured_tflops"] > 0 and roofs["measured_bandwidth_gbps"] > 0
    assert roofs["gemm_dtype"] == "float32" and roofs["device"] == "cpu"
