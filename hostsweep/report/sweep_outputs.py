"""What a finished sweep leaves for people: summary.json and figures/ in the run directory,
the parent run's description, figures and files in MLflow, and the console's last lines
(where everything is, then the cell table).

Everything here is read back from cells.csv, so it costs the same whatever the sweep's
size, and none of it may cost a measurement: a failure is one warning line.

Like the rest of report/, it imports no record/ code: what it writes to MLflow and says of
the store goes through the sweep's record the stage hands it (RecordedSweep, which
record/tracking.SweepTracker is), and of the cell table it needs only the file's path.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Optional, Protocol, Sequence

import pandas as pd

from hostsweep.config.redact import error_line
from hostsweep.config.resolve import Study
from hostsweep.report.modes import finished_cells
from hostsweep.report.summary import (
    SUMMARY_FILE, build_summary, design_line, machine_entry, stability_counts, stability_line, sweep_description,
)
from hostsweep.report.tables import MAX_PRINTED_ROWS, format_overview, format_table, host_phase_table, phase_columns

log = logging.getLogger(__name__)
FIGURES_FOLDER = "figures"
PHASES_FILE = "host_phases.csv"  # report/tables.host_phase_table, beside cells.csv


class RecordedSweep(Protocol):
    """What a finished sweep's outputs read of its MLflow record and write to it: the
    stage's SweepTracker (record/tracking.py)."""

    experiment: str
    experiment_id: str
    parent_run_id: Optional[str]

    @property
    def mlflow_version(self) -> str: ...

    def store_label(self) -> str: ...

    def open_ui_line(self, port: int = 5000) -> str: ...

    def run_url(self, run_id: str, port: int = 5000) -> str: ...

    def runs_table_url(self, port: int = 5000) -> str: ...

    def describe_sweep(self, markdown: str) -> None: ...

    def log_sweep_files(self, files: Sequence[Path], figures: Sequence[Path] = ()) -> None: ...


class TableFile(Protocol):
    """The cell table as the outputs use it: where cells.csv is (record/celltable.CellTable)."""

    path: Path


def engines_label(study: Study, tps: list[int]) -> str:
    """'cpu/tiny-llama/eager/tp1': the SKUs, models, modes and TP degrees of a sweep."""
    skus = "+".join(s.name for s in study.skus)
    models = "+".join(m.name for m in study.models)
    modes = "+".join(m.name for m in study.modes)
    return f"{skus}/{models}/{modes}/tp{'+'.join(map(str, sorted(set(tps))))}"


def _values(cells: pd.DataFrame, column: str) -> str:
    """The distinct non-empty values of a column, joined ('' when none)."""
    if column not in cells:
        return ""
    return ",".join(sorted({str(v) for v in cells[column].dropna() if str(v)}))


def sweep_meta(study: Study, tracker: RecordedSweep, cells: pd.DataFrame, run_dir: Path, status: str,
               tags: dict[str, str], started: float) -> dict[str, Any]:
    cfg = study.config
    tps = [int(t) for t in cells["tp"].dropna()] if "tp" in cells else []
    return {
        "study": cfg.study, "what": engines_label(study, tps or [int(cfg.tp) if isinstance(cfg.tp, int) else 1]),
        "status": status, "T": cfg.measure.T, "reps": cfg.measure.reps, "warmups": cfg.measure.warmups,
        "ci_level": cfg.measure.ci_level,
        "kernel_source": _values(cells, "kernel_source") or "none",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "ended": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "run_dir": str(run_dir),
        "versions": {"hostsweep": tags.get("hostsweep_version", "unknown"),  # record/provenance.driver_tags
                     "vllm": _values(cells, "vllm_version"), "torch": _values(cells, "torch_version"),
                     "ray": tags.get("ray_version", "unknown"), "mlflow": tracker.mlflow_version},
        "git_sha": tags.get("git_sha", "unknown"),
        "machine": machine_entry(cells.to_dict("records"), study.dtype_why, study.preload_why),
        "mlflow": {"tracking_uri": tracker.store_label(), "experiment": tracker.experiment,
                   "experiment_id": tracker.experiment_id, "parent_run_id": tracker.parent_run_id,
                   "runs_table": tracker.runs_table_url()},
    }


def sweep_figures(study: Study, rows: pd.DataFrame) -> dict[str, Any]:
    """The sweep's figures by name (empty when no cell finished)."""
    from hostsweep.report import figures

    cells = finished_cells(rows)
    if cells.empty:
        return {}
    for column in ("step_ms", "step_ci_low_ms", "step_ci_high_ms"):
        cells[column] = pd.to_numeric(cells[column], errors="coerce")
    figs = {"split_composition": figures.split_composition(cells),
            "host_fraction_by_batch": figures.host_fraction_by_batch(cells, study.config.split.host_bound_threshold),
            "step_times": figures.step_times(cells)}
    if phase_columns(cells):  # cells with host phases (measure/phases.py)
        figs["host_phases"] = figures.host_phases(cells)
    machine = machine_entry(cells.to_dict("records"), study.dtype_why, study.preload_why)["line"]
    for fig in figs.values():  # a step time means little without the machine and dtype it ran on
        figures.subtitle(fig, machine)
    return figs


def write_results(study: Study, tracker: RecordedSweep, table: TableFile, cells: pd.DataFrame, run_dir: Path,
                  status: str, tags: dict[str, str], started: float, mlflow_up: bool) -> Optional[Path]:
    """summary.json and figures/*.png in the run directory and, when MLflow answers, on the
    parent run with its description, from `cells` (the cell table in the grid's order, as
    printed). Returns summary.json's path (None if it failed)."""
    try:
        meta = sweep_meta(study, tracker, cells, run_dir, status, tags, started)
        summary = build_summary(cells, meta, tracker.run_url)
        path = run_dir / SUMMARY_FILE
        path.write_text(json.dumps(summary, indent=1, allow_nan=False))
        phases = host_phase_table(cells)
        phases_csv = run_dir / PHASES_FILE
        if len(phases):
            phases.to_csv(phases_csv, index=False)
        figs = sweep_figures(study, cells)
        rows = cells.to_dict("records")
        from hostsweep.report.figures import SAVE_KWARGS

        pngs = []
        for name, fig in figs.items():
            (run_dir / FIGURES_FOLDER).mkdir(exist_ok=True)
            pngs.append(run_dir / FIGURES_FOLDER / f"{name}.png")
            fig.savefig(pngs[-1], **SAVE_KWARGS)
        _close(figs)
        if mlflow_up:
            relative = f"#/experiments/{tracker.experiment_id}/runs/{{}}?workflowType=machine_learning"
            tracker.describe_sweep(sweep_description(meta, rows, relative.format))
            tracker.log_sweep_files([p for p in (table.path, path, phases_csv) if p.is_file()], pngs)
        return path
    except Exception as exc:  # noqa: BLE001 - the measurements are in cells.csv and MLflow already
        log.warning("sweep summary not written: %s", error_line(exc))
        return None


def _close(figs: dict[str, Any]) -> None:
    import matplotlib.pyplot as plt

    for fig in figs.values():
        plt.close(fig)


def where_results_are(tracker: RecordedSweep, table: TableFile, summary: Optional[Path],
                      unrecorded: Optional[str] = None) -> str:
    """The lines that say where the results are and how to browse them; `unrecorded` in
    place of the MLflow lines when MLflow did not get the cells."""
    run_dir = table.path.parent
    present = ["cells.csv", "summary.json" if summary else "", f"{FIGURES_FOLDER}/" if any((run_dir / FIGURES_FOLDER).glob("*.png")) else "",
               "workers/*.log" if any(run_dir.glob("workers/*.log")) else "", "hostsweep.log"]
    lines = [f"results: {run_dir}  ({', '.join(p for p in present if p)})"]
    if unrecorded:
        return "\n".join([*lines, unrecorded])
    lines += [f"MLflow: experiment {tracker.experiment} ({tracker.experiment_id}), parent run {tracker.parent_run_id} "
              f"in {tracker.store_label()}"]
    lines.append(tracker.open_ui_line())
    lines.append(f"  then browse {tracker.runs_table_url()}")
    return "\n".join(lines)


def print_results(rows: pd.DataFrame, resumed: int, tracker: RecordedSweep, table: TableFile,
                  summary: Optional[Path], unrecorded: Optional[str] = None, level: float = 0.95,
                  dtype_why: str = "", preload_why: str = "") -> None:
    """The console's last lines: where things are, then what the cells ran on (the machine,
    vLLM and the dtype with why) and the table itself."""
    print(where_results_are(tracker, table, summary, unrecorded))
    print()
    print(f"machine: {machine_entry(rows.to_dict('records'), dtype_why, preload_why)['line']}")
    if len(rows) > MAX_PRINTED_ROWS:
        print(format_overview(rows))
        print(f"(one line per cell for up to {MAX_PRINTED_ROWS} cells; these are in {table.path.name})")
    else:
        print(format_table(rows.to_dict("records"), level))
    if resumed:
        print(f"({resumed} of these cells were FINISHED by earlier runs: `resumed` in {table.path.name})")
    records = rows.to_dict("records")
    stability = stability_line(records)
    if stability:
        advice = "; see docs/measurement.md#stability for what each reason means and what to do on a shared host"
        print(f"stability: {stability}" + (advice if stability_counts(records)["unstable"] else ""))
    design = design_line(records)
    if design:
        print(f"design: {design}")
