"""Host-term forms of the TP model, fitted on training cells, scored held-out (pure).

Each form is T_step = g·T_cmp/k + T_ar + H, with H one of:

    baseline          H = 0                       (the compute + communication model)
    free_constant     H = C                       k-invariant
    batch_linear      H = C0 + C1·N               k-invariant
    fixed_microbench  H = s0 + s1·(N−1), fixed    k-invariant, zero host parameters
    c_times_k         H = C·k                     k-scaling
    c_over_k          H = C/k                     k-scaling

g and the form's parameters are fitted jointly by relative least squares on the
training cells only. On a single TP degree the k-invariant and k-scaling forms are
indistinguishable; only held-out TP degrees separate them, so the comparison is
reported on held-out cells and never on training error.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from hostsweep.model.fit import AllReduceTerms, HostFit, allreduce_s, mape_summary, relative_least_squares, sharded_compute_s

FORM_CLASSES = {
    "baseline": "none",
    "free_constant": "k-invariant",
    "batch_linear": "k-invariant",
    "fixed_microbench": "k-invariant",
    "c_times_k": "k-scaling",
    "c_over_k": "k-scaling",
}
DEFAULT_FORM = "fixed_microbench"


@dataclass(frozen=True)
class FittedForm:
    form: str
    g: float
    host_params: tuple[float, ...]  # seconds; meaning depends on the form

    @property
    def form_class(self) -> str:
        return FORM_CLASSES[self.form]


def host_basis(form: str, cells: pd.DataFrame) -> np.ndarray:
    """Columns multiplying the form's free host parameters (n × p, p may be 0)."""
    n = len(cells)
    k = cells["tp"].to_numpy(float)
    batch = cells["batch"].to_numpy(float)
    columns = {
        "baseline": [], "fixed_microbench": [],
        "free_constant": [np.ones(n)],
        "batch_linear": [np.ones(n), batch],
        "c_times_k": [k],
        "c_over_k": [1.0 / k],
    }[form]
    return np.column_stack(columns) if columns else np.zeros((n, 0))


def fixed_terms_s(form: str, cells: pd.DataFrame, allreduce: AllReduceTerms, host: HostFit) -> np.ndarray:
    """The parts of the prediction with no fitted parameter: T_ar, plus S(N) when fixed."""
    fixed = allreduce_s(cells, allreduce)
    if form == "fixed_microbench":
        fixed = fixed + host.time_s(cells["batch"].to_numpy(float))
    return fixed


def fit_form(form: str, train: pd.DataFrame, allreduce: AllReduceTerms, host: HostFit) -> FittedForm:
    """g and the host parameters of one form, from the training cells' step_ms."""
    if form not in FORM_CLASSES:
        raise ValueError(f"unknown host form {form!r}; known: {', '.join(FORM_CLASSES)}")
    if train.empty:
        raise ValueError("no training cells: the training selection matched nothing in-regime")
    measured = train["step_ms"].to_numpy(float) / 1e3
    design = np.column_stack([sharded_compute_s(train), host_basis(form, train)])
    target = measured - fixed_terms_s(form, train, allreduce, host)
    params = relative_least_squares(design, target, measured)
    return FittedForm(form, float(params[0]), tuple(float(p) for p in params[1:]))


def host_and_allreduce_s(fitted: FittedForm, cells: pd.DataFrame, allreduce: AllReduceTerms,
                         host: HostFit) -> np.ndarray:
    """H + T_ar, whatever form H takes: the model's step with zero compute (its lower bound)."""
    basis = host_basis(fitted.form, cells)
    host_term = basis @ np.asarray(fitted.host_params) if basis.shape[1] else 0.0
    return host_term + fixed_terms_s(fitted.form, cells, allreduce, host)


def predict_s(fitted: FittedForm, cells: pd.DataFrame, allreduce: AllReduceTerms, host: HostFit) -> np.ndarray:
    return fitted.g * sharded_compute_s(cells) + host_and_allreduce_s(fitted, cells, allreduce, host)


def compare_forms(train: pd.DataFrame, held_out: pd.DataFrame, allreduce: AllReduceTerms,
                  host: HostFit) -> pd.DataFrame:
    """One row per form: fitted g and host parameters, training and held-out MAPE."""
    rows = []
    for form in FORM_CLASSES:
        fitted = fit_form(form, train, allreduce, host)
        train_err = mape_summary(predict_s(fitted, train, allreduce, host) * 1e3, train["step_ms"])
        test_err = mape_summary(predict_s(fitted, held_out, allreduce, host) * 1e3, held_out["step_ms"])
        rows.append({
            "form": form, "class": fitted.form_class, "g": fitted.g,
            "host_params_ms": ", ".join(f"{p * 1e3:.3f}" for p in fitted.host_params),
            "train_mape_mean": train_err["mape_mean"],
            "heldout_mape_mean": test_err["mape_mean"], "heldout_mape_p95": test_err["mape_p95"],
            "heldout_mape_max": test_err["mape_max"], "heldout_n": test_err["n"],
        })
    return pd.DataFrame(rows)


def verdict(comparison: pd.DataFrame) -> str:
    """The class of the host form that predicts the held-out cells best (by mean MAPE)."""
    candidates = comparison[comparison["class"] != "none"]
    best = candidates.loc[candidates["heldout_mape_mean"].idxmin()]
    return f"{best['class']} (best held-out form: {best['form']}, {best['heldout_mape_mean']:.1f}% mean MAPE)"
