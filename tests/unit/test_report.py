"""The printed cell table and the CSV rows."""
from __future__ import annotations

from hostsweep.measure.protocol import CellMeasurement
from hostsweep.measure.results import CellResult, cell_row
from hostsweep.report.tables import format_table

PARAMS = {"sku": "cpu", "model": "tiny-llama", "mode": "eager", "tp": 1, "batch": 2, "ctx": 128,
          "T": 33, "reps": 12, "warmups": 2, "dtype": "float32", "engine": "vllm"}


def test_rows_carry_metrics_host_and_run_id():
    m = CellMeasurement(3.25, 3.0, 3.5, 20.0, 124.0, ())
    row = cell_row(CellResult("k", PARAMS, "FINISHED", m, None, {"hostname": "node-7"}), "run-1")
    assert row["step_ms"] == 3.25 and row["host"] == "node-7" and row["mlflow_run_id"] == "run-1"


def test_table_shows_one_line_per_cell_with_ci_and_failures():
    ok = cell_row(CellResult("a", PARAMS, "FINISHED", CellMeasurement(3.25, 3.0, 3.5, 20.0, 124.0, ()),
                             None, {"hostname": "vm"}), "r1")
    bad = cell_row(CellResult("b", {**PARAMS, "batch": 4}, "FAILED", None, "OOM\ntrace", {}), "r2")
    lines = format_table([ok, bad]).splitlines()
    assert len(lines) == 3 and lines[0].split()[:2] == ["sku", "model"]
    assert "3.250" in lines[1] and "[3.000, 3.500]" in lines[1] and "vm" in lines[1]
    assert "FAILED" in lines[2] and bad["error"] == "OOM"
