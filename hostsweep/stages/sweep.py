"""One sweep end to end: validate, plan, check the cluster, measure, record, print.

Order matters: everything that can reject the input runs before Ray starts, and the
cluster is checked before any actor is created, so bad input costs seconds.
"""
from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from hostsweep.config.grid import Cell, build_cells, group_by_engine
from hostsweep.config.resolve import Study, resolve
from hostsweep.config.schema import SweepConfig
from hostsweep.measure.results import CellResult, MeasureOptions, cell_row
from hostsweep.record.celltable import CellTable
from hostsweep.record.provenance import driver_tags
from hostsweep.record.tracking import SweepTracker, ui_command
from hostsweep.report.tables import format_table
from hostsweep.run import cluster
from hostsweep.run.dispatch import Dispatcher, FaultPolicy
from hostsweep.run.progress import ProgressReporter

log = logging.getLogger(__name__)


def experiment_name(study: Study) -> str:
    return study.experiment


def sweep_run_name(study: Study, run_dir: Path) -> str:
    """e.g. 'keystone-cpu: cpu/small-llama/eager @ 18-10-29/1' (multirun jobs end in /N)."""
    cfg = study.config
    skus, models = "+".join(s.name for s in study.skus), "+".join(m.name for m in study.models)
    return f"{cfg.study}: {skus}/{models}/{cfg.mode.name} @ {run_dir.parent.name}/{run_dir.name}"


def sweep_params(study: Study, cells: list[Cell]) -> dict[str, object]:
    cfg = study.config
    return {
        "study": cfg.study, "sku": ",".join(s.name for s in study.skus), "model": ",".join(m.name for m in study.models),
        "mode": cfg.mode.name, "tp": sorted({c.engine.tp for c in cells}), "batch": sorted({c.batch for c in cells}),
        "ctx": sorted({c.ctx for c in cells}), "T": cfg.measure.T, "reps": cfg.measure.reps,
        "warmups": cfg.measure.warmups, "engine": cfg.engine.name, "n_cells": len(cells),
    }


def measure_and_record(cfg: SweepConfig, cells: list[Cell], tracker: SweepTracker,
                       table: CellTable) -> None:
    """Dispatch the cells; log each result to MLflow and the table as it arrives."""
    tags = driver_tags()
    total = len(cells)

    def on_result(result: CellResult) -> None:
        run_id = tracker.log_cell(result, tags)
        table.append(cell_row(result, run_id))
        step = f"{result.measurement.step_ms:.3f} ms/step" if result.measurement else result.status
        if result.split is not None:
            step += f", device {result.split.device_ms:.3f} ms, host {result.split.host_frac:.0%}"
        log.info("[%d/%d] %s: %s", len(table.rows), total, result.key, step)

    policy = FaultPolicy(cfg.faults.cell_timeout_s, cfg.faults.max_retries)
    Dispatcher(cells, MeasureOptions.of(cfg), on_result, policy, ProgressReporter(total)).run()


def where_results_are(tracker: SweepTracker, table: CellTable) -> str:
    ui = ui_command(tracker.tracking_uri)
    return (
        f"cell table: {table.path}\n"
        f"MLflow: experiment {tracker.experiment_id}, parent run {tracker.parent_run_id} "
        f"in {tracker.tracking_uri}\n"
        f"open the UI: {ui}\n"
        f"  then browse {tracker.runs_table_url()}"
    )


def skip_finished(cells: list[Cell], tracker: SweepTracker) -> tuple[list[Cell], list[dict[str, object]]]:
    """The cells still to measure, and the table rows of those an earlier run FINISHED."""
    finished = tracker.finished_cells()
    remaining = [c for c in cells if c.key not in finished]
    if len(remaining) < len(cells):
        log.info("resuming: %d of %d cells already FINISHED in experiment %s are skipped "
                 "(resume=false measures them again)", len(cells) - len(remaining), len(cells),
                 tracker.experiment_id)
    return remaining, [finished[c.key] for c in cells if c.key in finished]


def run(raw_cfg: DictConfig, run_dir: Path) -> int:
    """Run the sweep the config describes; return the process exit code."""
    study = resolve(raw_cfg)  # raises ConfigError on bad input, before Ray starts
    cfg = study.config
    grid = build_cells(study)
    log.info("%d cells on %d engine(s)", len(grid), len(group_by_engine(grid)))
    started_here = cluster.connect(cfg.ray.address, cfg.ray.confine_daemons, cfg.ray.idle_daemons)
    try:
        cluster.check_feasible(group_by_engine(grid), cluster.live_nodes())
        tracker = SweepTracker(cfg.tracking.uri, experiment_name(study))
        cells, resumed = skip_finished(grid, tracker) if cfg.resume else (grid, [])
        tracker.start_sweep(sweep_run_name(study, run_dir), OmegaConf.to_yaml(raw_cfg), sweep_params(study, cells),
                            {**driver_tags(), "run_dir": str(run_dir)})
        table = CellTable(run_dir / cfg.output.cells_file, resumed)
        status = "KILLED"
        try:
            measure_and_record(cfg, cells, tracker, table)
            failed = sum(r["status"] != "FINISHED" for r in table.rows)
            status = "FINISHED" if failed == 0 else "FAILED"
        finally:
            tracker.finish_sweep(status, {"cells_done": float(len(table.rows))})
    finally:
        cluster.disconnect(started_here)
    print(format_table(table.study_rows(grid)))
    if table.resumed:
        print(f"({len(table.resumed)} of these cells were FINISHED by earlier runs: `resumed` in {table.path.name})")
    print(where_results_are(tracker, table))
    return 0 if status == "FINISHED" else 1
