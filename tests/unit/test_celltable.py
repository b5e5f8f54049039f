"""cells.csv: rows appended as cells finish, the same file a one-shot pandas write gives,
run-id corrections batched but never lost, and the rows not held in memory."""
from __future__ import annotations

import math

import pandas as pd

from hostsweep.record import celltable
from hostsweep.record.celltable import CellTable, ResumedRows


def row(i: int, status: str = "FINISHED", **extra: object) -> dict[str, object]:
    metrics = {"step_ms": 1.0 + i / 1000, "host_frac": 0.5, "r2_kernel": math.nan} if status == "FINISHED" else {}
    return {"sku": "cpu", "batch": i, "engine_args": '{"a": 1, "b": "x,y"}', "status": status, **metrics,
            "hostname": "0123", "cell_key": f"k{i}", "mlflow_run_id": f"claim{i}", "error": "", **extra}


def test_appended_rows_read_back_as_a_one_shot_pandas_write_would(tmp_path):
    rows = [row(0, "SKIPPED"), row(1), row(2, "FAILED", error="RuntimeError: x"), row(3, extra_metric=2.5), row(4)]
    table = CellTable(tmp_path / "cells.csv")
    for r in rows:
        table.append(r)
        assert len(pd.read_csv(table.path)) == table.count  # every measured cell is on disk at once
    expected = tmp_path / "expected.csv"
    pd.DataFrame([{**r, "resumed": False} for r in rows]).to_csv(expected, index=False)
    assert table.path.read_text() == expected.read_text()
    assert (table.count, table.failed()) == (5, 1)


def test_run_id_corrections_are_batched_and_all_applied_by_flush(tmp_path, monkeypatch):
    monkeypatch.setattr(celltable, "REWRITE_MIN", 3)
    table = CellTable(tmp_path / "cells.csv", resumed=ResumedRows.of([row(100, mlflow_run_id="old")]))
    for i in range(10):
        table.append(row(i))
    table.set_run_id("k0", "run0")
    table.set_run_id("k1", "run1")
    assert set(pd.read_csv(table.path)["mlflow_run_id"]) >= {"claim0", "claim1"}  # not yet rewritten
    table.set_run_id("k2", "run2")  # the third correction rewrites the file
    ids = dict(zip(*pd.read_csv(table.path)[["cell_key", "mlflow_run_id"]].values.T))
    assert [ids[f"k{i}"] for i in range(4)] == ["run0", "run1", "run2", "claim3"]
    table.set_run_id("k9", "run9")
    table.set_run_id("k100", "not-a-cell-of-this-sweep")  # resumed rows keep their own run ids
    rows = {r["cell_key"]: r for r in table.study_rows([])}
    assert rows["k9"]["mlflow_run_id"] == "run9" and rows["k100"]["mlflow_run_id"] == "old"
    assert rows["k100"]["resumed"] and not rows["k9"]["resumed"]


def test_a_ten_thousand_cell_table_rewrites_the_file_a_few_times_not_once_per_cell(tmp_path, monkeypatch):
    rewrites = []
    original = CellTable._rewrite
    monkeypatch.setattr(CellTable, "_rewrite", lambda self, *a, **k: (rewrites.append(1), original(self, *a, **k)))
    table = CellTable(tmp_path / "cells.csv")
    for i in range(10_000):
        table.append(row(i, extra_metric=1.0) if i == 5000 else row(i))
        table.set_run_id(f"k{i}", f"run{i}")
    table.flush()
    assert len(rewrites) < 80
    frame = pd.read_csv(table.path)
    assert len(frame) == 10_000 and (frame["mlflow_run_id"] == "run" + frame["batch"].astype(str)).all()
    assert not hasattr(table, "rows")  # rows live in the file, not in the driver


def test_a_huge_sweep_prints_an_overview_instead_of_every_cell():
    from hostsweep.report.tables import format_overview

    rows = [row(i) for i in range(998)] + [row(998, "FAILED"), row(999, "SKIPPED")]
    text = format_overview(rows)
    assert text.splitlines()[0] == "1000 cells: 998 FINISHED, 1 FAILED, 1 SKIPPED"
    assert "step_ms: median 1.498, min 1.000, max 1.997 over 998 cells" in text
    assert len(text.splitlines()) == 3


def test_a_table_left_in_the_run_dir_by_an_earlier_sweep_is_replaced_not_appended_to(tmp_path):
    earlier = CellTable(tmp_path / "cells.csv")
    earlier.append(row(1))
    earlier.append(row(2, "FAILED"))
    resumed = CellTable(tmp_path / "cells.csv", resumed=ResumedRows.of([row(1, mlflow_run_id="logged1")]))
    resumed.append(row(2))
    frame = pd.read_csv(resumed.path)
    assert list(frame["cell_key"]) == ["k1", "k2"] and list(frame["status"]) == ["FINISHED", "FINISHED"]
    again = CellTable(tmp_path / "cells.csv")  # resume=false: everything measured again
    again.append(row(1))
    assert list(pd.read_csv(again.path)["cell_key"]) == ["k1"]


def test_resumed_rows_read_while_cells_are_measured_are_written_in_once_and_waited_for_before_a_read(tmp_path):
    import threading

    resumed = ResumedRows(("old1", "old2"))
    table = CellTable(tmp_path / "cells.csv", resumed)
    table.append(row(1))
    table.append(row(2, extra_metric=3.0))  # a column the resumed rows lack
    assert list(pd.read_csv(table.path)["cell_key"]) == ["k1", "k2"] and table.resumed_count == 2
    late = threading.Timer(0.2, resumed.rows.set_result,
                           [[row(10, mlflow_run_id="old1"), row(11, mlflow_run_id="old2", pyspy_idle_frac=0.1)]])
    late.start()
    frame = table.study_frame([])  # waits for the rows being read
    assert sorted(frame["cell_key"]) == ["k1", "k10", "k11", "k2"]
    assert dict(zip(frame["cell_key"], frame["resumed"])) == {"k1": False, "k2": False, "k10": True, "k11": True}
    table.append(row(3))
    frame = pd.read_csv(table.path)
    assert sorted(frame["cell_key"]) == ["k1", "k10", "k11", "k2", "k3"]  # each once
    assert frame.set_index("cell_key").loc["k2", "extra_metric"] == 3.0


def test_resumed_rows_that_could_not_be_read_leave_the_sweeps_own_rows_and_say_so(tmp_path, caplog):
    resumed = ResumedRows(("old1",))
    table = CellTable(tmp_path / "cells.csv", resumed)
    table.append(row(1))
    resumed.rows.set_exception(ConnectionError("MLflow went away"))
    table.append(row(2))
    assert list(table.study_frame([])["cell_key"]) == ["k1", "k2"]
    assert "lacks the 1 cell(s) resumed" in caplog.text and "MLflow went away" in caplog.text
