"""The split as the reports show it: host_frac with its CI, the three-valued regime in the
table, the regime table and figures, and no host number for an implausible split anywhere."""
from __future__ import annotations

import dataclasses

import matplotlib
import pandas as pd
import pytest

from hostsweep.measure.protocol import CellMeasurement
from hostsweep.measure.results import CellResult, cell_metrics, cell_row
from hostsweep.measure.split import SplitResult
from hostsweep.measure.stability import Stability
from hostsweep.report import figures
from hostsweep.report.fit_tables import regime_table
from hostsweep.report.summary import cell_entry
from hostsweep.report.tables import format_table

matplotlib.use("Agg")

PARAMS = {"sku": "cpu", "model": "tiny-llama", "mode": "eager", "tp": 1, "batch": 2, "ctx": 128,
          "T": 33, "reps": 12, "warmups": 2, "dtype": "float32", "engine": "vllm"}
MEASURED = CellMeasurement(5.0, 4.8, 5.2, 20.0, 180.0, ())
SPLIT = SplitResult("cpu-ops", 2.4, 2.6, 0.52, 0.0, 0.0, 0.0, 6.5, 1.3, "undetermined", (2.4,), (("aten::mm", 2.0),),
                    pairs=5, device_ci=(2.1, 2.7), host_ci=(2.2, 3.0), host_frac_ci=(0.45, 0.58),
                    profiled_step_ci=(6.3, 6.7), device_floor_ms=0.9)


def result(split: SplitResult = SPLIT, reasons: tuple[str, ...] = ()) -> CellResult:
    return CellResult("k", PARAMS, "FINISHED", MEASURED, None, {}, 1.0, split, stability=Stability(reasons))


def test_the_table_shows_host_frac_with_its_ci_and_an_undetermined_regime():
    row = cell_row(result(), "run")
    assert (row["host_frac_ci_low"], row["host_frac_ci_high"], row["regime"]) == (0.45, 0.58, "undetermined")
    line = format_table([row]).splitlines()[1]
    assert "0.520 [0.45, 0.58]" in line and "undetermined" in line
    split = cell_entry(row)["split"]
    assert (split["host_frac_ci_low"], split["regime"], split["split_pairs"]) == (0.45, "undetermined", 5)


def test_an_implausible_split_has_no_host_number_and_no_regime_anywhere():
    implausible = dataclasses.replace(SPLIT, device_ms=0.049, implausible=("device_below_floor",))
    flagged = result(implausible, ("split_implausible",))
    metrics = cell_metrics(flagged)
    assert metrics["device_ms"] == 0.049 and metrics["device_floor_ms"] == 0.9  # kept, flagged, with its floor
    assert not {"host_ms", "host_frac", "host_frac_ci_low", "host_ci_low_ms"} & set(metrics)
    row = cell_row(flagged, "run")
    assert "regime" not in row and "split_implausible" in row["unstable_reasons"]
    assert "- " in format_table([row]).splitlines()[1]  # device, host_frac, regime: '-'
    from hostsweep.record.recorder import describe

    assert "no host_frac (implausible: device_below_floor)" in describe(flagged)


def test_the_console_line_gives_host_frac_its_ci_and_regime():
    from hostsweep.record.recorder import describe

    assert "host_frac 0.520 [0.45, 0.58] undetermined" in describe(result())
    one_pair = dataclasses.replace(SPLIT, pairs=1, device_ci=None, host_ci=None, host_frac_ci=None)
    assert "host_frac 0.520 (no CI) undetermined" in describe(result(one_pair))


def cells(regimes: list[tuple[int, int, float, str]]) -> pd.DataFrame:
    return pd.DataFrame([{"sku": "cpu", "mode": "eager", "model": "tiny-llama", "tp": 1, "batch": b, "ctx": c,
                          "host_frac": f, "host_frac_ci_low": f - 0.05, "host_frac_ci_high": f + 0.05, "regime": r,
                          "host_ms": 1.0, "device_ms": 1.0, "step_ms": 2.0} for b, c, f, r in regimes])


def test_the_regime_table_keeps_undetermined_and_mixed_groups_apart():
    table = regime_table(cells([(1, 128, 0.7, "host-bound"), (1, 512, 0.8, "host-bound"),
                                (2, 128, 0.5, "undetermined"), (2, 512, 0.7, "host-bound"),
                                (4, 128, 0.3, "device-bound"), (4, 512, 0.7, "host-bound")]))
    assert list(table["regime"]) == ["host-bound", "undetermined", "mixed"]
    assert table.loc[0, "host_frac_ci_low"] == pytest.approx(0.65) and table.loc[0, "host_frac_ci_high"] == pytest.approx(0.85)


def test_rows_logged_without_a_regime_get_the_point_rule():
    old = cells([(1, 128, 0.7, "x"), (2, 128, 0.3, "x")]).drop(columns=["regime", "host_frac_ci_low", "host_frac_ci_high"])
    assert list(regime_table(old)["regime"]) == ["host-bound", "device-bound"]


def test_the_regime_figures_mark_undetermined_cells():
    frame = cells([(1, 128, 0.7, "host-bound"), (2, 128, 0.5, "undetermined")])
    texts = [t.get_text() for ax in figures.regime_map(regime_table(frame)).axes for t in ax.texts]
    assert "70%" in texts and "50% ?" in texts
    fig = figures.host_fraction_by_batch(frame.assign(stable="true", mode="eager"))
    assert [t.get_text() for ax in fig.axes for t in ax.texts] == ["?"]


def test_the_contexts_are_drawn_apart_in_batch_so_their_cis_and_marks_do_not_cover_each_other():
    frame = cells([(b, c, 0.5, "undetermined") for b in (1, 2, 4) for c in (128, 512)])
    fig = figures.host_fraction_by_batch(frame.assign(stable="true", mode="eager"))
    (ax,) = [a for a in fig.axes if a.get_visible()]
    series = [bars.lines[0].get_xdata() for bars in ax.containers if bars.get_label() in ("ctx 128", "ctx 512")]
    assert len(series) == 2
    for x128, x512, batch in zip(*series, (1, 2, 4)):
        assert x128 < batch < x512 and x512 / x128 < 1.1  # apart, and still read at their batch
    marks = sorted({t.xy for t in ax.texts})
    assert len(marks) == 6  # every '?' at a place of its own
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_a_flagged_splits_device_time_does_not_feed_the_mode_comparison():
    from hostsweep.report.modes import _split_columns, paired

    base = {"sku": "cpu", "model": "tiny-llama", "tp": 1, "ctx": 128, "workload": "random", "step_ms": 10.0}
    frame = pd.DataFrame([{**base, "mode": "eager", "batch": 1, "device_ms": 4.0, "host_ms": 6.0},
                          {**base, "mode": "graph", "batch": 1, "device_ms": 0.05, "host_ms": None},  # flagged
                          {**base, "mode": "eager", "batch": 2, "device_ms": 4.0, "host_ms": 6.0},
                          {**base, "mode": "graph", "batch": 2, "device_ms": 3.0, "host_ms": 5.0}])
    columns = _split_columns(paired(frame, "graph", "eager")).set_index("batch")
    assert pd.isna(columns.loc[1, "device_removed_ms"]) and columns.loc[2, "device_removed_ms"] == 1.0


def test_each_workload_is_a_line_of_its_own_in_the_host_fraction_and_step_figures():
    """random prompts and the model's own text at one (batch, ctx) are two series, named;
    one line through both would join points of different workloads."""
    frame = pd.concat([cells([(b, 512, f, "undetermined") for b in (1, 4)]).assign(workload=w)
                       for w, f in (("random", 0.3), ("repeat", 0.1))]).assign(stable="true")
    fig = figures.host_fraction_by_batch(frame)
    (ax,) = [a for a in fig.axes if a.get_visible()]
    lines = {bars.get_label(): list(bars.lines[0].get_ydata()) for bars in ax.containers}
    assert lines == {"ctx 512, random prompts": [0.3, 0.3], "ctx 512, repeat prompts": [0.1, 0.1]}
    step_ax = [a for a in figures.step_times(frame).axes if a.get_visible()][0]
    assert {bars.get_label() for bars in step_ax.containers} == {
        "tiny-llama eager TP-1 ctx 512, random prompts", "tiny-llama eager TP-1 ctx 512, repeat prompts"}
    one_workload = figures.host_fraction_by_batch(frame[frame["workload"] == "random"])
    assert {b.get_label() for a in one_workload.axes for b in a.containers} == {"ctx 512"}
