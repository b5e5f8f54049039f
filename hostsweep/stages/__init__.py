"""stages: the data flow wired end to end, one module per `stage=` of the main command.
The only package that may import every other one; __main__ picks the stage.

Each module declares itself in one line, `STAGE = StageInfo(name=..., help=...,
sections=(...))` (hostsweep/config/stages.py reads those lines without importing the
modules): `STAGES`, `--help` and docs/configuring.md's stage table come from them.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Protocol

from omegaconf import DictConfig

from hostsweep.config.resolve import Study, resolve
from hostsweep.config.schema import STAGES, ConfigError


class Stage(Protocol):
    def run(self, raw_cfg: DictConfig, run_dir: Path) -> int: ...


def stage_module(raw_cfg: DictConfig) -> Stage:
    """The module of the configured `stage=` (imported lazily: a sweep never loads the
    report's plotting code, and bad input fails before anything heavy is imported)."""
    stage = raw_cfg.get("stage", "sweep")
    if stage not in STAGES:
        raise ConfigError(f"stage={stage!r} is not allowed; allowed: {', '.join(STAGES)}")
    return importlib.import_module(f"hostsweep.stages.{stage}")  # type: ignore[return-value]


def resolve_for_reading(raw_cfg: DictConfig) -> Study:
    """The study of a stage that reads the store (fit, compare, diff): MLflow's chatter kept
    off the console, the config resolved (bad input refused), and the server's artifact
    destination mapped when one is set (tracking.artifacts)."""
    from hostsweep.record.store import quiet_mlflow, serve_artifacts_from

    quiet_mlflow()
    study = resolve(raw_cfg)
    serve_artifacts_from(study.config.tracking.artifacts)
    return study
