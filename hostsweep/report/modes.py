"""Study-level comparisons of modes (pure): each mode's cells against its baseline's, on the
same (sku, model, tp, batch, ctx, workload).

The host-exposed-latency paper [1] (README.md#references), §4.2, reads each optimization
through the host lens; these functions compute its figures from a cell table (cells.csv
rows, or read back from MLflow):
- graph vs eager: per-step reduction, the crossover batch below a threshold, what part of
  the removed time was host and what device;
- fp8 vs bf16: decode ratio, prefill ratio from wall(T=1), launches (or kernels) per step,
  and the FP8 split itself;
- speculative decoding: acceptance, tokens per cycle, per-output-token speedup, per-cycle
  host residual, per workload;
- TP floor: step, host and device per TP degree.
Ratios are baseline / mode, so above 1 means the mode is faster.
"""
from __future__ import annotations

import json
from typing import Any, Iterable, Mapping, Optional

import numpy as np
import pandas as pd

from hostsweep.config.grid import CELL_AXES, ENGINE_AXES, INT_PARAMS, LEGACY_AXIS_VALUES

# A mode's cells meet their baseline's on every other axis of the cell (config/grid.py).
AXES = tuple(a for a in CELL_AXES if a != "mode")
INT_COLUMNS = tuple(a for a in CELL_AXES if a in INT_PARAMS)


def finished_cells(rows: Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    """FINISHED cells as a typed frame (resumed rows come back from MLflow as strings)."""
    frame = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))
    if frame.empty or "status" not in frame:
        return pd.DataFrame(columns=[*AXES, "mode"])
    frame = frame[frame["status"] == "FINISHED"].copy()
    for axis, value in LEGACY_AXIS_VALUES.items():  # rows logged before the axis existed
        frame[axis] = frame[axis].fillna(value) if axis in frame else value
    for column in INT_COLUMNS:
        frame[column] = frame[column].astype(int)
    for column in frame.columns:
        if column.endswith(("_ms", "_frac", "_per_step", "_rate", "_per_cycle")) or column.startswith("spec_"):
            frame[column] = pd.to_numeric(frame[column], errors="coerce")
    return frame.reset_index(drop=True)


def comparison_kind(mode_args: Mapping[str, Any], baseline_args: Mapping[str, Any]) -> str:
    """Which comparison a mode gets, from the engine arguments that differ from its baseline's."""
    differ = {k for k in set(mode_args) | set(baseline_args) if mode_args.get(k) != baseline_args.get(k)}
    for key, kind in (("speculative_config", "spec"), ("quantization", "fp8"), ("enforce_eager", "graph")):
        if key in differ:
            return kind
    return "ratio"


def paired(cells: pd.DataFrame, mode: str, baseline: str) -> pd.DataFrame:
    """One row per cell measured in both modes: the mode's columns end _mode, the baseline's _base."""
    ours = cells[cells["mode"] == mode].drop(columns="mode")
    theirs = cells[cells["mode"] == baseline].drop(columns="mode")
    merged = ours.merge(theirs, on=list(AXES), suffixes=("_mode", "_base"))
    if merged.empty:
        return merged
    merged["speedup"] = merged["step_ms_base"] / merged["step_ms_mode"]
    merged["reduction"] = 1.0 - merged["step_ms_mode"] / merged["step_ms_base"]
    return merged.sort_values(list(AXES)).reset_index(drop=True)


def _column(frame: pd.DataFrame, name: str) -> pd.Series:
    return frame[name] if name in frame else pd.Series(np.nan, index=frame.index)


def _split_columns(pairs: pd.DataFrame) -> pd.DataFrame:
    """Host and device time of both modes, and what the mode removed of each (ms per step)."""
    out = pairs[list(AXES)].copy()
    for side in ("base", "mode"):
        out[f"step_ms_{side}"] = pairs[f"step_ms_{side}"]
        out[f"host_ms_{side}"] = _column(pairs, f"host_ms_{side}")
        # A flagged split (impossible or implausible) keeps device_ms but has no host_ms: its
        # device time is no number to compare modes by (measure/results.split_is_possible).
        out[f"device_ms_{side}"] = _column(pairs, f"device_ms_{side}").where(out[f"host_ms_{side}"].notna())
        out[f"host_frac_{side}"] = _column(pairs, f"host_frac_{side}")
    out["speedup"], out["reduction"] = pairs["speedup"], pairs["reduction"]
    out["host_removed_ms"] = out["host_ms_base"] - out["host_ms_mode"]
    out["device_removed_ms"] = out["device_ms_base"] - out["device_ms_mode"]
    return out


def crossover_batches(table: pd.DataFrame, threshold: float) -> pd.DataFrame:
    """Per value of the other axes (sku, model, tp, ctx, workload), the smallest batch from
    which the reduction stays below `threshold` at every larger batch of the grid (NaN: it
    never falls below)."""
    rows = []
    others = [a for a in AXES if a != "batch"]
    for group, cells in table.groupby(others, sort=True):
        cells = cells.sort_values("batch")
        below = (cells["reduction"] < threshold).to_numpy()
        crossover = np.nan
        for i in range(len(below)):
            if below[i:].all():
                crossover = float(cells["batch"].iloc[i])
                break
        rows.append({**dict(zip(others, group)),
                     "crossover_batch": crossover, "threshold": threshold})
    return pd.DataFrame(rows)


def graph_vs_eager(pairs: pd.DataFrame, threshold: float = 0.05) -> tuple[dict[str, pd.DataFrame], dict[str, float]]:
    """Per-step reduction and its host/device split per cell; crossover batch per context."""
    table = _split_columns(pairs)
    crossover = crossover_batches(table, threshold)
    summary = {"mean_reduction": float(table["reduction"].mean()), "peak_speedup": float(table["speedup"].max()),
               "n_cells": float(len(table))}
    return {"cells": table, "crossover": crossover}, summary


def fp8_vs_bf16(pairs: pd.DataFrame) -> tuple[dict[str, pd.DataFrame], dict[str, float]]:
    """Decode ratio per cell, prefill ratio from wall(T=1), launches and kernels per step."""
    table = _split_columns(pairs)
    table["decode_ratio"] = pairs["speedup"]
    table["prefill_ratio"] = _column(pairs, "wall_1_ms_base") / _column(pairs, "wall_1_ms_mode")
    for what in ("launches", "kernels"):
        base, mode = _column(pairs, f"{what}_per_step_base"), _column(pairs, f"{what}_per_step_mode")
        table[f"{what}_per_step_base"], table[f"{what}_per_step_mode"] = base, mode
        table[f"{what}_ratio"] = mode / base.where(base > 0)
    summary = {
        "mean_decode_ratio": float(table["decode_ratio"].mean()),
        "cells_slower": float((table["decode_ratio"] < 1.0).sum()), "n_cells": float(len(table)),
        "mean_prefill_ratio": float(table["prefill_ratio"].mean()),
        "mean_launches_ratio": float(table["launches_ratio"].mean()),
        "mean_kernels_ratio": float(table["kernels_ratio"].mean()),
        "mean_host_frac": float(table["host_frac_mode"].mean()),
    }
    return {"cells": table}, summary


SPEC_COLUMNS = ("spec_acceptance_rate", "spec_accepted_per_cycle", "spec_tokens_per_cycle", "spec_drafts",
                "spec_cycle_ms", "spec_host_cycle_ms")


def spec_vs_base(pairs: pd.DataFrame) -> tuple[dict[str, pd.DataFrame], dict[str, float]]:
    """Acceptance, tokens per cycle and per-output-token speedup per cell; means per workload."""
    table = _split_columns(pairs)
    for column in SPEC_COLUMNS:
        table[column] = _column(pairs, f"{column}_mode")
    summary: dict[str, float] = {}
    for workload, cells in table.groupby("workload"):
        summary.update({
            f"{workload}/speedup": float(cells["speedup"].mean()),
            f"{workload}/acceptance_rate": float(cells["spec_acceptance_rate"].mean()),
            f"{workload}/accepted_per_cycle": float(cells["spec_accepted_per_cycle"].mean()),
            f"{workload}/tokens_per_cycle": float(cells["spec_tokens_per_cycle"].mean()),
            f"{workload}/host_cycle_ms": float(cells["spec_host_cycle_ms"].mean()),
        })
    return {"cells": table}, summary


def ratio(pairs: pd.DataFrame) -> tuple[dict[str, pd.DataFrame], dict[str, float]]:
    """Any other pair of modes: the per-step ratio and the split of both."""
    table = _split_columns(pairs)
    return {"cells": table}, {"mean_speedup": float(table["speedup"].mean()), "n_cells": float(len(table))}


def tp_floor(cells: pd.DataFrame) -> tuple[dict[str, pd.DataFrame], dict[str, float]]:
    """Step, host and device time per TP degree (the paper [1], §4.1); figures from each mode's
    smallest (batch, ctx) cell. Empty when the study has one TP degree."""
    if cells.empty or cells["tp"].nunique() < 2:
        return {}, {}
    engine = [a for a in ENGINE_AXES if a != "tp" and a in cells]  # one row of figures per engine but TP
    axes = [a for a in CELL_AXES if a != "tp" and a in cells] + ["tp"]  # TP last: the floor reads down it
    keep = [*axes, *(c for c in ("step_ms", "host_ms", "device_ms", "host_frac", "allreduce_backend") if c in cells)]
    table = cells[keep].sort_values(axes).reset_index(drop=True)
    summary: dict[str, float] = {}
    for key, group in table.groupby(engine):
        first = group[(group["batch"] == group["batch"].min()) & (group["ctx"] == group["ctx"].min())]
        name = "/".join(map(str, key if isinstance(key, tuple) else (key,)))
        for _, row in first.iterrows():
            for column in ("step_ms", "host_ms", "device_ms"):
                if column in row and pd.notna(row[column]):
                    summary[f"{name}/tp{int(row['tp'])}/{column}"] = float(row[column])
    return {"tp_floor": table}, summary


COMPARISONS = {"graph": graph_vs_eager, "fp8": fp8_vs_bf16, "spec": spec_vs_base, "ratio": ratio}


def study_summary(cells: pd.DataFrame, pairs_of_modes: Iterable[tuple[str, str, str]],
                  crossover_threshold: float = 0.05) -> tuple[dict[str, pd.DataFrame], dict[str, float]]:
    """Tables and summary figures of a study: one comparison per (mode, baseline, kind) with
    cells in both modes, and the TP floor. Tables are named '<mode>_vs_<baseline>[_<part>]',
    figures '<mode>_vs_<baseline>/<figure>'."""
    tables: dict[str, pd.DataFrame] = {}
    metrics: dict[str, float] = {}
    for mode, baseline, kind in pairs_of_modes:
        pairs = paired(cells, mode, baseline)
        if pairs.empty:
            continue
        kwargs: dict[str, Any] = {"threshold": crossover_threshold} if kind == "graph" else {}
        parts, figures = COMPARISONS[kind](pairs, **kwargs)
        name = f"{mode}_vs_{baseline}"
        tables.update({name if part == "cells" else f"{name}_{part}": frame for part, frame in parts.items()})
        metrics.update({f"{name}/{k}": v for k, v in figures.items()})
    floor_tables, floor_metrics = tp_floor(cells)
    tables.update(floor_tables)
    metrics.update({f"tp_floor/{k}": v for k, v in floor_metrics.items()})
    return tables, metrics


def mode_pairs(modes: Iterable[tuple[str, Optional[str], Mapping[str, Any]]]) -> list[tuple[str, str, str]]:
    """(mode, baseline, kind) for each mode whose baseline is also in the study; `modes` gives
    each mode's name, baseline and engine arguments."""
    modes = list(modes)
    args = {name: engine_args for name, _, engine_args in modes}
    return [(name, baseline, comparison_kind(engine_args, args[baseline]))
            for name, baseline, engine_args in modes if baseline is not None and baseline in args]


def logged_engine_args(cells: pd.DataFrame, mode: str) -> Optional[dict[str, Any]]:
    """The engine arguments a mode's cells logged (their `engine_args` param, canonical JSON);
    None when they logged none (runs older than the param)."""
    if "engine_args" not in cells or "mode" not in cells:
        return None
    for value in cells.loc[cells["mode"] == mode, "engine_args"]:
        if isinstance(value, Mapping):
            return dict(value)
        if isinstance(value, str) and value.strip():
            return json.loads(value)
    return None


def modes_in(cells: pd.DataFrame, baseline: str) -> list[tuple[str, str, str]]:
    """(mode, baseline, kind) for every mode the cells hold besides `baseline`, by name: the
    modes come from the data, the kind from the engine arguments each mode's cells logged
    against the baseline's, so a mode no code names is compared all the same. Where either
    side logged no engine arguments the kind is unknown, and the comparison a plain ratio."""
    present = sorted({str(m) for m in cells["mode"].dropna()}) if "mode" in cells else []
    base_args = logged_engine_args(cells, baseline)
    found = []
    for mode in present:
        args = logged_engine_args(cells, mode)
        if mode != baseline:
            kind = "ratio" if args is None or base_args is None else comparison_kind(args, base_args)
            found.append((mode, baseline, kind))
    return found
