"""Cross-SKU comparison: cell frames, the a-priori regime rule, held-out scoring and
falsification of the additive model (pure).

A held-out cell that measures below the model's lower bound H + T_ar (the step with
zero compute) falsifies the additive composition on its SKU. Out-of-regime cells
(memory pressure) are decided from memory alone, before any fit, never from error.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import pandas as pd

from hostsweep.model.fit import AllReduceTerms, HostFit, SHAPE_COLUMNS, allreduce_s, ape
from hostsweep.model.hostforms import FittedForm, host_and_allreduce_s, predict_s
from hostsweep.config.shapes import parameter_count

GIB = 1024 ** 3
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1}


def cell_frame(measured: pd.DataFrame, shapes: Mapping[str, Mapping[str, Any]],
               skus: Mapping[str, Mapping[str, Any]], roofs: str = "datasheet") -> pd.DataFrame:
    """Measured cells (sku, model, tp, batch, ctx, step_ms[, T, dtype]) joined with the
    model's shape and the SKU's roofs, ready for fit.sharded_compute_s.

    roofs="datasheet" uses peak_bf16_tflops / mem_bandwidth_gbps; "measured" uses
    measured_tflops / measured_bandwidth_gbps (from the roofs microbenchmark).
    """
    frame = measured.copy()
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
    if "T" not in frame:
        frame["T"] = 33
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


def predictions_table(fitted: FittedForm, cells: pd.DataFrame, allreduce: AllReduceTerms, host: HostFit,
                      selected: np.ndarray) -> pd.DataFrame:
    """Per cell: measured, predicted, error, bound, role, regime, falsified.

    `selected` marks the training selection; its in-regime cells are "train", its
    out-of-regime cells "excluded" (never fitted on), everything else "held-out".
    """
    predicted_ms = predict_s(fitted, cells, allreduce, host) * 1e3
    bound_ms = host_and_allreduce_s(fitted, cells, allreduce, host) * 1e3
    regime = cells["in_regime"].to_numpy(bool) if "in_regime" in cells else np.ones(len(cells), bool)
    train_mask = np.asarray(selected, bool) & regime
    table = cells[["sku", "model", "tp", "batch", "ctx", "step_ms"]].copy()
    table["predicted_ms"] = predicted_ms
    table["ape_pct"] = ape(predicted_ms, cells["step_ms"])
    table["lower_bound_ms"] = bound_ms
    table["allreduce_ms"] = allreduce_s(cells, allreduce) * 1e3
    table["role"] = np.where(train_mask, "train", np.where(selected, "excluded", "held-out"))
    table["in_regime"] = regime
    table["falsifies"] = ~np.asarray(selected, bool) & regime & (cells["step_ms"].to_numpy(float) < bound_ms)
    return table


def generalization(table: pd.DataFrame) -> pd.DataFrame:
    """MAPE per (sku, tp, role), with and without out-of-regime cells, and falsifications."""
    rows = []
    for (sku, tp, role), group in table.groupby(["sku", "tp", "role"], sort=True):
        inside = group[group["in_regime"]]
        rows.append({
            "sku": sku, "tp": tp, "role": role, "cells": len(group), "out_of_regime": int((~group["in_regime"]).sum()),
            "mape_mean_all": group["ape_pct"].mean(), "mape_mean_in_regime": inside["ape_pct"].mean(),
            "mape_p95_in_regime": float(np.percentile(inside["ape_pct"], 95)) if len(inside) else float("nan"),
            "mape_max_in_regime": inside["ape_pct"].max(), "falsifying_cells": int(group["falsifies"].sum()),
        })
    return pd.DataFrame(rows)


def falsified_skus(table: pd.DataFrame) -> list[str]:
    """SKUs where some in-regime held-out cell measured below H + T_ar."""
    return sorted(table.loc[table["falsifies"], "sku"].unique())
