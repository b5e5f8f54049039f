"""The closed-form TP decode model and its calibration terms (pure, vectorized).

    T_step = g · T_cmp(N, ctx) / k  +  T_ar(k)  +  H(N)          (the TP study [2])

- T_cmp/k: a roofline over the projection GEMMs (QKV, O, gate/up, down, lm_head) and the
  KV read, each max(FLOPs / peak, bytes / bandwidth), with widths and KV heads divided by
  k, summed over layers (`sharded_compute_s`).
- T_ar: 2L all-reduces per step of N·hidden·dtype bytes, each λ + bytes/β, for k > 1.
- H(N) = s0 + s1·(N − 1): the single-device framework-overhead microbenchmark.
- g: one global compute scale, fitted on training cells only.

Every function takes numpy arrays (or pandas columns) so 100,000 cells fit in seconds.
Cell frames carry the columns of CELL_COLUMNS (one row per cell).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Union

import numpy as np
import pandas as pd
from scipy.optimize import least_squares, lsq_linear

SHAPE_COLUMNS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "vocab_size")
CELL_COLUMNS = SHAPE_COLUMNS + ("batch", "ctx", "tp", "peak_flops", "mem_bw", "dtype_bytes")


@dataclass(frozen=True)
class AllReduceFit:
    latency_s: float  # λ
    bandwidth_Bps: float  # β, bytes per second

    def time_s(self, message_bytes: np.ndarray) -> np.ndarray:
        return self.latency_s + np.asarray(message_bytes, float) / self.bandwidth_Bps


@dataclass(frozen=True)
class HostFit:
    s0_s: float
    s1_s: float

    def time_s(self, batch: np.ndarray) -> np.ndarray:
        return self.s0_s + self.s1_s * (np.asarray(batch, float) - 1.0)


def _gemm_s(tokens, k_in, n_out, peak, bw, dtype_bytes):
    """max(FLOP roof, byte roof) of a [tokens × k_in] @ [k_in × n_out] GEMM."""
    flops = 2.0 * tokens * k_in * n_out
    moved = (k_in * n_out + tokens * k_in + tokens * n_out) * dtype_bytes
    return np.maximum(flops / peak, moved / bw)


def sharded_compute_s(cells: pd.DataFrame) -> np.ndarray:
    """T_cmp/k per cell in seconds: the per-rank roofline of one decode step."""
    c = {name: cells[name].to_numpy(dtype=float) for name in CELL_COLUMNS}
    k, n, b = c["tp"], c["batch"], c["dtype_bytes"]
    peak, bw = c["peak_flops"], c["mem_bw"]
    h, hd = c["hidden_size"], c["head_dim"]
    q_width = c["num_attention_heads"] * hd / k
    kv_heads = np.ceil(c["num_key_value_heads"] / k)  # vLLM replicates KV heads when k exceeds them
    kv_width = kv_heads * hd
    per_layer = (
        _gemm_s(n, h, q_width + 2 * kv_width, peak, bw, b)          # QKV
        + _gemm_s(n, q_width, h, peak, bw, b)                       # O
        + _gemm_s(n, h, 2 * c["intermediate_size"] / k, peak, bw, b)  # gate/up
        + _gemm_s(n, c["intermediate_size"] / k, h, peak, bw, b)      # down
    )
    kv_bytes = n * c["ctx"] * 2 * kv_width * b
    attention_flops = 4.0 * n * c["ctx"] * q_width
    per_layer += np.maximum(attention_flops / peak, kv_bytes / bw)
    lm_head = _gemm_s(n, h, c["vocab_size"] / k, peak, bw, b)
    return c["num_hidden_layers"] * per_layer + lm_head


AllReduceTerms = Union[AllReduceFit, Mapping[str, AllReduceFit]]


def allreduce_s(cells: pd.DataFrame, fit: AllReduceTerms) -> np.ndarray:
    """T_ar per cell: 2L all-reduces of batch·hidden·dtype bytes; none at k = 1.

    `fit` is one AllReduceFit for every cell, or one per SKU (keyed by the sku column).
    """
    message = cells["batch"].to_numpy(float) * cells["hidden_size"].to_numpy(float) * cells["dtype_bytes"].to_numpy(float)
    if isinstance(fit, AllReduceFit):
        latency, bandwidth = fit.latency_s, fit.bandwidth_Bps
    else:
        missing = sorted(set(cells["sku"]) - set(fit))
        if missing:
            raise ValueError(f"no all-reduce calibration for sku {missing}; have {sorted(fit)}")
        latency = cells["sku"].map({s: f.latency_s for s, f in fit.items()}).to_numpy(float)
        bandwidth = cells["sku"].map({s: f.bandwidth_Bps for s, f in fit.items()}).to_numpy(float)
    per_step = 2.0 * cells["num_hidden_layers"].to_numpy(float) * (latency + message / bandwidth)
    return np.where(cells["tp"].to_numpy() > 1, per_step, 0.0)


def fit_allreduce(message_bytes: np.ndarray, seconds: np.ndarray) -> AllReduceFit:
    """λ and β of t = λ + bytes/β over a message-size sweep, with λ ≥ 0 and 1/β ≥ 0.

    Residuals are relative (t spans 3–4 decades: absolute ones would let the largest
    message alone set λ) and soft-L1 (a shared machine's scheduling spikes are a few
    ms on a 0.1 ms message: one must not tilt the line).
    """
    size, time = np.asarray(message_bytes, float), np.asarray(seconds, float)
    if size.size < 2 or np.ptp(size) == 0:
        raise ValueError("an all-reduce fit needs at least two distinct message sizes")
    scale = float(np.median(time / size))  # order of 1/β: keeps both parameters O(1)

    def relative_residual(params: np.ndarray) -> np.ndarray:
        return (params[0] + params[1] * scale * size) / time - 1.0

    fit = least_squares(relative_residual, x0=[float(time.min()) / 2, 0.5], bounds=([0.0, 0.0], [np.inf, np.inf]),
                        loss="soft_l1", f_scale=0.1)
    latency, per_byte = float(fit.x[0]), float(fit.x[1]) * scale
    if per_byte * size.max() < 0.05 * max(latency, float(time.min())):
        raise ValueError(f"all-reduce time does not grow with message size up to {size.max():.3g} B "
                         f"(median {np.median(time) * 1e6:.0f} µs at every size); cannot fit a bandwidth: "
                         "measure larger messages or on a quieter machine")
    return AllReduceFit(latency_s=latency, bandwidth_Bps=1.0 / per_byte)


def ape(predicted: np.ndarray, measured: np.ndarray) -> np.ndarray:
    """Absolute percentage error per cell, in percent."""
    measured = np.asarray(measured, float)
    return np.abs(np.asarray(predicted, float) - measured) / measured * 100.0


def mape_summary(predicted: np.ndarray, measured: np.ndarray) -> dict[str, float]:
    errors = ape(predicted, measured)
    if errors.size == 0:
        return {"mape_mean": float("nan"), "mape_p95": float("nan"), "mape_max": float("nan"), "n": 0}
    return {"mape_mean": float(errors.mean()), "mape_p95": float(np.percentile(errors, 95)),
            "mape_max": float(errors.max()), "n": int(errors.size)}


@dataclass(frozen=True)
class BoundedFit:
    """Parameters of a bounded relative least-squares fit, and which ones sit on their bound."""

    params: np.ndarray
    at_lower_bound: np.ndarray  # bool per parameter


def bounded_relative_lsq(design: np.ndarray, target: np.ndarray, measured: np.ndarray,
                         lower: float = 0.0) -> BoundedFit:
    """Parameters p >= lower minimising Σ((design·p − target) / measured)², the squared
    relative error. Physical terms (a compute scale, a host time) are never negative, so
    an unconstrained fit that wants one below zero is told so rather than accepted."""
    design = np.asarray(design, float)
    if design.shape[1] == 0:
        return BoundedFit(np.zeros(0), np.zeros(0, bool))
    weights = 1.0 / np.asarray(measured, float)
    result = lsq_linear(design * weights[:, None], np.asarray(target, float) * weights,
                        bounds=(lower, np.inf), method="bvls")
    params = np.maximum(result.x, lower)
    return BoundedFit(params, np.asarray(result.active_mask) == -1)


def design_condition(design: np.ndarray, measured: np.ndarray) -> float:
    """Condition number of the relative-error design with unit-norm columns: how well the
    training cells separate the parameters (large: they trade off against each other)."""
    weighted = np.asarray(design, float) / np.asarray(measured, float)[:, None]
    norms = np.linalg.norm(weighted, axis=0)
    return float(np.linalg.cond(weighted / np.where(norms > 0, norms, 1.0)))
