"""The printed cell table and the CSV rows: names that cannot be misread, numbers rounded to
what the measurement resolves, host_frac in one unit everywhere."""
from __future__ import annotations

import pandas as pd
import pytest

from hostsweep.measure.protocol import CellMeasurement, RepTiming
from hostsweep.measure.results import CellResult, cell_metrics, cell_row, logged_row, round_metric
from hostsweep.measure.split import SplitResult
from hostsweep.report.tables import format_markdown, format_table

PARAMS = {"sku": "cpu", "model": "tiny-llama", "mode": "eager", "tp": 1, "batch": 2, "ctx": 128,
          "T": 33, "reps": 12, "warmups": 2, "dtype": "float32", "engine": "vllm"}
SPLIT = SplitResult("cpu-ops", 1.2345678, 2.0154322, 0.62016, 0.01, 0.0, 0.0, 3.5, 1.1667, "host-bound", (1.25,),
                    (("aten::addmm", 1.0),))
DRIVER = {"hostsweep_version": "0.1.0", "ray_version": "2.55", "git_sha": "abc123"}


def test_rows_name_the_machine_unambiguously_and_carry_versions():
    m = CellMeasurement(3.25, 3.0, 3.5, 20.0, 124.0, ())
    host = {"hostname": "node-7", "device_name": "Intel Xeon", "vllm_version": "0.32.0", "torch_version": "2.13"}
    row = cell_row(CellResult("k", PARAMS, "FINISHED", m, None, host), "run-1", DRIVER)
    assert row["step_ms"] == 3.25 and row["mlflow_run_id"] == "run-1"
    assert row["hostname"] == "node-7" and row["device_name"] == "Intel Xeon"
    assert "host" not in row and "device" not in row  # they read like host_ms / device_ms
    assert (row["vllm_version"], row["git_sha"], row["hostsweep_version"]) == ("0.32.0", "abc123", "0.1.0")


@pytest.mark.parametrize("name,value,kept", [
    ("step_ms", 3.2504449, 3.250), ("step_ci_low_ms", 0.0004999, 0.0), ("cell_duration_s", 6.12345, 6.123),
    ("host_frac", 0.620163, 0.62), ("host_frac", 0.72649, 0.726), ("profiler_overhead", 1.234567, 1.2346), ("r2_wall", 0.99914321, 0.999143),
    ("kernels_per_step", 123.456789, 123.457), ("copy_bytes_per_step", 1234567.8, 1234570.0),
])
def test_metrics_are_rounded_to_what_the_measurement_resolves(name, value, kept):
    assert round_metric(name, value) == kept


def test_a_cell_reports_percentiles_of_its_reps_beside_the_median():
    reps = tuple(RepTiming(i, i % 2 == 0, 0.010, 0.010 + 0.032 * s / 1e3, s / 1e3) for i, s in enumerate(range(1, 11)))
    m = CellMeasurement(5.5, 4.0, 7.0, 10.0, 186.0, reps)
    metrics = cell_metrics(CellResult("k", PARAMS, "FINISHED", m, None, {}, 1.0, SPLIT))
    assert (metrics["step_p10_ms"], metrics["step_p25_ms"], metrics["step_p75_ms"], metrics["step_p90_ms"]) == \
        (1.9, 3.25, 7.75, 9.1)
    assert metrics["device_ms"] == 1.235 and metrics["host_ms"] == 2.015 and metrics["host_frac"] == 0.62


def test_rows_read_back_from_mlflow_have_the_written_columns():
    m = CellMeasurement(3.25, 3.0, 3.5, 20.0, 124.0, ())
    result = CellResult("k", PARAMS, "FINISHED", m, None, {"hostname": "vm", "device_name": "cpu-x"}, 1.0, SPLIT)
    written = cell_row(result, "run-1", DRIVER)
    tags = {"cell_key": "k", "hostname": "vm", "device_name": "cpu-x", "regime": "host-bound",
            "kernel_source": "cpu-ops", **DRIVER}
    logged = logged_row({k: str(v) for k, v in PARAMS.items()}, cell_metrics(result), tags, "run-1")
    assert set(logged) == set(written)
    assert logged["hostname"] == "vm" and logged["host_frac"] == written["host_frac"]


def test_table_shows_one_line_per_cell_with_ci_host_fraction_and_failures():
    ok = cell_row(CellResult("a", PARAMS, "FINISHED", CellMeasurement(3.25, 3.0, 3.5, 20.0, 124.0, ()),
                             None, {"hostname": "vm"}, 1.0, SPLIT), "r1")
    bad = cell_row(CellResult("b", {**PARAMS, "batch": 4}, "FAILED", None, "OOM\ntrace", {}), "r2")
    lines = format_table([ok, bad]).splitlines()
    assert len(lines) == 3 and lines[0].split()[:2] == ["sku", "model"] and "hostname" in lines[0]
    assert "3.250" in lines[1] and "[3.000, 3.500]" in lines[1] and "vm" in lines[1]
    assert "0.620" in lines[1] and "%" not in lines[1]  # host_frac as cells.csv and MLflow hold it
    assert "FAILED" in lines[2] and bad["error"] == "OOM"


def test_markdown_table_is_cut_at_a_row_with_a_pointer_to_the_rest():
    rows = [cell_row(CellResult(f"k{b}", {**PARAMS, "batch": b}, "FINISHED",
                                CellMeasurement(3.25, 3.0, 3.5, 20.0, 124.0, ()), None, {}, 1.0, SPLIT), f"r{b}")
            for b in range(1, 201)]
    text = format_markdown(rows, 2000, lambda row: f"#/runs/{row['mlflow_run_id']}",
                           overflow="{shown} of {total} cells: see cells.csv")
    assert len(text) <= 2000 and text.endswith("of 200 cells: see cells.csv")
    shown = int(text.rsplit("\n", 1)[1].split()[0])
    assert 5 < shown < 200 and text.count("](#/runs/r") == shown
    assert format_markdown(rows[:3], 2000).count("\n") == 4  # header, rule, three rows: nothing cut


def test_the_step_ci_column_and_the_summary_name_the_level_the_study_measured_at():
    from hostsweep.report.summary import build_summary, sweep_description

    row = cell_row(CellResult("a", PARAMS, "FINISHED", CellMeasurement(3.25, 3.0, 3.5, 20.0, 124.0, ()),
                              None, {"hostname": "vm"}, 1.0, SPLIT), "r1")
    assert format_table([row]).splitlines()[0].split()[7] == "ci95_ms"
    assert "ci90_ms" in format_table([row], 0.9).splitlines()[0] and "ci95" not in format_table([row], 0.9)
    assert "| ci99_ms |" in format_markdown([row], 2000, level=0.99)
    meta = {"what": "cpu", "status": "FINISHED", "T": 33, "reps": 12, "warmups": 2, "kernel_source": "cpu-ops",
            "run_dir": "run", "versions": {}, "git_sha": "abc", "ci_level": 0.9}
    summary = build_summary(pd.DataFrame([row]), meta)
    assert "90% CI" in summary["units"]["step_ms"] and "95" not in summary["units"]["step_ms"]
    assert summary["cells"][0]["step_ms"]["ci_low"] == 3.0 and summary["ci_level"] == 0.9
    text = sweep_description(meta, [row])
    assert "90% CI" in text and "95%" not in text and "bootstrap" not in text
