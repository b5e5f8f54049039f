"""One sweep end to end: validate, plan, check the cluster, measure, record, print.

Order matters: everything that can reject the input runs before Ray starts, and the
cluster is checked before any actor is created, so bad input costs seconds.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import pandas as pd
from omegaconf import DictConfig, OmegaConf

from hostsweep.run import cluster
from hostsweep.config.schema import SweepConfig, sweep_skus, to_sweep_config
from hostsweep.run.dispatch import Dispatcher, FaultPolicy
from hostsweep.config.grid import Cell, build_cells, group_by_engine
from hostsweep.run.progress import ProgressReporter
from hostsweep.record.provenance import driver_tags
from hostsweep.report.tables import cell_row, format_table
from hostsweep.record.tracking import SweepTracker
from hostsweep.run.worker import CellResult, MeasureOptions

log = logging.getLogger(__name__)


def experiment_name(cfg: SweepConfig) -> str:
    return cfg.tracking.experiment or f"hostsweep-{cfg.study}"


def sweep_run_name(cfg: SweepConfig, run_dir: Path) -> str:
    """e.g. 'keystone-cpu: cpu/small-llama/eager @ 18-10-29/1' (multirun jobs end in /N)."""
    skus = "+".join(s.name for s in sweep_skus(cfg))
    return f"{cfg.study}: {skus}/{cfg.model.name}/{cfg.mode.name} @ {run_dir.parent.name}/{run_dir.name}"


def sweep_params(cfg: SweepConfig, cells: list[Cell]) -> dict[str, object]:
    return {
        "study": cfg.study, "sku": ",".join(s.name for s in sweep_skus(cfg)), "model": cfg.model.name, "mode": cfg.mode.name,
        "tp": sorted({c.engine.tp for c in cells}), "batch": sorted({c.batch for c in cells}),
        "ctx": sorted({c.ctx for c in cells}), "T": cfg.measure.T, "reps": cfg.measure.reps,
        "warmups": cfg.measure.warmups, "engine": cfg.engine.name, "n_cells": len(cells),
    }


def measure_options(cfg: SweepConfig) -> MeasureOptions:
    return MeasureOptions(
        resamples=cfg.measure.bootstrap_resamples,
        ci_level=cfg.measure.ci_level,
        split=cfg.split.enabled,
        split_reps=cfg.split.reps,
        host_bound_threshold=cfg.split.host_bound_threshold,
        top_ops=cfg.split.top_ops,
        keep_traces=cfg.split.keep_traces,
        linearity_T=tuple(sorted(set(cfg.linearity.T))) if cfg.linearity.enabled else (),
        linearity_reps=cfg.linearity.reps,
        pyspy_seconds=cfg.split.pyspy_seconds if cfg.split.pyspy else 0.0,
    )


class CellTable:
    """The cell table in the run directory, rewritten after every cell so none is lost.

    A resumed sweep's table holds the whole study: the cells FINISHED by earlier runs
    (`resumed` true, their own MLflow run ids) and the ones measured now (`rows`)."""

    def __init__(self, path: Path, resumed: list[dict[str, object]] | None = None) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.resumed = [{**row, "resumed": True} for row in resumed or []]
        self.rows: list[dict[str, object]] = []
        self._write()

    def append(self, row: dict[str, object]) -> None:
        self.rows.append({**row, "resumed": False})
        self._write()

    def study_rows(self, cells: list[Cell]) -> list[dict[str, object]]:
        """Every row, earlier and new, in grid order."""
        order = {cell.key: i for i, cell in enumerate(cells)}
        return sorted(self.resumed + self.rows, key=lambda row: order.get(str(row["cell_key"]), len(order)))

    def _write(self) -> None:
        if self.resumed or self.rows:
            pd.DataFrame(self.resumed + self.rows).to_csv(self.path, index=False)


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
    Dispatcher(cells, measure_options(cfg), on_result, policy, ProgressReporter(total)).run()


def where_results_are(tracker: SweepTracker, table: CellTable) -> str:
    # The interpreter that ran the sweep has mlflow, whether or not its venv is activated.
    ui = f"{sys.executable} -m mlflow ui --backend-store-uri {tracker.tracking_uri} --port 5000"
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
    cfg = to_sweep_config(raw_cfg)
    study = build_cells(cfg)  # raises ConfigError on bad input, before Ray starts
    log.info("%d cells on %d engine(s)", len(study), len(group_by_engine(study)))
    started_here = cluster.connect(cfg.ray.address, cfg.ray.confine_daemons, cfg.ray.idle_daemons)
    try:
        cluster.check_feasible(group_by_engine(study), cluster.live_nodes())
        tracker = SweepTracker(cfg.tracking.uri, experiment_name(cfg))
        cells, resumed = skip_finished(study, tracker) if cfg.resume else (study, [])
        tracker.start_sweep(sweep_run_name(cfg, run_dir), OmegaConf.to_yaml(raw_cfg), sweep_params(cfg, cells),
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
    print(format_table(table.study_rows(study)))
    if table.resumed:
        print(f"({len(table.resumed)} of these cells were FINISHED by earlier runs: `resumed` in {table.path.name})")
    print(where_results_are(tracker, table))
    return 0 if status == "FINISHED" else 1
