"""The evidence against the additive TP model (pure): cells below its lower bound, and the
measured TP-k → next-k step shrink.

A held-out cell that measures below the model's lower bound H + T_ar (the step with
zero compute) falsifies the additive composition on its (SKU, TP). The bound uses the
microbenchmark's H, never a host constant some form fitted, so what is falsified does
not depend on the form chosen.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import pandas as pd

CI_COLUMNS = ("step_ci_low_ms", "step_ci_high_ms")


def measured_ci_high_ms(cells: pd.DataFrame) -> np.ndarray:
    """The upper end of each cell's measured 95% CI; NaN where the cells carry none."""
    if CI_COLUMNS[1] not in cells:
        return np.full(len(cells), np.nan)
    return pd.to_numeric(cells[CI_COLUMNS[1]], errors="coerce").to_numpy(float)


# The two-sided 95% normal quantile: the cells' CI columns are 95% intervals (resolution.py
# reads the same).
Z95 = 1.959963984540054


def falsifying(cells: pd.DataFrame, bound_ms: np.ndarray, candidates: np.ndarray,
               shift_sd: float = 0.0) -> pd.DataFrame:
    """Per cell: the bound H + T_ar, the margin (measured − bound), what was judged and
    whether it falsifies. A cell falsifies only if its whole 95% CI lies below the bound;
    a cell without a CI is judged on its point value (`judged_on` says which). `shift_sd`
    (log SD of a held-out engine start's speed against the training starts', verdict.
    StartShift.relative_sd) widens the upper end in quadrature: a slower machine in the
    training starts than in the held-out one lowers every held-out cell together."""
    step = cells["step_ms"].to_numpy(float)
    high = measured_ci_high_ms(cells)
    has_ci = np.isfinite(high)
    judged = np.where(has_ci, high, step)
    if shift_sd > 0:
        with np.errstate(invalid="ignore", divide="ignore"):
            own = np.where(has_ci, np.log(np.maximum(judged, step) / step), 0.0)
        judged = step * np.exp(np.hypot(own, Z95 * shift_sd))
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
