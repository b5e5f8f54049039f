"""The fit's numbers as the comparison report's tables (pure): per held-out (SKU, TP)
group the model and baseline errors, how many predictions land in the measured CI and
the verdict; the cells below the lower bound H + T_ar; the TP shrink; the residual after
compute and all-reduce per TP degree; each host form's held-out MAPE with a bootstrap
CI; the regime table (host fraction per model size, TP and batch).

Inputs are the fit report as JSON (`FitReport.to_dict()`, fit.json) and its per-cell
table `pd.DataFrame(fit["cells"])` (measured step and CI, every form's prediction, the
model's pieces compute_ms / allreduce_ms / microbench_ms, bound, margin, run_id).

Group verdict on the additive model with a TP-invariant host term: falsified when the
fit's binomial rule falsifies the group (its cells below H + T_ar), or when its
k-invariant-vs-k-scaling verdict is k-scaling; validated when its verdict is k-invariant
(CI clears the margin) and the winning form beats the baseline; otherwise inconclusive,
with the fit's reason.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from hostsweep.config.options import load_model_shape
from hostsweep.config.schema import ConfigError
from hostsweep.config.shapes import parameter_count

RATIO_TOLERANCE = 0.0  # the residual is "constant" across TP when its ratio's 95% CI contains 1 ± this


def predictions(fit: dict[str, Any]) -> pd.DataFrame:
    return pd.DataFrame(fit["cells"])


def _in_ci(pred: pd.DataFrame, column: str) -> int:
    if "step_ci_low_ms" not in pred:
        return 0
    values = pred[column]
    return int(((values >= pred["step_ci_low_ms"]) & (values <= pred["step_ci_high_ms"])).sum())


def _score(fit: dict[str, Any], form: str, sku: str, tp: int) -> dict[str, Any]:
    for score in fit["scores"]:
        if (score["form"], score["sku"], score["tp"], score["role"]) == (form, sku, tp, "held-out"):
            return score
    return {}


def additive_model_verdict(group: dict[str, Any]) -> tuple[str, str]:
    """validated / falsified / allreduce_mismatch / inconclusive for one held-out group, with
    the reason (a mismatched all-reduce is reported as such, never as a falsification:
    model/term_checks.guard_group)."""
    if group.get("verdict") == "allreduce_mismatch":
        return "allreduce_mismatch", group["reason"]
    if group.get("falsified"):
        return "falsified", group.get("reason", "cells below H + T_ar")
    if "verdict" not in group:
        return "inconclusive", "no in-regime cells"
    if group["verdict"] == "k-invariant" and group.get("beats_baseline"):
        return "validated", f"k-invariant ({group['reason']}); {group['winner']} beats the baseline"
    # an inconclusive question carries whether the cells' noise could have resolved it
    noise = f"; {group['noise']['sentence']}" if group.get("noise") else ""
    if group["verdict"] == "k-invariant":
        return "inconclusive", f"k-invariant, but {group['winner']} does not beat the baseline by the margin{noise}"
    if group["verdict"] == "k-scaling":
        return "falsified", f"the TP-invariant host term is rejected: k-scaling forms predict better ({group['reason']})"
    return "inconclusive", group["reason"] + noise


def heldout_groups(fit: dict[str, Any], pred: pd.DataFrame) -> pd.DataFrame:
    """One row per held-out (SKU, TP) group: errors of the model (the chosen form) and the
    baseline on its in-regime cells, predictions inside the measured 95% CI, verdict."""
    form, rows = fit["options"]["form"], []
    for group in (g for g in fit["groups"] if g["role"] == "held-out"):
        sku, tp = group["sku"], group["tp"]
        cells = pred[(pred["sku"] == sku) & (pred["tp"] == tp) & (pred["role"] == "held-out") & pred["in_regime"]]
        model, base = _score(fit, form, sku, tp), _score(fit, "baseline", sku, tp)
        verdict, reason = additive_model_verdict(group)
        drive = group.get("driving_term", {}).get("sentence")  # every verdict line names what drives the margin
        reason = reason if not drive or drive in reason else f"{reason}; {drive}"
        rows.append({"sku": sku, "tp": tp, "cells": group["n"], "out_of_regime": group["out_of_regime"],
                     "model_mape_mean": model.get("mape_mean"), "model_mape_p95": model.get("mape_p95"),
                     "model_mape_max": model.get("mape_max"), "model_in_ci": f"{_in_ci(cells, 'predicted_ms')}/{len(cells)}",
                     "baseline_mape_mean": base.get("mape_mean"), "baseline_mape_p95": base.get("mape_p95"),
                     "baseline_mape_max": base.get("mape_max"),
                     "baseline_in_ci": f"{_in_ci(cells, 'baseline_ms')}/{len(cells)}",
                     "below_bound_ci": group["falsifying_cells"], "needed": group["falsifying_needed"],
                     "verdict": verdict, "reason": reason})
    return pd.DataFrame(rows)


def below_bound_cells(pred: pd.DataFrame) -> pd.DataFrame:
    """Held-out in-regime cells measuring below the bound H + T_ar: their margin (step −
    bound, ms) and whether their 95% CI excludes the bound (which is what falsifies)."""
    below = pred[(pred["role"] == "held-out") & pred["in_regime"] & (pred["margin_ms"] < 0)]
    columns = [c for c in ("sku", "tp", "model", "batch", "ctx", "step_ms", "step_ci_low_ms", "step_ci_high_ms",
                           "bound_ms", "margin_ms", "falsifies", "judged_on", "run_id") if c in below]
    out = below[columns].rename(columns={"falsifies": "ci_excludes_bound"})
    return out.sort_values(["sku", "tp", "margin_ms"]).reset_index(drop=True)


def shrink(fit: dict[str, Any]) -> pd.DataFrame:
    """Measured TP-k → next-k step shrink beside the ideal k'/k, the model's and the
    range the baseline predicts (the tensor-parallel study [2], README.md#references:
    1.11× measured, 2× ideal, 1.36–1.53×)."""
    return pd.DataFrame([{
        "sku": r["sku"], "model": r["model"], "tp": f"{r['from_tp']}→{r['to_tp']}", "pairs": r["pairs"],
        "measured_in_regime": r["measured_in_regime"], "measured_all": r["measured_all"],
        "ideal": r["to_tp"] / r["from_tp"], "model_in_regime": r["model_in_regime"],
        "baseline_min": r["baseline_in_regime_min"], "baseline_max": r["baseline_in_regime_max"],
    } for r in fit["shrink"]])


def _ratio_ci(low: np.ndarray, high: np.ndarray, resamples: int, seed: int) -> tuple[float, float, float]:
    """mean(high)/mean(low) over matched cells, with a paired bootstrap 95% CI."""
    rng = np.random.default_rng(seed)
    index = rng.integers(0, len(low), size=(resamples, len(low)))
    draws = high[index].mean(axis=1) / low[index].mean(axis=1)
    return float(high.mean() / low.mean()), *map(float, np.percentile(draws, [2.5, 97.5]))


def residuals(pred: pd.DataFrame, resamples: int = 2000, seed: int = 0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The residual step − g·T_cmp/k − T_ar of in-regime cells (what the additive term must
    explain) per (SKU, model, TP), and its ratio between consecutive TP degrees over
    matched (batch, ctx) cells: a TP-invariant term gives 1, C·k gives k'/k, C/k k/k'."""
    cells = pred[pred["in_regime"]].assign(residual_ms=lambda f: f["step_ms"] - f["compute_ms"] - f["allreduce_ms"])
    per_tp = (cells.groupby(["sku", "model", "tp"])
              .agg(cells=("residual_ms", "size"), residual_mean_ms=("residual_ms", "mean"),
                   residual_sd_ms=("residual_ms", "std"), residual_min_ms=("residual_ms", "min"),
                   residual_max_ms=("residual_ms", "max"), model_H_mean_ms=("microbench_ms", "mean"))
              .reset_index())
    rows = []
    for (sku, model), group in cells.groupby(["sku", "model"]):
        degrees = sorted(group["tp"].unique())
        for low, high in zip(degrees, degrees[1:]):
            a = group[group["tp"] == low].set_index(["batch", "ctx"])["residual_ms"]
            b = group[group["tp"] == high].set_index(["batch", "ctx"])["residual_ms"]
            both = a.groupby(level=[0, 1]).mean().to_frame("low").join(b.groupby(level=[0, 1]).mean().rename("high"),
                                                                       how="inner")
            if both.empty or (both["low"].mean() <= 0):
                continue
            ratio, lo, hi = _ratio_ci(both["low"].to_numpy(), both["high"].to_numpy(), resamples, seed)
            constant = lo <= 1 + RATIO_TOLERANCE and hi >= 1 - RATIO_TOLERANCE
            shape = "constant" if constant else ("grows with k" if lo > 1 else "shrinks with k")
            rows.append({"sku": sku, "model": model, "tp": f"{low}→{high}", "pairs": len(both),
                         "ratio": ratio, "ci_low": lo, "ci_high": hi, "k_ratio": high / low, "residual": shape})
    return per_tp, pd.DataFrame(rows)


def form_mape(pred: pd.DataFrame, forms: list[str], resamples: int = 2000, seed: int = 0) -> pd.DataFrame:
    """Every form's held-out MAPE per (SKU, TP) group with a bootstrap 95% CI over cells."""
    held = pred[(pred["role"] == "held-out") & pred["in_regime"]]
    rng = np.random.default_rng(seed)
    rows = []
    for (sku, tp), group in held.groupby(["sku", "tp"]):
        index = rng.integers(0, len(group), size=(resamples, len(group)))
        step = group["step_ms"].to_numpy(float)
        for form in forms:
            ape = np.abs(group[f"{form}_ms"].to_numpy(float) - step) / step * 100
            low, high = np.percentile(ape[index].mean(axis=1), [2.5, 97.5])
            rows.append({"sku": sku, "tp": int(tp), "form": form, "mape": float(ape.mean()),
                         "ci_low": float(low), "ci_high": float(high), "n": len(group)})
    return pd.DataFrame(rows)


def parameters_m(models: pd.Series) -> pd.Series:
    """Each model's parameter count in millions, from its shipped shape (NaN for a model
    with no shipped shape: a checkpoint)."""
    counts = {}
    for name in models.unique():
        try:
            counts[name] = round(parameter_count(load_model_shape(name)) / 1e6, 1)
        except (ConfigError, OSError):
            counts[name] = float("nan")
    return models.map(counts)


def regime_table(cells: pd.DataFrame, threshold: float = 0.5) -> pd.DataFrame:
    """Host fraction per (SKU, mode, model, TP, batch), the mean over contexts, with the
    model's size, the envelope of the contexts' host_frac CIs (host_frac_ci_low/high, absent
    cells' CIs: NaN) and the regime: the contexts' own (measure/split_stats.regime_of) when
    they agree, `mixed` when determined ones differ, `undetermined` when any is. Rows logged
    without a regime get one from their point (host_frac >= threshold)."""
    split = cells[cells["host_frac"].notna()] if "host_frac" in cells else cells.iloc[0:0]
    if split.empty:
        return pd.DataFrame(columns=["sku", "mode", "model", "params_M", "tp", "batch", "host_frac", "regime"])
    point = np.where(split["host_frac"] >= threshold, "host-bound", "device-bound")
    regimes = split["regime"].where(split["regime"].notna(), point) if "regime" in split else pd.Series(point, split.index)
    split = split.assign(regime=regimes, **{c: split[c] if c in split else np.nan
                                           for c in ("host_frac_ci_low", "host_frac_ci_high")})
    table = (split.groupby(["sku", "mode", "model", "tp", "batch"])
             .agg(host_frac=("host_frac", "mean"), host_frac_ci_low=("host_frac_ci_low", "min"),
                  host_frac_ci_high=("host_frac_ci_high", "max"), host_ms=("host_ms", "mean"),
                  device_ms=("device_ms", "mean"), step_ms=("step_ms", "mean"), contexts=("ctx", "nunique"),
                  regime=("regime", _group_regime))
             .reset_index())
    table.insert(3, "params_M", parameters_m(table["model"]))
    return table.sort_values(["sku", "mode", "params_M", "tp", "batch"]).reset_index(drop=True)


def _group_regime(regimes: pd.Series) -> str:
    found = set(regimes)
    if "undetermined" in found:
        return "undetermined"
    return found.pop() if len(found) == 1 else "mixed"


def allreduce_paths_table(calibration: dict[str, Any]) -> pd.DataFrame:
    """Per SKU, the T_ar the fit used (its path and what ran) beside the standalone
    all-reduce (the TP study's method) where one was recorded: fit.json's calibration."""
    requested = calibration.get("allreduce_requested") or ""
    beside = calibration.get("allreduce_standalone", {})
    rows = []
    for sku, used in calibration.get("allreduce", {}).items():
        other = beside.get(sku) if used.get("path") != "standalone" else None
        rows.append({"sku": sku, "fit.allreduce": requested, "path_used": used.get("path", "standalone"),
                     "lambda_us": used["latency_us"], "beta_gbps": used["bandwidth_gbps"],
                     "method": used.get("method", ""),
                     "standalone_lambda_us": other["latency_us"] if other else np.nan,
                     "standalone_beta_gbps": other["bandwidth_gbps"] if other else np.nan})
    return pd.DataFrame(rows)


def allreduce_paths_text(table: pd.DataFrame) -> str:
    """One sentence per SKU whose T_ar is not on the path fit.allreduce asked for."""
    off = table[(table["fit.allreduce"] != "") & (table["fit.allreduce"] != table["path_used"])]
    return " ".join(f"**sku {r['sku']}: fit.allreduce={r['fit.allreduce']} but T_ar is the {r['path_used']} "
                    "all-reduce (the engine's path could not be measured): NOT ON THE ENGINE'S PATH.**"
                    for _, r in off.iterrows())
