"""The measured cells as the TP model's inputs, and the a-priori memory regime (pure).

`model_inputs` joins each cell with its model's shape and its SKU's roofs and memory, the
columns fit.sharded_compute_s and the regime rule read. Out-of-regime cells (memory
pressure) are decided from memory alone, before any fit, never from error.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import pandas as pd

from hostsweep.config.shapes import parameter_count
from hostsweep.model.fit import SHAPE_COLUMNS

GIB = 1024 ** 3
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1}


def model_inputs(measured: pd.DataFrame, shapes: Mapping[str, Mapping[str, Any]],
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
    if "dtype" in frame:  # a SKU measured in several dtypes: each cell on its own dtype's roof
        for row, (sku, dtype) in enumerate(zip(frame["sku"], frame["dtype"])):
            roof = skus[sku].get("roofs_by_dtype", {}).get(dtype)
            if roof is not None:
                frame.iloc[row, frame.columns.get_loc("peak_flops")] = float(roof["peak_bf16_tflops"]) * 1e12
                frame.iloc[row, frame.columns.get_loc("mem_bw")] = float(roof["mem_bandwidth_gbps"]) * 1e9
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
