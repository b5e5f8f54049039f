"""Figures of hostsweep (pure; matplotlib on the Agg backend, no display needed).

One function per figure: each takes DataFrames (cell tables, the fit's per-cell
predictions, tables from report/fit_tables.py) and returns a matplotlib Figure; `save`
writes it as a PNG and closes it. The style helpers (`panels`, `colors`, `save`) are
shared, so the sweep summary's figures use the same look.

The comparison report's:
    step_composition       decode-step composition per TP degree, stacked bars
    predicted_vs_measured  the model against the measurement, out-of-regime starred, falsifying marked
    heldout_mape           held-out MAPE per host form with bootstrap CIs, one panel per group
    regime_map             host fraction over model size × TP and batch, one panel per SKU
The sweep's own (logged on its parent run, written to the run directory's figures/):
    split_composition      device and host ms per decode step of every cell, stacked, CI on top
    host_fraction_by_batch host fraction against batch, a line per ctx, the regime threshold drawn
    host_phases            each cell's step as device + each named host phase + the unnamed rest
Both:
    step_times             per-cell step time with CI bars across batch and ctx, one panel per SKU
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional, Sequence

import matplotlib

matplotlib.use("Agg")  # before pyplot: figures are written to files, never shown
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from hostsweep.config.grid import ENGINE_AXES  # noqa: E402
from hostsweep.measure.unstable import unstable_mask  # noqa: E402  (cells drawn hollow or hatched)
from hostsweep.report.tables import phase_columns  # noqa: E402

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf")
# The decode-step pieces, in the colours of the tensor-parallel study [2] (README.md#references):
# compute green, all-reduce amber, host red.
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


def subtitle(fig: Figure, text: str) -> None:
    """A line under the figure's title (the sweep's: the machine, vLLM and dtype its cells ran
    on, which move every number drawn), in the title's size; the title itself when it has none."""
    title = fig._suptitle  # noqa: SLF001 - the Text matplotlib keeps (get_suptitle gives only its string)
    if title is None or not title.get_text():
        fig.suptitle(text, fontsize=9)
    else:
        fig.suptitle(f"{title.get_text()}\n{text}", fontsize=title.get_fontsize())


def save(fig: Figure, path: Path, dpi: int = 110) -> Path:
    """Write a PNG (folders created) and release the figure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return path


def _label(row: pd.Series, keys: Sequence[str]) -> str:
    return " ".join(f"{k}={row[k]}" for k in keys)


def step_composition(pred: pd.DataFrame) -> Figure:
    """Per (SKU, model): the measured step at each TP degree split into g·T_cmp/k,
    T_ar and the rest (step − both: what the additive host term must explain), at the
    smallest batch and longest context measured at every degree (the TP study [2]: N=1, ctx 2048),
    or at the most degrees any (batch, ctx) has."""
    groups = list(pred.groupby(["sku", "model"]))
    if not groups:
        return empty("no cells")
    fig, axes = panels(len(groups), 4.2, 3.8)
    for ax, ((sku, model), cells) in zip(axes, groups):
        # the point with every degree; where none has (unstable cells left out), the most any has
        shared = cells.groupby(["batch", "ctx"])["tp"].nunique()
        most = shared[shared == shared.max()].index
        batch = min(b for b, _ in most)
        ctx = max(c for b, c in most if b == batch)
        chosen = cells[(cells["batch"] == batch) & (cells["ctx"] == ctx)].groupby("tp").mean(numeric_only=True)
        x = np.arange(len(chosen))
        measured = "device_ms" in chosen and bool(chosen["device_ms"].notna().any())
        width, offset = (0.38, -0.2) if measured else (0.6, 0.0)
        pieces = {"compute": chosen["compute_ms"], "all-reduce": chosen["allreduce_ms"],
                  "host / additive": (chosen["step_ms"] - chosen["compute_ms"] - chosen["allreduce_ms"]).clip(lower=0)}
        bottom = np.zeros(len(chosen))
        for name, values in pieces.items():
            ax.bar(x + offset, values.to_numpy(), width, bottom=bottom, color=PIECES[name], label=f"model: {name}")
            bottom += values.to_numpy()
        if measured:
            _measured_composition(ax, x + 0.2, width, chosen)
        ax.errorbar(x, chosen["step_ms"], yerr=_ci_yerr(chosen), fmt="k_", ms=18, capsize=4, label="measured step, 95% CI")
        ax.set_xticks(x, [f"TP-{k}" for k in chosen.index])
        ax.set_title(f"{sku} {model}: N={batch}, ctx {ctx}", fontsize=10)
        ax.set_ylabel("ms per decode step")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncol=4, fontsize=8)
    # the T_ar in use: calibrated, or a group's in-situ all-reduce where the calibration missed it
    fig.suptitle("Decode-step composition: the model's pieces (left; host = measured − compute − the all-reduce "
                 "T_ar in use) and, where split, the measured ones (right, hatched)", fontsize=10)
    return fig


def _measured_composition(ax: plt.Axes, x: np.ndarray, width: float, chosen: pd.DataFrame) -> None:
    """The measured step beside the model's: device compute, the all-reduce in situ (rank 0,
    from the cells' own traces; 0 at TP-1) and the host-exposed rest (model/term_checks)."""
    insitu = chosen["allreduce_insitu_ms"].fillna(0.0) if "allreduce_insitu_ms" in chosen else 0.0 * chosen["device_ms"]
    insitu = insitu.where(chosen.index.to_series() > 1, 0.0)
    pieces = {"compute": chosen["device_ms"] - insitu, "all-reduce": insitu,
              "host / additive": chosen["host_ms"].clip(lower=0) if "host_ms" in chosen else 0.0 * insitu}
    bottom = np.zeros(len(chosen))
    for name, values in pieces.items():
        heights = values.fillna(0.0).to_numpy(float)
        ax.bar(x, heights, width, bottom=bottom, color=PIECES[name], hatch="//", edgecolor="white",
               label=f"measured: {name}{' in situ' if name == 'all-reduce' else ''}")
        bottom += heights


def _ci_yerr(frame: pd.DataFrame) -> np.ndarray | None:
    if "step_ci_low_ms" not in frame or frame["step_ci_low_ms"].isna().all():
        return None
    low = (frame["step_ms"] - frame["step_ci_low_ms"]).clip(lower=0)
    high = (frame["step_ci_high_ms"] - frame["step_ms"]).clip(lower=0)
    return np.vstack([low.to_numpy(float), high.to_numpy(float)])


def predicted_vs_measured(pred: pd.DataFrame, column: str = "predicted_ms") -> Figure:
    """Every cell's prediction (the chosen form) against its measured step and CI; colour
    per (SKU, TP, role); out-of-regime cells as stars, falsifying cells circled red."""
    fig, (ax,) = panels(1, 6.4, 5.6)
    pred = pred.assign(group=pred["sku"] + " TP-" + pred["tp"].astype(str) + " " + pred["role"])
    palette = colors(sorted(pred["group"].unique()))
    for group, cells in pred.groupby("group"):
        inside, outside = cells[cells["in_regime"]], cells[~cells["in_regime"]]
        if len(inside):
            ax.errorbar(inside["step_ms"], inside[column], xerr=_ci_yerr(inside), fmt="o", ms=5, color=palette[group],
                        alpha=0.85, capsize=2, label=group)
        if len(outside):
            ax.scatter(outside["step_ms"], outside[column], marker="*", s=160, color=palette[group],
                       edgecolors="k", label=f"{group}, out of regime")
    falsifying = pred[pred.get("falsifies", pd.Series(False, index=pred.index)).astype(bool)]
    if len(falsifying):
        ax.scatter(falsifying["step_ms"], falsifying[column], s=220, facecolors="none", edgecolors="red",
                   linewidths=2, label="falsifying (CI below H + T_ar)")
    limit = [0, 1.08 * float(np.nanmax([pred["step_ms"].max(), pred[column].max()]))]
    ax.plot(limit, limit, "k--", lw=1, label="predicted = measured")
    ax.set_xlim(limit)
    ax.set_ylim(limit)
    ax.set_xlabel("measured step, ms (95% CI)")
    ax.set_ylabel("predicted step, ms")
    ax.set_title("Predicted vs measured, every cell", fontsize=11)
    ax.legend(fontsize=7, loc="upper left")
    return fig


def heldout_mape(table: pd.DataFrame, families: dict[str, str] | None = None) -> Figure:
    """Held-out MAPE of each host form (form_mape's table), one panel per (SKU, TP) group,
    bars coloured by family with their bootstrap 95% CIs."""
    if table.empty:
        return empty("no held-out in-regime cells")
    groups = list(table.groupby(["sku", "tp"]))
    fig, axes = panels(len(groups), 4.6, 3.6)
    for ax, ((sku, tp), rows) in zip(axes, groups):
        x = np.arange(len(rows))
        fill = [FAMILY_COLORS.get((families or {}).get(f, "none"), "#1f77b4") for f in rows["form"]]
        yerr = np.vstack([(rows["mape"] - rows["ci_low"]).clip(lower=0), (rows["ci_high"] - rows["mape"]).clip(lower=0)])
        ax.bar(x, rows["mape"], color=fill, yerr=yerr, capsize=3)
        ax.set_xticks(x, rows["form"], rotation=35, ha="right", fontsize=8)
        ax.set_title(f"held-out {sku} TP-{tp} ({int(rows['n'].iloc[0])} cells)", fontsize=10)
        ax.set_ylabel("MAPE, % (95% CI)")
    fig.suptitle("Held-out error per host form (green k-invariant, red k-scaling, grey baseline)", fontsize=11)
    return fig


def regime_map(table: pd.DataFrame, threshold: float = 0.5) -> Figure:
    """Host fraction as a heat map: rows (model by size, TP), columns batch, one panel per
    (SKU, mode); each square says its regime (report/fit_tables.regime_table): bold host-bound,
    '?' undetermined (its CI straddles `threshold`, or too few profiled pairs for one), '~'
    mixed over its contexts."""
    if table.empty:
        return empty("no split cells (split.enabled=false): no host fraction to map")
    groups = list(table.groupby(["sku", "mode"]))
    fig, axes = panels(len(groups), 5.2, 3.6, columns=2)
    for ax, ((sku, mode), cells) in zip(axes, groups):
        cells = cells.sort_values(["params_M", "model", "tp"])
        rows = list(dict.fromkeys(zip(cells["model"], cells["tp"])))
        size = dict(zip(cells["model"], cells["params_M"]))
        batches = sorted(cells["batch"].unique())
        grid = np.full((len(rows), len(batches)), np.nan)
        regime: dict[tuple[int, int], str] = {}
        for r in cells.itertuples():
            at = rows.index((r.model, r.tp)), batches.index(r.batch)
            grid[at] = r.host_frac
            regime[at] = str(getattr(r, "regime", "")) or ("host-bound" if r.host_frac >= threshold else "device-bound")
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn_r", aspect="auto")
        for (i, j), value in np.ndenumerate(grid):
            if np.isfinite(value):
                mark = {"undetermined": " ?", "mixed": " ~"}.get(regime[i, j], "")
                ax.text(j, i, f"{value:.0%}{mark}", ha="center", va="center", fontsize=8,
                        fontweight="bold" if regime[i, j] == "host-bound" else "normal")
        ax.set_xticks(range(len(batches)), [f"N={b}" for b in batches])
        ax.set_yticks(range(len(rows)), [f"{m} ({size[m]:g} M) TP-{k}" for m, k in rows], fontsize=8)
        ax.set_title(f"{sku} {mode}: host fraction (bold host-bound, ? undetermined, ~ mixed)", fontsize=10)
        ax.grid(False)
        fig.colorbar(image, ax=ax, fraction=0.04)
    return fig


def _hollow_unstable(ax: plt.Axes, x: pd.Series, y: pd.Series, rows: pd.DataFrame, color: str) -> None:
    """Circle the unstable cells' points with a hollow marker (labelled once per axes)."""
    mask = unstable_mask(rows)
    if mask.any():
        labelled = any(h.get_label() == "unstable cell (hollow)" for h in ax.collections)
        ax.scatter(np.asarray(x)[mask], np.asarray(y)[mask], s=90, facecolors="white", edgecolors=color,
                   linewidths=1.5, zorder=3, label=None if labelled else "unstable cell (hollow)")


def step_times(cells: pd.DataFrame) -> Figure:
    """Step time per cell with its 95% CI across batch, one line per (model, mode, TP,
    ctx), one panel per SKU."""
    if cells.empty:
        return empty("no cells")
    groups = list(cells.groupby("sku"))
    fig, axes = panels(len(groups), 6.0, 4.2, columns=2)
    for ax, (sku, rows) in zip(axes, groups):
        keys = ["model", "mode", "tp", "ctx", *_workload_key(rows)]
        palette = colors(tuple(k) for k in rows[keys].drop_duplicates().itertuples(index=False))
        lines = rows.sort_values("batch").groupby(keys)
        for key, line in lines:
            label = f"{key[0]} {key[1]} TP-{key[2]} ctx {key[3]}{_prompts(key, keys)}"
            ax.errorbar(line["batch"], line["step_ms"], yerr=_ci_yerr(line), marker="o", ms=4, capsize=3,
                        color=palette[tuple(key)], label=label)
            _hollow_unstable(ax, line["batch"], line["step_ms"], line, palette[tuple(key)])
        ax.set_xscale("log", base=2)
        batches = sorted(rows["batch"].unique())
        if len(batches) <= MAX_LABELS:  # every batch named; more would overlap (log2 ticks then)
            ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("batch N")
        ax.set_ylabel("ms per decode step (95% CI)")
        ax.set_ylim(bottom=0)  # a time: from zero, so a 10 % gap looks like one
        title = f"{sku}: step time per cell"
        if lines.ngroups <= MAX_LABELS:
            ax.legend(fontsize=7)
        else:  # a legend of every line would be taller than the figure (and take seconds to place)
            title += f"\n{lines.ngroups} lines, one per model/mode/TP/ctx (cells.csv names them); hollow: unstable"
        ax.set_title(title, fontsize=10)
    return fig


# host_fraction_by_batch: the ctx series' spread in x, in doublings of the batch.
CTX_SPREAD = 0.08
# The most legend entries or tick labels a panel names; a big grid's panel names none.
MAX_LABELS = 16
# The host phases drawn apart in host_phases.png, the largest first; the rest are one band.
MAX_PHASES = 5
PHASE_COLORS = ("#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2")
# How the sweep's figures are written, to its run directory and to MLflow alike.
SAVE_KWARGS = {"dpi": 110, "bbox_inches": "tight"}
# The sweep's split, in the comparison figures' host red; device time a muted blue.
SPLIT_COLORS = {"device": "#4c72b0", "host": "#d62728"}
ENGINE_KEYS = list(ENGINE_AXES)  # one panel per engine (config/grid.py)


def _engines(cells: pd.DataFrame) -> list[tuple[tuple, pd.DataFrame]]:
    """The cells grouped per engine (sku, model, mode, tp), in a stable order."""
    return list(cells.groupby(ENGINE_KEYS, sort=True))


def _engine_title(key: tuple) -> str:
    return " ".join(f"TP-{value}" if axis == "tp" else str(value) for axis, value in zip(ENGINE_KEYS, key))


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
        hatch = ["//" if bad else "" for bad in unstable_mask(rows)]
        ax.bar(x, device, 0.7, color=SPLIT_COLORS["device"], label="device (kernels / compute ops)", hatch=hatch,
               edgecolor="white")
        ax.bar(x, host, 0.7, bottom=device, color=SPLIT_COLORS["host"], label="host (step − device)", hatch=hatch,
               edgecolor="white")
        ax.errorbar(x, rows["step_ms"], yerr=_ci_yerr(rows), fmt="none", ecolor="k", capsize=3,
                    label="step, 95% CI")
        device_err = _device_yerr(rows)
        if device_err is not None:
            ax.errorbar(x - 0.12, device, yerr=device_err, fmt="none", ecolor="#1b2f5c", capsize=2, lw=1,
                        label="device, 95% CI")
        for i, frac in enumerate(rows["host_frac"].to_numpy(float) if "host_frac" in rows else np.full(len(x), np.nan)):
            if np.isfinite(frac):  # no fraction where the split was impossible (stability)
                ax.text(i, device[i] + host[i] / 2, f"{frac:.2f}", ha="center", va="center", fontsize=7, color="white")
        marks = ["\nunstable" if bad else "" for bad in unstable_mask(rows)]
        ax.set_xticks(x, [f"b{b}\nctx{c}{m}" for b, c, m in zip(rows["batch"], rows["ctx"], marks)], fontsize=8)
        ax.set_ylabel("ms per decode step")
        ax.set_title(_engine_title(key), fontsize=10)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncol=3, fontsize=8)
    fig.suptitle("Decode step = device + host, per cell (bar labels: host_frac; hatched: unstable)", fontsize=11)
    return fig


def _device_yerr(rows: pd.DataFrame) -> Optional[np.ndarray]:
    """device_ms's CI over the profiled pairs as errorbar lengths (0 where a cell has none:
    fewer than 3 profiled pairs), None without the columns or with no CI at all."""
    if not {"device_ci_low_ms", "device_ci_high_ms"} <= set(rows) or rows["device_ci_low_ms"].isna().all():
        return None
    device = rows["device_ms"].to_numpy(float)
    low = np.nan_to_num(device - rows["device_ci_low_ms"].to_numpy(float), nan=0.0).clip(min=0)
    high = np.nan_to_num(rows["device_ci_high_ms"].to_numpy(float) - device, nan=0.0).clip(min=0)
    return np.vstack([low, high])


def host_fraction_by_batch(cells: pd.DataFrame, threshold: float = 0.5) -> Figure:
    """Host fraction against batch with its 95% CI, a line per ctx, one panel per engine: a cell
    whose CI lies at or above `threshold` (dashed) is host-bound, below it device-bound, across
    it undetermined ('?'). Implausible and impossible splits have no host_frac: not drawn."""
    split = cells.dropna(subset=["host_frac"]) if "host_frac" in cells else cells.iloc[0:0]
    if split.empty:
        return empty("no split cells (split.enabled=false): no host fraction to plot")
    groups = _engines(split)
    fig, axes = panels(len(groups), 5.6, 3.8, columns=2)
    for ax, (key, rows) in zip(axes, groups):
        series_keys = ["ctx", *_workload_key(rows)]
        series = list(rows.sort_values("batch").groupby(series_keys))
        palette = colors(name for name, _ in series)
        for i, (name, line) in enumerate(series):
            # each series a little apart in x (log scale: a factor), or their CIs and '?' marks overlap
            x = line["batch"] * 2.0 ** (CTX_SPREAD * (i - (len(series) - 1) / 2))
            label = f"ctx {name[0]}{_prompts(name, series_keys)}"
            ax.errorbar(x, line["host_frac"], yerr=_frac_yerr(line), marker="o", color=palette[name],
                        capsize=3, label=label)
            _hollow_unstable(ax, x, line["host_frac"], line, palette[name])
            undetermined = (line["regime"] == "undetermined").to_numpy(bool) if "regime" in line else []
            if np.any(undetermined):
                for b, f in zip(x[undetermined], line["host_frac"][undetermined]):
                    ax.annotate("?", (b, f), textcoords="offset points", xytext=(4, 4), fontsize=8, color=palette[name])
        ax.axhline(threshold, color="k", ls="--", lw=1, label=f"host-bound at {threshold:g}")
        batches = sorted(rows["batch"].unique())
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_ylim(0, 1)
        ax.set_xlabel("batch N")
        ax.set_ylabel("host_frac (host / step)")
        ax.set_title(_engine_title(key), fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle("Host fraction against batch with 95% CI, per context length (?: undetermined;\n"
                 "contexts and workloads drawn slightly apart in batch)", fontsize=11)
    return fig


def _workload_key(rows: pd.DataFrame) -> list[str]:
    """["workload"] where the rows hold more than one workload (a line each: random prompts and
    the model's own text are different series), else nothing."""
    return ["workload"] if "workload" in rows and rows["workload"].nunique() > 1 else []


def _prompts(key: tuple, keys: list[str]) -> str:
    """', random prompts' for a series keyed by its workload (_workload_key), else ''."""
    return f", {key[-1]} prompts" if keys[-1] == "workload" else ""


def _frac_yerr(rows: pd.DataFrame) -> Optional[np.ndarray]:
    """host_frac's CI as errorbar lengths (0 where a cell has none), None without CI columns."""
    if not {"host_frac_ci_low", "host_frac_ci_high"} <= set(rows):
        return None
    frac = rows["host_frac"].to_numpy(float)
    low = np.nan_to_num(frac - rows["host_frac_ci_low"].to_numpy(float), nan=0.0).clip(min=0)
    high = np.nan_to_num(rows["host_frac_ci_high"].to_numpy(float) - frac, nan=0.0).clip(min=0)
    return np.vstack([low, high])


def host_phases(cells: pd.DataFrame) -> Figure:
    """Each cell's decode step stacked: device ms, then each named host phase (measure/phases.py),
    then what the phases leave of host_ms ("other"); one panel per engine, so modes sit side
    by side (which phase CUDA graphs remove, which speculation amortizes)."""
    # A sweep whose every split was implausible has device_ms and phases but no host_ms column.
    columns = phase_columns(cells) if {"device_ms", "host_ms"} <= set(cells) else []
    split = cells.dropna(subset=["device_ms", "host_ms"]) if columns else cells.iloc[0:0]
    if split.empty:
        return empty("no host phases (split off, or hostsweep's vLLM plugin not installed)")
    groups = _engines(split)
    fig, axes = panels(len(groups), max(6.0, 0.6 * split.groupby(ENGINE_KEYS).size().max() + 2.5), 4.2, columns=2)
    # The largest few phases by their total over the cells, each its colour; the rest as one
    # band: fourteen colours in a legend took 40 % of the figure's width and none could be told apart.
    totals = split[columns].clip(lower=0).sum().sort_values(ascending=False)
    shown = [c for c in totals.index[:MAX_PHASES] if totals[c] > 0]
    rest = [c for c in columns if c not in shown]
    palette = {column: PHASE_COLORS[i % len(PHASE_COLORS)] for i, column in enumerate(shown)}
    for ax, (key, rows) in zip(axes, groups):
        rows = rows.sort_values(["ctx", "batch"])
        x = np.arange(len(rows))
        bottom = rows["device_ms"].to_numpy(float)
        ax.bar(x, bottom, 0.7, color=SPLIT_COLORS["device"], label="device")
        named = np.zeros(len(rows))
        bands = [(column[len("phase_"):-len("_ms")], [column], palette[column]) for column in shown]
        if rest:
            bands.append((f"{len(rest)} smaller phases", rest, "#999999"))
        for label, band, color in bands:
            ms = np.nan_to_num(rows[band].to_numpy(float), nan=0.0).clip(min=0).sum(axis=1)
            ax.bar(x, ms, 0.7, bottom=bottom, color=color, label=label)
            bottom, named = bottom + ms, named + ms
        other = (rows["host_ms"].to_numpy(float) - named).clip(min=0)
        if np.nanmax(other, initial=0.0) > 0.005 * np.nanmax(bottom, initial=0.0):  # no legend entry for no bar
            ax.bar(x, other, 0.7, bottom=bottom, color="#dddddd", hatch="..", edgecolor="white", label="other (unnamed)")
        if "step_ms" in rows:
            ax.errorbar(x, rows["step_ms"], yerr=_ci_yerr(rows), fmt="none", ecolor="k", capsize=3, label="step, 95% CI")
        ax.set_xticks(x, [f"b{b}\nctx{c}" for b, c in zip(rows["batch"], rows["ctx"])], fontsize=8)
        ax.set_ylabel("ms per decode step")
        ax.set_title(_engine_title(key), fontsize=10)
        ax.set_ylim(bottom=0)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=4, fontsize=7)
    fig.suptitle("Decode step = device + host phases\n(profiled pairs, scaled to the timed host time; "
                 "other: host_ms no phase names)", fontsize=10)
    return fig

