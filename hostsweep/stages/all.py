"""`stage=all`: sweep, then fit and compare the cells of that sweep's grid, in one command.

    python -m hostsweep +experiment=generalize-cpu stage=all

Everything the fit and the report will need of the grid (the fit mode, the training SKU
and TP degree, something held out, H(N)'s TP-1 split cells) is checked against the
planned grid before the sweep starts, so a study that could not be compared fails in
seconds. The comparison reads back exactly the grid's cells (by cell key, resumed cells
of earlier runs included) and runs even when some cells FAILED; the exit code is the
worst of the two.
"""
from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig

from hostsweep.calibrate.terms import base_calibration, host_source
from hostsweep.config.grid import build_cells
from hostsweep.config.resolve import Study
from hostsweep.config.schema import ConfigError
from hostsweep.config.stages import StageInfo
from hostsweep.record.read.selection import fit_cells, planned_cells, train_selection
from hostsweep.record.store import quiet_mlflow
from hostsweep.stages import compare, sweep
from hostsweep.stages.fit import fit_options

STAGE = StageInfo(name="all", help="sweep, then fit and compare the cells of that sweep's grid",
                  sections=("measure", "split", "linearity", "engine", "ray", "faults", "output", "report",
                            "fit", "compare"),
                  docs="tp-model.md")

log = logging.getLogger(__name__)


def check_plan(study: Study) -> list[str]:
    """The fit's and report's checks on the planned grid; returns the grid's cell keys."""
    cfg = study.config
    if cfg.compare.fit_run:
        raise ConfigError("compare.fit_run does not apply to stage=all, which fits the cells it sweeps; "
                          "use stage=compare to report on a logged fit")
    grid = build_cells(study)
    planned = fit_cells(planned_cells(grid), cfg.fit)
    train_sku, train_tp = train_selection(planned, cfg.fit)
    fit_options(study, train_sku, train_tp)
    calibration = base_calibration(cfg.calibration, cfg.fit)
    if host_source(calibration, cfg.fit) == "cells":
        tp1 = planned[(planned["sku"] == train_sku) & (planned["tp"] == 1)]
        if tp1.empty or not cfg.split.enabled or tp1["batch"].nunique() < 2:
            raise ConfigError(f"fit.host=cells fits H(N) to TP-1 split cells of sku {train_sku} at two or more "
                              "batch sizes: add tp 1 and two batches with split.enabled=true, or compose a "
                              "calibration with a host section (calibration=…, fit.calibration_file)")
    return [c.key for c in grid]


def run(raw_cfg: DictConfig, run_dir: Path) -> int:
    quiet_mlflow()
    study = sweep.resolve_sweep(raw_cfg)  # as the sweep will: the same engine_args check
    keys = check_plan(study)
    swept = sweep.run(raw_cfg, run_dir)
    log.info("sweep finished (exit %d); comparing its %d cells", swept, len(keys))
    return max(swept, compare.compare_study(study, run_dir, keys))
