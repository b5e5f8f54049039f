"""Cross-SKU comparison: cell frames, the a-priori regime rule, falsification of the
additive model and the TP-k → 2k shrink (pure).

A held-out cell that measures below the model's lower bound H + T_ar (the step with
zero compute) falsifies the additive composition on its (SKU, TP). The bound uses the
microbenchmark's H, never a host constant some form fitted, so what is falsified does
not depend on the form chosen. Out-of-regime cells (memory pressure) are decided from
memory alone, before any fit, never from error.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import pandas as pd

from hostsweep.config.shapes import parameter_count
from hostsweep.model.fit import SHAPE_COLUMNS

GIB = 1024 ** 3
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1}
CI_COLUMNS = ("step_ci_low_ms", "step_ci_high_ms")


def cell_frame(measured: pd.DataFrame, shapes: Mapping[str, Mapping[str, Any]],
               skus: Mapping[str, Mapping[str, Any]], roofs: str = "datasheet",
               tokens: int | None = None) -> pd.DataFrame:
    """Measured cells (sku, model, tp, batch, ctx, step_ms[, T, dtype, CI]) joined with the
    model's shape and the SKU's roofs, ready for fit.sharded_compute_s.

    roofs="datasheet" uses peak_bf16_tflops / mem_bandwidth_gbps; "measured" uses
    measured_tflops / measured_bandwidth_gbps (from the roofs microbenchmark). T (tokens
    per timed generate, which the memory criterion needs) comes from the cells' T column,
    or from `tokens` for cells that do not carry one.
    """
    frame = measured.copy()
    if "T" not in frame or frame["T"].isna().any():
        if tokens is None:
            raise ValueError("cells have no T column (tokens per timed generate, needed by the memory "
                             "criterion): add it to the cells or give the T they were measured with (--tokens)")
        frame["T"] = frame["T"].fillna(tokens) if "T" in frame else tokens
    for column in SHAPE_COLUMNS:
        frame[column] = [shapes[m][column] for m in frame["model"]]
    frame["parameters"] = [parameter_count(dict(shapes[m])) for m in frame["model"]]
    flops_key, bw_key = ("peak_bf16_tflops", "mem_bandwidth_gbps") if roofs == "datasheet" \
        else ("measured_tflops", "measured_bandwidth_gbps")
    frame["peak_flops"] = [float(skus[s][flops_key]) * 1e12 for s in frame["sku"]]
    frame["mem_bw"] = [float(skus[s][bw_key]) * 1e9 for s in frame["sku"]]
    frame["device_memory_bytes"] = [float(skus[s]["device_memory_gib"]) * GIB for s in frame["sku"]]
    if "dtype_bytes" not in frame:
        dtypes = frame["dtype"] if "dtype" in frame else pd.Series("bfloat16", index=frame.index)
        frame["dtype_bytes"] = [DTYPE_BYTES[d] for d in dtypes]
    return frame


def memory_per_rank_bytes(cells: pd.DataFrame) -> np.ndarray:
    """Weights/k + KV cache for N·(ctx+T) tokens + the prefill working set of one layer.

    The working set (residual, normed input, q/k/v and the MLP intermediate for N·ctx
    tokens) is a declared a-priori estimate, not tuned to any error.
    """
    k = cells["tp"].to_numpy(float)
    b = cells["dtype_bytes"].to_numpy(float)
    n, ctx, T = (cells[c].to_numpy(float) for c in ("batch", "ctx", "T"))
    kv_width = np.ceil(cells["num_key_value_heads"].to_numpy(float) / k) * cells["head_dim"].to_numpy(float)
    weights = cells["parameters"].to_numpy(float) * b / k
    kv = n * (ctx + T) * 2 * cells["num_hidden_layers"].to_numpy(float) * kv_width * b
    hidden, inter = cells["hidden_size"].to_numpy(float), cells["intermediate_size"].to_numpy(float)
    activations = n * ctx * (4 * hidden + 2 * inter / k) * b
    return weights + kv + activations


def in_regime(cells: pd.DataFrame, utilization: float = 0.9) -> np.ndarray:
    """True where the cell fits in device memory × utilization (decided before fitting)."""
    return memory_per_rank_bytes(cells) <= cells["device_memory_bytes"].to_numpy(float) * utilization


def measured_ci_high_ms(cells: pd.DataFrame) -> np.ndarray:
    """The upper end of each cell's measured 95% CI; NaN where the cells carry none."""
    if CI_COLUMNS[1] not in cells:
        return np.full(len(cells), np.nan)
    return pd.to_numeric(cells[CI_COLUMNS[1]], errors="coerce").to_numpy(float)


def falsifying(cells: pd.DataFrame, bound_ms: np.ndarray, candidates: np.ndarray) -> pd.DataFrame:
    """Per cell: the bound H + T_ar, the margin (measured − bound), what was judged and
    whether it falsifies. A cell falsifies only if its whole 95% CI lies below the bound;
    a cell without a CI is judged on its point value (`judged_on` says which)."""
    step = cells["step_ms"].to_numpy(float)
    high = measured_ci_high_ms(cells)
    has_ci = np.isfinite(high)
    judged = np.where(has_ci, high, step)
    out = pd.DataFrame({"bound_ms": bound_ms, "margin_ms": step - bound_ms,
                        "judged_on": np.where(has_ci, "ci_high", "point")}, index=cells.index)
    out["falsifies"] = np.asarray(candidates, bool) & (judged < bound_ms)
    return out


def tp_shrink(cells: pd.DataFrame, values: Mapping[str, np.ndarray]) -> list[dict[str, Any]]:
    """The step shrink from each TP degree to the next one measured, per (SKU, model):
    mean over matched (batch, ctx) cells of value(k)/value(next k), over in-regime pairs
    and over all pairs (the TP study's [2] "1.11× in-regime, 1.18× with the outlier"). `values`
    maps a name (measured, baseline, model) to per-cell step times; each gets its shrink.
    Repeated cells are averaged first."""
    cell = cells.groupby(["sku", "model", "batch", "ctx"], sort=True).ngroup().to_numpy()
    owner = cells.groupby(["sku", "model"], sort=True)
    tp, outside = cells["tp"].to_numpy(int), ~cells["in_regime"].to_numpy(bool)
    rows = []
    for (sku, model), index in sorted(owner.indices.items()):
        degrees = np.unique(tp[index])
        for low, high in zip(degrees, degrees[1:]):
            lo, hi = index[tp[index] == low], index[tp[index] == high]
            count_lo, count_hi = (np.bincount(cell[i], minlength=cell.max() + 1) for i in (lo, hi))
            paired = np.flatnonzero((count_lo > 0) & (count_hi > 0))
            if paired.size == 0:
                continue
            bad = np.bincount(cell[lo], outside[lo], cell.max() + 1) + np.bincount(cell[hi], outside[hi], cell.max() + 1)
            inside = bad[paired] == 0
            row = {"sku": sku, "model": model, "from_tp": int(low), "to_tp": int(high),
                   "pairs": int(paired.size), "pairs_in_regime": int(inside.sum())}
            for name, v in values.items():
                v = np.asarray(v, float)
                mean_lo = np.bincount(cell[lo], v[lo], cell.max() + 1)[paired] / count_lo[paired]
                mean_hi = np.bincount(cell[hi], v[hi], cell.max() + 1)[paired] / count_hi[paired]
                row.update(_ratios(name, mean_lo / mean_hi, inside))
            rows.append(row)
    return rows


def _ratios(name: str, ratio: np.ndarray, inside: np.ndarray) -> dict[str, float]:
    some = bool(inside.any())
    nan = float("nan")
    return {f"{name}_in_regime": float(ratio[inside].mean()) if some else nan, f"{name}_all": float(ratio.mean()),
            f"{name}_in_regime_min": float(ratio[inside].min()) if some else nan,
            f"{name}_in_regime_max": float(ratio[inside].max()) if some else nan}
