"""`stage=fit`: the TP model fitted on the study's cells, read back from MLflow.

    python -m hostsweep +experiment=generalize-cpu stage=fit
    python -m hostsweep +experiment=tp70b stage=fit calibration=seed002-h100

The cells of `fit.mode` are selected (select.*), the training selection checked, the
fixed terms assembled (stages/terms.py), then `hostsweep.model.fit_command.fit_and_log`
(the same path as `hostsweep-model fit`) fits, writes fit.json and predictions.csv under
the run directory's fit/ and logs the model to the `fit.models_experiment` experiment.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from omegaconf import DictConfig

from hostsweep.config.redact import redact
from hostsweep.config.resolve import Study, resolve
from hostsweep.config.schema import ConfigError
from hostsweep.model.fit_command import FitOutcome, fit_and_log
from hostsweep.model.fit_console import render
from hostsweep.model.study_fit import FitOptions
from hostsweep.record.store import quiet_mlflow
from hostsweep.stages.select import Selection, fit_cells, select_cells, train_selection
from hostsweep.stages.terms import FixedTerms, check_fit_sources, fixed_terms

log = logging.getLogger(__name__)


def fit_options(study: Study, train_sku: str, train_tp: tuple[int, ...]) -> FitOptions:
    """The fit section as FitOptions, checked (a bad value is a one-line ConfigError)."""
    fit = study.config.fit
    check_fit_sources(fit)
    options = FitOptions(train_sku, train_tp, fit.form, fit.g_mode, fit.bound, fit.utilization, fit.resamples,
                         fit.seed, fit.margin)
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

    @property
    def data(self) -> dict:
        return self.outcome.data


def fit_selection(study: Study, selection: Selection, run_dir: Path) -> StudyFit:
    """Fit the selected cells of fit.mode: checks first, then terms, then the fit."""
    cfg = study.config
    cells = fit_cells(selection.cells, cfg.fit)
    train_sku, train_tp = train_selection(cells, cfg.fit)
    options = fit_options(study, train_sku, train_tp)
    fixed = fixed_terms(cells, train_sku, cfg.calibration, cfg.fit, cfg.tracking.uri, cfg.ray.address)
    extra = {"study": study.name, "experiment": selection.experiment, "mode": cfg.fit.mode,
             "cells": len(cells), "sweep_runs": ",".join(selection.parent_runs)[:500],
             **{f"{s['term']}_source.{s['sku']}": s["source"] for s in fixed.sources}}
    outcome = fit_and_log(cells, fixed.terms, fixed.skus, options, run_dir / "fit" / "fit.json", cfg.tracking.uri,
                          cfg.fit.models_experiment, "datasheet", extra_params=extra)
    log.info("fit logged as run %s of experiment %s", outcome.run_id, cfg.fit.models_experiment)
    return StudyFit(selection, fixed, outcome)


def run(raw_cfg: DictConfig, run_dir: Path) -> int:
    quiet_mlflow()
    study = resolve(raw_cfg)
    result = fit_selection(study, select_cells(study), run_dir)
    print(render(result.data))
    for warning in result.fixed.warnings:
        print(f"- {warning}")
    print(f"\nwrote {result.outcome.path} and {result.outcome.path.with_name('predictions.csv')}")
    print(f"logged model: runs:/{result.outcome.run_id}/model "
          f"(experiment {study.config.fit.models_experiment!r} in {redact(study.config.tracking.uri)})")
    return 0
