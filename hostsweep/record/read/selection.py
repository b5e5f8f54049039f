"""Which cells the fit and compare stages work on: the study's FINISHED cell runs read back
from MLflow (never a sweep's private files), and the training selection checked against
them. Every mistake is a one-line ConfigError raised before anything expensive runs.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import pandas as pd

from hostsweep.config.grid import CELL_AXES, Cell
from hostsweep.config.redact import redact
from hostsweep.config.resolve import Study
from hostsweep.config.schema import ConfigError, FitConfig
from hostsweep.config.validation import positive_ints
from hostsweep.record.read.readback import FilterRefused, experiment_ids, read_cells
from hostsweep.record.store import local_artifact_root

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Selection:
    """The selected cells (all modes, one row per cell key, the latest run of each) and
    where they came from."""

    cells: pd.DataFrame
    experiment: str
    experiment_id: str
    tracking_uri: str

    @property
    def parent_runs(self) -> list[str]:
        return sorted(self.cells["parent_run_id"].dropna().unique())


def _store_exists(tracking_uri: str) -> bool:
    root = local_artifact_root(tracking_uri)  # None for a server: it answers for itself
    return root is None or Path(tracking_uri[len("sqlite:///"):]).is_file()


def _where(study: Study) -> str:
    select = study.config.select
    parts = [f"parent run {select.parent_run}" if select.parent_run else "",
             f"filter {select.filter!r}" if select.filter else ""]
    return " ".join(p for p in parts if p)


def select_cells(study: Study, keys: Optional[Iterable[str]] = None) -> Selection:
    """The study's FINISHED cell runs; only those whose cell key is in `keys` when given
    (stage=all: the cells of the grid it just swept, resumed ones included)."""
    cfg = study.config
    uri, name = cfg.tracking.uri, cfg.select.experiment or study.experiment
    if not _store_exists(uri):
        raise ConfigError(f"select: no MLflow store at {redact(uri)}; run the sweep first (stage=sweep or stage=all)")
    known = experiment_ids(uri)
    if name not in known:
        raise ConfigError(f"select.experiment={name!r} does not exist in {redact(uri)}; experiments there: "
                          f"{', '.join(sorted(known)) or 'none'}")
    try:
        cells = read_cells(uri, [name], cfg.select.parent_run, cfg.select.filter)
    except FilterRefused as exc:
        raise ConfigError(f"select.filter={cfg.select.filter!r} was refused by MLflow: {exc}") from None
    if not cells.empty and keys is not None:  # read_cells keeps one run per cell key, the newest
        cells = cells[cells["cell_key"].isin(set(keys))]
    if cells.empty:
        where = _where(study)
        raise ConfigError(f"select: no FINISHED cell runs in experiment {name!r}{' (' + where + ')' if where else ''}"
                          f" of {redact(uri)}; run the sweep first (stage=sweep) or change select.*")
    log.info("selected %d cells from experiment %s", len(cells), name)
    return Selection(in_grid_order(cells), name, known[name], uri)


def in_grid_order(cells: pd.DataFrame) -> pd.DataFrame:
    """The cells sorted by the grid's axes (config/grid.py), as the fit and report list them."""
    return cells.sort_values([a for a in CELL_AXES if a in cells]).reset_index(drop=True)


def planned_cells(cells: list[Cell]) -> pd.DataFrame:
    """The grid as the frame a selection would give, to check the fit before measuring."""
    return pd.DataFrame([{**c.params(), "cell_key": c.key} for c in cells])


def fit_cells(cells: pd.DataFrame, fit: FitConfig) -> pd.DataFrame:
    """The cells of the mode the model is fitted on."""
    modes = sorted(cells["mode"].unique())
    if fit.mode not in modes:
        raise ConfigError(f"fit.mode={fit.mode} has no cells in the selection; modes with cells: {', '.join(modes)}")
    return cells[cells["mode"] == fit.mode].reset_index(drop=True)


def train_selection(cells: pd.DataFrame, fit: FitConfig) -> tuple[str, tuple[int, ...]]:
    """(train SKU, train TP degrees): as configured, or the only SKU and its lowest TP."""
    skus = sorted(cells["sku"].unique())
    sku = fit.train_sku
    if sku is None:
        if len(skus) > 1:
            raise ConfigError(f"fit.train_sku is required: the selection spans SKUs {', '.join(skus)}")
        sku = skus[0]
    if sku not in skus:
        raise ConfigError(f"fit.train_sku={sku} has no cells in the selection; SKUs with cells: {', '.join(skus)}")
    degrees = sorted(int(k) for k in cells.loc[cells["sku"] == sku, "tp"].unique())
    train = positive_ints("fit.train_tp", fit.train_tp) if fit.train_tp is not None else [degrees[0]]
    missing = sorted(set(train) - set(degrees))
    if missing:
        raise ConfigError(f"fit.train_tp={missing} has no cells of sku {sku}; "
                          f"its TP degrees: {', '.join(map(str, degrees))}")
    held = ~((cells["sku"] == sku) & cells["tp"].isin(train))
    if not held.any():
        raise ConfigError(f"fit: nothing is held out: every selected cell is sku {sku} at tp {train}; "
                          "measure another TP degree or SKU, or train on fewer (fit.train_tp)")
    return sku, tuple(train)
