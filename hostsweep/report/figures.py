"""Figures of hostsweep (pure; matplotlib on the Agg backend, no display needed).

One function per figure: each takes DataFrames (cell tables, the fit's per-cell
predictions, tables from report/comparison.py) and returns a matplotlib Figure; `save`
writes it as a PNG and closes it. The style helpers (`panels`, `colors`, `save`) are
shared, so the sweep summary's figures use the same look.

The sweep's own (logged on its parent run, written to the run directory's figures/):
    split_composition      device and host ms per decode step of every cell, stacked, CI on top
    host_fraction_by_batch host fraction against batch, a line per ctx, the regime threshold drawn
    step_times             per-cell step time with CI bars across batch and ctx, one panel per SKU
                           (shared with the comparison report)
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

import matplotlib

matplotlib.use("Agg")  # before pyplot: figures are written to files, never shown
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf")
# The decode-step pieces, in seed 002's colours: compute green, all-reduce amber, host red.
PIECES = {"compute": "#2ca02c", "all-reduce": "#ff9f1c", "host / additive": "#d62728"}
FAMILY_COLORS = {"none": "#7f7f7f", "k-invariant": "#2ca02c", "k-scaling": "#d62728"}


def colors(keys: Iterable[object]) -> dict[object, str]:
    """A stable colour per key, in the order given."""
    return {key: PALETTE[i % len(PALETTE)] for i, key in enumerate(dict.fromkeys(keys))}


def panels(count: int, width: float = 5.0, height: float = 3.8, columns: int = 3,
           sharey: bool = False) -> tuple[Figure, list[plt.Axes]]:
    """A figure with `count` panels in rows of at most `columns`; unused axes hidden."""
    count = max(count, 1)
    cols = min(count, columns)
    rows = -(-count // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False, sharey=sharey,
                             layout="constrained")
    flat = list(axes.ravel())
    for ax in flat[count:]:
        ax.set_visible(False)
    for ax in flat:
        ax.grid(True, alpha=0.3)
    return fig, flat[:count]


def empty(message: str) -> Figure:
    """A figure that says why there is nothing to draw (a section stays, not a crash)."""
    fig, (ax,) = panels(1, 6, 2)
    ax.axis("off")
    ax.text(0.5, 0.5, message, ha="center", va="center", wrap=True)
    return fig


def save(fig: Figure, path: Path, dpi: int = 110) -> Path:
    """Write a PNG (folders created) and release the figure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return path


def _label(row: pd.Series, keys: Sequence[str]) -> str:
    return " ".join(f"{k}={row[k]}" for k in keys)


def _ci_yerr(frame: pd.DataFrame) -> np.ndarray | None:
    if "step_ci_low_ms" not in frame or frame["step_ci_low_ms"].isna().all():
        return None
    low = (frame["step_ms"] - frame["step_ci_low_ms"]).clip(lower=0)
    high = (frame["step_ci_high_ms"] - frame["step_ms"]).clip(lower=0)
    return np.vstack([low.to_numpy(float), high.to_numpy(float)])


def step_times(cells: pd.DataFrame) -> Figure:
    """Step time per cell with its 95% CI across batch, one line per (model, mode, TP,
    ctx), one panel per SKU."""
    if cells.empty:
        return empty("no cells")
    groups = list(cells.groupby("sku"))
    fig, axes = panels(len(groups), 6.0, 4.2, columns=2)
    for ax, (sku, rows) in zip(axes, groups):
        keys = ["model", "mode", "tp", "ctx"]
        palette = colors(tuple(k) for k in rows[keys].drop_duplicates().itertuples(index=False))
        for key, line in rows.sort_values("batch").groupby(keys):
            ax.errorbar(line["batch"], line["step_ms"], yerr=_ci_yerr(line), marker="o", ms=4, capsize=3,
                        color=palette[tuple(key)], label=f"{key[0]} {key[1]} TP-{key[2]} ctx {key[3]}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(rows["batch"].unique()), [str(b) for b in sorted(rows["batch"].unique())])
        ax.set_xlabel("batch N")
        ax.set_ylabel("ms per decode step (95% CI)")
        ax.set_title(f"{sku}: step time per cell", fontsize=10)
        ax.legend(fontsize=7)
    return fig


# How the sweep's figures are written, to its run directory and to MLflow alike.
SAVE_KWARGS = {"dpi": 110, "bbox_inches": "tight"}
# The sweep's split, in the comparison figures' host red; device time a muted blue.
SPLIT_COLORS = {"device": "#4c72b0", "host": "#d62728"}
ENGINE_KEYS = ["sku", "model", "mode", "tp"]


def _engines(cells: pd.DataFrame) -> list[tuple[tuple, pd.DataFrame]]:
    """The cells grouped per engine (sku, model, mode, tp), in a stable order."""
    return list(cells.groupby(ENGINE_KEYS, sort=True))


def _engine_title(key: tuple) -> str:
    sku, model, mode, tp = key
    return f"{sku} {model} {mode} TP-{tp}"


def split_composition(cells: pd.DataFrame) -> Figure:
    """Every split cell's decode step as device ms (below) and host ms (above), with the
    step's 95% CI on top, one panel per engine (sku, model, mode, tp), cells by ctx then batch."""
    split = cells.dropna(subset=["device_ms", "host_ms"]) if {"device_ms", "host_ms"} <= set(cells) else cells.iloc[0:0]
    if split.empty:
        return empty("no split cells (split.enabled=false): nothing to compose")
    groups = _engines(split)
    fig, axes = panels(len(groups), max(6.0, 0.55 * split.groupby(ENGINE_KEYS).size().max() + 1.5), 3.8, columns=2)
    for ax, (key, rows) in zip(axes, groups):
        rows = rows.sort_values(["ctx", "batch"])
        x = np.arange(len(rows))
        device, host = rows["device_ms"].to_numpy(float), rows["host_ms"].to_numpy(float).clip(min=0)
        ax.bar(x, device, 0.7, color=SPLIT_COLORS["device"], label="device (kernels / compute ops)")
        ax.bar(x, host, 0.7, bottom=device, color=SPLIT_COLORS["host"], label="host (step − device)")
        ax.errorbar(x, rows["step_ms"], yerr=_ci_yerr(rows), fmt="none", ecolor="k", capsize=3,
                    label="step, 95% CI")
        for i, frac in enumerate(rows["host_frac"].to_numpy(float)):
            ax.text(i, device[i] + host[i] / 2, f"{frac:.2f}", ha="center", va="center", fontsize=7, color="white")
        ax.set_xticks(x, [f"b{b}\nctx{c}" for b, c in zip(rows["batch"], rows["ctx"])], fontsize=8)
        ax.set_ylabel("ms per decode step")
        ax.set_title(_engine_title(key), fontsize=10)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncol=3, fontsize=8)
    fig.suptitle("Decode step = device + host, per cell (bar labels: host_frac)", fontsize=11)
    return fig


def host_fraction_by_batch(cells: pd.DataFrame, threshold: float = 0.5) -> Figure:
    """Host fraction against batch, a line per ctx, one panel per engine; at or above
    `threshold` (dashed) a cell is host-bound."""
    split = cells.dropna(subset=["host_frac"]) if "host_frac" in cells else cells.iloc[0:0]
    if split.empty:
        return empty("no split cells (split.enabled=false): no host fraction to plot")
    groups = _engines(split)
    fig, axes = panels(len(groups), 5.6, 3.8, columns=2)
    for ax, (key, rows) in zip(axes, groups):
        palette = colors(sorted(rows["ctx"].unique()))
        for ctx, line in rows.sort_values("batch").groupby("ctx"):
            ax.plot(line["batch"], line["host_frac"], marker="o", color=palette[ctx], label=f"ctx {ctx}")
        ax.axhline(threshold, color="k", ls="--", lw=1, label=f"host-bound at {threshold:g}")
        batches = sorted(rows["batch"].unique())
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_ylim(0, 1)
        ax.set_xlabel("batch N")
        ax.set_ylabel("host_frac (host / step)")
        ax.set_title(_engine_title(key), fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle("Host fraction against batch, per context length", fontsize=11)
    return fig
