"""A study whose model cannot be fitted once its unstable cells are left out ends in a
report that says so, which cells were left out and what to run: never a bare error after
minutes of measuring."""
from __future__ import annotations

import pandas as pd
import pytest

from hostsweep.config.schema import ConfigError
from hostsweep.measure.unstable import exclude_unstable
from hostsweep.record.read.selection import Selection
from hostsweep.report.document import to_markdown
from hostsweep.report.inconclusive import inconclusive_document
from hostsweep.stages import compare
from tests.conftest import compose_typed


def cells() -> pd.DataFrame:
    rows = [dict(sku="cpu", model="tiny-llama", mode="eager", tp=tp, batch=b, ctx=128, status="FINISHED",
                 step_ms=5.0 + b, step_ci_low_ms=4.5 + b, step_ci_high_ms=5.5 + b, parent_run_id="p1",
                 stable="false" if tp == 1 and b > 1 else "true",
                 unstable_reasons="ci_width,machine_speed" if tp == 1 and b > 1 else "")
            for tp in (1, 2) for b in (1, 2, 4)]
    return pd.DataFrame(rows)


def test_the_inconclusive_report_names_the_reason_the_left_out_cells_and_a_remedy_per_reason(tmp_path):
    table = cells()
    exclusion = exclude_unstable(table)[1]
    doc = inconclusive_document("generalize-cpu", "H(N) needs host times at two or more batch sizes", table,
                                exclusion, "python -m hostsweep +experiment=generalize-cpu stage=all")
    text = to_markdown(doc, tmp_path)
    assert "**inconclusive**: the model could not be fitted: H(N) needs host times" in text
    assert "left out 2 of 6 cells as unstable" in text
    assert "`ci_width` (2 cells)" in text and "`machine_speed` (2 cells)" in text
    assert "fit.exclude_unstable=false" in text


def test_the_remedy_for_wide_cis_says_how_many_pairs_the_cells_would_need(tmp_path):
    # +-10 % and +-20 % on 12 pairs, against +-5 %: 12 x 2^2 = 48 and 12 x 4^2 = 192 pairs
    table = cells().assign(reps_used=12.0)
    wide = table["unstable_reasons"].str.contains("ci_width")
    table.loc[wide, "step_ci_low_ms"] = table.loc[wide, "step_ms"] * [0.9, 0.8]
    table.loc[wide, "step_ci_high_ms"] = table.loc[wide, "step_ms"] * [1.1, 1.2]
    doc = inconclusive_document("generalize-cpu", "H(N) needs host times at two or more batch sizes", table,
                                exclude_unstable(table)[1], "python -m hostsweep", max_ci_pct=5.0)
    text = to_markdown(doc, tmp_path)
    assert "120 (median) to 192 pairs a cell would bring these within ±5 %" in text
    assert "`measure.reps=192`" in text


class FakeReportRun:
    logged: list = []

    def __init__(self, uri, experiment, name, tags):
        self.run_id, self.run_name, self.experiment_id = "r1", name, "7"

    def log(self, folder, params, metrics, note):
        FakeReportRun.logged.append((sorted(p.name for p in folder.iterdir()), params, note))

    def finish(self, status="FINISHED"):
        FakeReportRun.logged.append(status)


def test_compare_writes_the_inconclusive_report_and_exits_1_when_the_fit_fails_for_left_out_cells(
        tmp_path, monkeypatch, capsys):
    study = compose_typed(["+sku=cpu", "tracking.uri=sqlite:///x.db"])
    selection = Selection(cells(), "hostsweep-default", "7", "sqlite:///x.db")
    monkeypatch.setattr(compare, "select_cells", lambda study, keys=None: selection)

    def fails(*args):
        raise ConfigError("H(N) needs host times at two or more batch sizes")

    monkeypatch.setattr(compare, "_fit", fails)
    monkeypatch.setattr(compare, "ReportRun", FakeReportRun)
    FakeReportRun.logged = []
    assert compare.compare_study(study, tmp_path) == 1
    files, params, note = FakeReportRun.logged[0]
    assert {"report.md", "report.html", "cells.csv"} <= set(files) and FakeReportRun.logged[1] == "FINISHED"
    assert params["verdict"] == "inconclusive" and params["unstable_left_out"] == 2
    out = capsys.readouterr().out
    assert out.startswith("verdict: inconclusive: the model could not be fitted: H(N) needs host times")
    assert "report.html" in out


def test_a_fit_that_fails_with_nothing_left_out_is_still_bad_input(tmp_path, monkeypatch):
    study = compose_typed(["+sku=cpu", "tracking.uri=sqlite:///x.db"])
    stable = cells().assign(stable="true", unstable_reasons="")
    monkeypatch.setattr(compare, "select_cells", lambda study, keys=None: Selection(stable, "e", "7", "sqlite:///x.db"))

    def fails(*args):
        raise ConfigError("fit: nothing is held out")

    monkeypatch.setattr(compare, "_fit", fails)
    with pytest.raises(ConfigError, match="nothing is held out"):
        compare.compare_study(study, tmp_path)
