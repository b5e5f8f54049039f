"""Host phases where people see them: the console's cell line, the stacked figure, the table
of the parent run (host_phases.csv) and the comparison report, and the parent's description."""
from __future__ import annotations

import pandas as pd

from hostsweep.measure.phases import PhaseSplit
from hostsweep.report import figures
from hostsweep.report.tables import host_phase_table, phase_columns


def cells() -> pd.DataFrame:
    base = {"sku": "cpu", "model": "tiny", "mode": "eager", "tp": 1, "ctx": 128, "step_ms": 6.0,
            "step_ci_low_ms": 5.8, "step_ci_high_ms": 6.3, "device_ms": 2.0, "host_ms": 4.0}
    return pd.DataFrame([
        {**base, "batch": 1, "phase_sample_ms": 0.5, "phase_preprocess_ms": 1.0, "phase_forward_dispatch_ms": 2.0,
         "phase_sample_ci_low_ms": 0.4, "phase_sample_ci_high_ms": 0.6, "overlapped_frontend_process_outputs_ms": 0.03,
         "attributed_frac": 0.875},
        {**base, "batch": 4, "phase_sample_ms": 0.7, "phase_preprocess_ms": 1.1, "phase_forward_dispatch_ms": None},
        {**base, "mode": "graph", "batch": 1, "phase_sample_ms": 0.4},
    ])


def test_phase_columns_come_in_the_order_a_step_runs_them():
    assert phase_columns(cells()) == ["phase_preprocess_ms", "phase_forward_dispatch_ms", "phase_sample_ms"]


def test_the_stacked_figure_has_a_panel_per_engine_and_a_bar_per_cell_and_part():
    fig = figures.host_phases(cells())
    visible = [ax for ax in fig.axes if ax.get_visible() and ax.patches]
    assert len(visible) == 2  # eager and graph side by side
    eager = next(ax for ax in visible if "eager" in ax.get_title())
    assert len(eager.patches) == 2 * (1 + 3 + 1)  # two cells x (device, three phases, other)
    heights = sorted(p.get_height() for p in eager.patches if p.get_x() < 0.5)  # the b1 cell
    assert heights == sorted([2.0, 1.0, 2.0, 0.5, 0.5])  # other = 4.0 - 3.5


def test_an_unnamed_rest_too_small_to_see_has_no_bar_and_no_legend_entry():
    named_all = cells().assign(phase_forward_dispatch_ms=2.5, phase_preprocess_ms=1.0, phase_sample_ms=0.5)
    legend = [t.get_text() for t in figures.host_phases(named_all).legends[0].texts]
    assert "other (unnamed)" not in legend and "forward_dispatch" in legend
    legend = [t.get_text() for t in figures.host_phases(cells()).legends[0].texts]
    assert "other (unnamed)" in legend  # 0.5 of 4.0 ms host left unnamed: drawn and named


def test_no_phases_no_stack():
    frame = cells().drop(columns=["phase_sample_ms", "phase_preprocess_ms", "phase_forward_dispatch_ms",
                                  "phase_sample_ci_low_ms", "phase_sample_ci_high_ms"])
    assert phase_columns(frame) == []
    assert not [ax for ax in figures.host_phases(frame).axes if ax.patches]


def test_the_console_line_gives_the_largest_host_phase_as_a_share_of_the_timed_host_time():
    from types import SimpleNamespace

    from hostsweep.record.recorder import largest_phase_note

    # Profiled: 2.2 ms of phases over 5.0 - 2.8 ms of host time; timed: 1.76 ms of host time,
    # so the phases are scaled by 0.8 and forward_dispatch is 1.44 ms, 0.82 of the host time.
    phases = PhaseSplit({"sample": 0.4, "forward_dispatch": 1.8}, 2.0, 1.0, scale=0.8)
    split = SimpleNamespace(phases=phases, profiled_step_ms=5.0, device_ms=2.8, host_ms=1.76)
    assert largest_phase_note(SimpleNamespace(split=split, stability=None)) == \
        ", largest host phase forward_dispatch 0.82 of the host time (1.44 of 1.76 ms; phases name 1.00 of it)"
    assert largest_phase_note(SimpleNamespace(split=None, stability=None)) == ""
    no_host = SimpleNamespace(phases=phases, profiled_step_ms=5.0, device_ms=2.8, host_ms=-0.1)
    assert largest_phase_note(SimpleNamespace(split=no_host, stability=None)) == ""


def test_the_phase_table_has_a_row_per_cell_with_phases_in_step_order_and_the_front_end_beside():
    table = host_phase_table(cells())
    assert list(table.columns) == ["sku", "model", "mode", "tp", "batch", "ctx", "step_ms", "device_ms",
                                   "phase_preprocess_ms", "phase_forward_dispatch_ms", "phase_sample_ms",
                                   "overlapped_frontend_process_outputs_ms", "attributed_frac"]
    assert len(table) == 3 and table.loc[0, "phase_forward_dispatch_ms"] == 2.0
    assert table.loc[0, "overlapped_frontend_process_outputs_ms"] == 0.03
    assert set(table.columns) <= set(cells().columns)  # cells.csv's names: host_phases.csv joins it as it is
    no_phases = cells().drop(columns=[c for c in cells().columns if c.startswith("phase_")])
    assert host_phase_table(no_phases).empty


def test_the_parent_description_points_at_the_phase_table_only_when_there_are_phases():
    from hostsweep.report.summary import sweep_description

    meta = {"what": "cpu sweep", "status": "FINISHED", "T": 33, "reps": 5, "warmups": 1, "kernel_source": "cpu-ops",
            "run_dir": "run", "versions": {}, "git_sha": "abc", "ci_level": 0.95}
    rows = cells().to_dict("records")
    assert "`host_phases.csv`" in sweep_description(meta, rows)
    bare = [{k: v for k, v in row.items() if not k.startswith(("phase_", "overlapped_"))} for row in rows]
    assert "host_phases.csv" not in sweep_description(meta, bare)


def test_a_negative_phase_within_noise_shows_as_zero_and_one_beyond_it_as_measured():
    frame = cells()
    frame.loc[0, ["phase_sample_ms", "phase_sample_ci_low_ms", "phase_sample_ci_high_ms"]] = [-0.006, -0.02, 0.01]
    frame.loc[1, ["phase_sample_ms", "phase_sample_ci_low_ms", "phase_sample_ci_high_ms"]] = [-0.3, -0.4, -0.2]
    table = host_phase_table(frame)
    assert list(table["phase_sample_ms"][:2]) == [0.0, -0.3]
    assert frame.loc[0, "phase_sample_ms"] == -0.006  # the cells' own value is left as measured


def test_a_sweep_whose_only_split_was_implausible_still_gets_its_summary_and_figures():
    """An implausible split keeps device_ms and its phases but has no host_ms: when every cell's
    split was, cells.csv has no host_ms column, and the outputs must not need one."""
    from hostsweep.report.summary import build_summary

    frame = cells().drop(columns=["host_ms"]).assign(status="FINISHED")
    empty_stack = figures.host_phases(frame)
    assert not [ax for ax in empty_stack.axes if ax.patches]
    assert not [ax for ax in figures.split_composition(frame).axes if ax.patches]
    assert len(host_phase_table(frame)) == 3
    summary = build_summary(frame, {"ci_level": 0.95})
    assert [(cell["split"]["device_ms"], cell["split"]["host_ms"]) for cell in summary["cells"]] == [(2.0, None)] * 3
