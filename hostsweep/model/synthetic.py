"""Synthetic cells from known TP-model parameters on the grid of the tensor-parallel
study [2] (README.md#references) (pure): what the fit tests recover, and what
`hostsweep-model synth` writes so a user can try the fit on a truth they chose.

    step = g·T_cmp/k + T_ar + H_truth,  times (1 + noise·ε), ε ~ N(0, 1) per cell

H_truth is one of the host forms ("invariant": the microbenchmark S(N); "times_k":
C·k; "over_k": C/k, each equal to S(N) at the training TP degree) or any array. Each
cell gets a 95% CI around its step (± 1.96·noise unless told), as a bootstrap reports it.
The a-priori out-of-regime cells can be made to measure `outlier_factor` × their
model value, like the study's disclosed memory-pressure cell; `push_below_bound` puts chosen
cells under H + T_ar, the way the study's H200 TP-4 cells measured.
"""
from __future__ import annotations

from itertools import product
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

from hostsweep.model.fit import AllReduceTerms, HostFit, allreduce_s, sharded_compute_s
from hostsweep.model.inputs import in_regime, model_inputs

TP_STUDY_TOKENS = 33  # the TP study [2] generates 33 tokens per timed run
TP_STUDY_BATCHES = (1, 2, 4, 8)
TP_STUDY_CTXS = (512, 2048, 4096)
TP_STUDY_TPS = (2, 4)
TP_STUDY_OUTLIER_FACTOR = 1.0 / (1.0 - 0.433)  # its outlier mispredicts by 43.3% of the measured step
HOST_TRUTHS = ("invariant", "times_k", "over_k")


def grid(skus: Sequence[str], model: str, shapes: Mapping[str, Mapping[str, Any]],
         sku_specs: Mapping[str, Mapping[str, Any]], tps: Sequence[int] = TP_STUDY_TPS,
         batches: Sequence[int] = TP_STUDY_BATCHES, ctxs: Sequence[int] = TP_STUDY_CTXS,
         tokens: int = TP_STUDY_TOKENS) -> pd.DataFrame:
    """The cell frame of a (sku × tp × batch × ctx) grid, step_ms still NaN."""
    rows = pd.DataFrame([{"sku": s, "model": model, "tp": k, "batch": n, "ctx": c, "T": tokens, "step_ms": np.nan}
                         for s, k, n, c in product(skus, tps, batches, ctxs)])
    frame = model_inputs(rows, shapes, sku_specs)
    frame["in_regime"] = in_regime(frame)
    return frame


def host_truth_s(kind: str, cells: pd.DataFrame, host: HostFit, train_tp: int = 2) -> np.ndarray:
    """The true host term per cell: S(N), or S(N) scaled so it equals S(N) at `train_tp`."""
    microbench = host.time_s(cells["batch"].to_numpy(float))
    k = cells["tp"].to_numpy(float)
    scale = {"invariant": np.ones_like(k), "times_k": k / train_tp, "over_k": train_tp / k}
    if kind not in scale:
        raise ValueError(f"unknown host truth {kind!r}; known: {', '.join(HOST_TRUTHS)}")
    return microbench * scale[kind]


def clean_step_s(cells: pd.DataFrame, g: float, allreduce: AllReduceTerms, host_s: np.ndarray) -> np.ndarray:
    return g * sharded_compute_s(cells) + allreduce_s(cells, allreduce) + np.asarray(host_s, float)


def measure(cells: pd.DataFrame, clean_s: np.ndarray, noise: float, seed: int, ci_pct: float | None = None,
            outlier_factor: float = 1.0) -> pd.DataFrame:
    """The cells with step_ms and its CI columns, drawn around the clean step times; the CI
    is ± ci_pct percent, by default ± 1.96·noise (so it covers the truth 95% of the time)."""
    rng = np.random.default_rng(seed)
    ci_pct = 196.0 * noise if ci_pct is None else ci_pct
    step_ms = np.asarray(clean_s, float) * (1.0 + rng.normal(0.0, noise, len(cells))) * 1e3
    if "in_regime" in cells:
        step_ms = np.where(cells["in_regime"].to_numpy(bool), step_ms, step_ms * outlier_factor)
    out = cells.copy()
    out["step_ms"] = step_ms
    out["step_ci_low_ms"] = step_ms * (1.0 - ci_pct / 100.0)
    out["step_ci_high_ms"] = step_ms * (1.0 + ci_pct / 100.0)
    return out


def push_below_bound(cells: pd.DataFrame, which: np.ndarray, allreduce: AllReduceTerms, host: HostFit,
                factor: float) -> pd.DataFrame:
    """The `which` cells re-measured at factor × (S(N) + T_ar), CI width kept: cells that
    falsify the additive model when factor < 1."""
    which = np.asarray(which, bool)
    out = cells.copy()
    bound_ms = (host.time_s(cells["batch"].to_numpy(float)) + allreduce_s(cells, allreduce)) * 1e3
    step = out["step_ms"].to_numpy(float)
    new = np.where(which, bound_ms * factor, step)
    out["step_ms"] = new
    for column in ("step_ci_low_ms", "step_ci_high_ms"):
        if column in out:
            out[column] = out[column].to_numpy(float) / step * new
    return out
