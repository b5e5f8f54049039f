"""`stage=fit`: the TP model fitted on the study's cells, read back from MLflow.

    python -m hostsweep +experiment=generalize-cpu stage=fit
    python -m hostsweep +experiment=tp70b stage=fit calibration=seed002-h100

The cells of `fit.mode` are selected (select.*), those the sweep flagged unstable left
out (fit.exclude_unstable, counted in fit.json's "unstable"), the training selection
checked, the fixed terms assembled (calibrate/terms.py), then `hostsweep.calibrate.fit_command.fit_and_log`
(the same path as `hostsweep-model fit`) fits, writes fit.json and predictions.csv under
the run directory's fit/ and logs the model to the `fit.models_experiment` experiment.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import pandas as pd
from omegaconf import DictConfig

from hostsweep.calibrate.fit_command import FitOutcome, fit_and_log
from hostsweep.calibrate.terms import FixedTerms, check_fit_sources, fixed_terms
from hostsweep.compare.floors import AUTO, floor_bound, floor_setting, machine_engine, resolve_start_floor
from hostsweep.config.redact import redact
from hostsweep.config.resolve import Study
from hostsweep.config.schema import ConfigError, FitConfig
from hostsweep.config.stages import StageInfo
from hostsweep.measure.unstable import Exclusion, exclude_unstable
from hostsweep.model.fit_console import render
from hostsweep.model.study_fit import FitOptions
from hostsweep.model.term_checks import ENGINE, STANDALONE
from hostsweep.stages.noise import newest_calibration
from hostsweep.record.read.selection import Selection, fit_cells, select_cells, train_selection
from hostsweep.stages import resolve_for_reading

STAGE = StageInfo(name="fit", help="fit the TP model on the study's cells read back from MLflow, log it",
                  sections=("select", "fit"),
                  docs="tp-model.md")

log = logging.getLogger(__name__)


def start_floor_in_force(study: Study, cells: Optional[pd.DataFrame]) -> tuple[Optional[float], str]:
    """fit.start_floor_pct as a number (or None) and the line saying where it came from: `auto`
    takes the newest noise calibration of the machine and engine the cells ran on (none before
    there are cells: the plan's check), else fit.start_floor_fallback_pct (compare/floors.py)."""
    cfg = study.config
    try:
        setting = floor_setting(cfg.fit.start_floor_pct, "start_floor_pct")
        fallback = floor_setting(cfg.fit.start_floor_fallback_pct, "start_floor_fallback_pct")
        if fallback == AUTO:
            raise ValueError("start_floor_fallback_pct must be null or a percentage in [0, 100), got 'auto'")
    except ValueError as exc:
        raise ConfigError(f"fit.{exc}") from None
    try:
        floor_bound(cfg.diff.floor_bound)
    except ValueError as exc:
        raise ConfigError(f"diff.{exc}") from None
    where = machine_engine(cells) if cells is not None else None
    calibration = newest_calibration(cfg.tracking.uri, cfg.noise.experiment, where) \
        if setting == AUTO and cells is not None else None
    return resolve_start_floor(setting, calibration, cfg.diff.floor_bound, where, fallback)


def fit_options(study: Study, train_sku: str, train_tp: tuple[int, ...],
                start_floor: Optional[tuple[Optional[float], str]] = None) -> FitOptions:
    """The fit section as FitOptions, checked (a bad value is a one-line ConfigError); its
    between-start floor as start_floor_in_force resolved it (before any cells: without a calibration)."""
    fit = study.config.fit
    check_fit_sources(fit)
    start_floor, _ = start_floor or start_floor_in_force(study, None)
    options = FitOptions(train_sku, train_tp, fit.form, fit.g_mode, fit.bound, fit.utilization, fit.resamples,
                         fit.seed, fit.margin, start_floor_pct=start_floor)
    try:
        options.check()
    except ValueError as exc:
        raise ConfigError(f"fit.{exc}") from None
    if not 0 < fit.utilization <= 1:
        raise ConfigError(f"fit.utilization must be in (0, 1], got {fit.utilization}")
    if fit.resamples < 100:
        raise ConfigError(f"fit.resamples must be >= 100, got {fit.resamples}")
    return options


@dataclass(frozen=True)
class StudyFit:
    """A fit of the selected cells and everything it was built from."""

    selection: Selection
    fixed: FixedTerms
    outcome: FitOutcome
    exclusion: Exclusion  # the unstable cells of fit.mode left out (fit.exclude_unstable)
    floors: str = ""  # where the held-out verdicts' between-start floor came from (start_floor_in_force)

    @property
    def data(self) -> dict:
        return self.outcome.data


def stable_cells(cells: pd.DataFrame, fit: FitConfig) -> tuple[pd.DataFrame, Exclusion]:
    """The cells of fit.mode without those flagged unstable (fit.exclude_unstable), and
    what was left out; a selection with nothing stable left is a ConfigError."""
    kept, exclusion = exclude_unstable(fit_cells(cells, fit), fit.exclude_unstable)
    if kept.empty:
        raise ConfigError(f"fit: every one of the {exclusion.total} cells of mode {fit.mode} is flagged unstable "
                          f"({exclusion.describe()}): measure again on a quieter host, or set "
                          "fit.exclude_unstable=false")
    return kept.reset_index(drop=True), exclusion


def fit_selection(study: Study, selection: Selection, run_dir: Path) -> StudyFit:
    """Fit the selected cells of fit.mode: checks first, then terms, then the fit."""
    cfg = study.config
    cells, exclusion = stable_cells(selection.cells, cfg.fit)
    log.info("fit: %s", exclusion.describe())
    try:
        train_sku, train_tp = train_selection(cells, cfg.fit)
        floors = start_floor_in_force(study, cells)
        options = fit_options(study, train_sku, train_tp, floors)
        fixed = fixed_terms(cells, train_sku, cfg.calibration, cfg.fit, cfg.tracking.uri, cfg.ray.address)
    except ConfigError as exc:
        if not exclusion.count:
            raise
        raise ConfigError(f"{exc} ({exclusion.describe()})") from None
    extra = {"study": study.name, "floors": floors[1], "experiment": selection.experiment, "mode": cfg.fit.mode,
             "cells": len(cells), "sweep_runs": ",".join(selection.parent_runs)[:500],
             "fit.allreduce": cfg.fit.allreduce, **{f"allreduce_path.{sku}": path
                                                    for sku, path in fixed.terms.allreduce_paths.items()},
             **{f"{s['term']}_source.{s['sku']}": s["source"] for s in fixed.sources}}
    host_line = {**fixed.host_line.values(), "fitted": fixed.host_line.describe()} if fixed.host_line else None
    # H fitted to the TP-1 cells' own host time is on the engine's path; the calibration's line is
    # a microbenchmark's (or a paper's): the falsification guard says which (model/term_checks.py)
    terms = replace(fixed.terms, host_path=ENGINE if fixed.host_line else STANDALONE,
                    allreduce_requested=cfg.fit.allreduce)
    outcome = fit_and_log(cells, terms, fixed.skus, options, run_dir / "fit" / "fit.json", cfg.tracking.uri,
                          cfg.fit.models_experiment, "datasheet", extra_params=extra, exclusion=exclusion,
                          host_line=host_line)
    log.info("fit logged as run %s of experiment %s", outcome.run_id, cfg.fit.models_experiment)
    return StudyFit(selection, fixed, outcome, exclusion, floors[1])


def run(raw_cfg: DictConfig, run_dir: Path) -> int:
    study = resolve_for_reading(raw_cfg)
    result = fit_selection(study, select_cells(study), run_dir)
    print(render(result.data))
    for warning in result.fixed.warnings:
        print(f"- {warning}")
    print(result.floors)
    print(f"\nwrote {result.outcome.path} and {result.outcome.path.with_name('predictions.csv')}")
    print(f"logged model: runs:/{result.outcome.run_id}/model "
          f"(experiment {study.config.fit.models_experiment!r} in {redact(study.config.tracking.uri)})")
    return 0
