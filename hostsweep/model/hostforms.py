"""Host-term forms of the TP model: one global compute scale, then each form's own host
parameters, fitted on training cells with physical bounds (pure, vectorized).

Each form is T_step = g·T_cmp/k + T_ar + H, with H one of:

    baseline          H = 0                      the TP study's Eq. 1: sharded compute + all-reduce
    free_constant     H = C                      k-invariant
    batch_linear      H = C0 + C1·N              k-invariant
    fixed_microbench  H = s0 + s1·(N−1), fixed   k-invariant, zero host parameters
    c_times_k         H = C·k                    k-scaling
    c_over_k          H = C/k                    k-scaling

The method of the tensor-parallel study [2] (README.md#references; "one global 70B compute
scale fit on TP-2 only"): g is fitted once, with H pinned to the microbenchmark S(N)
(`fit_scale`); every form then fits only its own host parameters with that g held
(`fit_form(..., g=...)`). Fitting g jointly with each
form is possible (`g=None`) but on in-regime TP-2 cells the compute term spans a few
percent, so g and a host constant trade off freely: `identifiability` says how badly.
All parameters are bounded below by 0 (bounded relative least squares).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from hostsweep.model.fit import (AllReduceTerms, HostFit, allreduce_s, bounded_relative_lsq,
                                 design_condition, sharded_compute_s)


@dataclass(frozen=True)
class Form:
    family: str  # "none", "k-invariant" or "k-scaling"
    formula: str
    param_names: tuple[str, ...]  # the fitted host parameters, in milliseconds


FORMS = {
    "baseline": Form("none", "H = 0", ()),
    "free_constant": Form("k-invariant", "H = C", ("C_ms",)),
    "batch_linear": Form("k-invariant", "H = C0 + C1·N", ("C0_ms", "C1_ms")),
    "fixed_microbench": Form("k-invariant", "H = s0 + s1·(N−1), fixed", ()),
    "c_times_k": Form("k-scaling", "H = C·k", ("C_ms",)),
    "c_over_k": Form("k-scaling", "H = C/k", ("C_ms",)),
}
FORM_CLASSES = {name: form.family for name, form in FORMS.items()}
DEFAULT_FORM = "fixed_microbench"


@dataclass(frozen=True)
class Terms:
    """The per-cell pieces every form is built from, computed once per cell frame."""

    compute_s: np.ndarray  # T_cmp/k, before the scale g
    allreduce_s: np.ndarray
    microbench_s: np.ndarray  # S(N) from the host calibration
    tp: np.ndarray
    batch: np.ndarray

    def take(self, mask: np.ndarray) -> "Terms":
        return Terms(*(getattr(self, f)[mask] for f in ("compute_s", "allreduce_s", "microbench_s", "tp", "batch")))


def cell_terms(cells: pd.DataFrame, allreduce: AllReduceTerms, host: HostFit) -> Terms:
    batch = cells["batch"].to_numpy(float)
    return Terms(sharded_compute_s(cells), allreduce_s(cells, allreduce), host.time_s(batch),
                 cells["tp"].to_numpy(float), batch)


@dataclass(frozen=True)
class FittedForm:
    form: str
    g: float
    host_params: tuple[float, ...]  # seconds, in the order of FORMS[form].param_names
    at_bound: tuple[str, ...] = ()  # parameters the fit pushed onto their lower bound 0
    g_source: str = "global"  # "global": the pinned-H scale; "joint": fitted with this form

    @property
    def form_class(self) -> str:
        return FORM_CLASSES[self.form]

    def named_params_ms(self) -> dict[str, float]:
        return {name: value * 1e3 for name, value in zip(FORMS[self.form].param_names, self.host_params)}


@dataclass(frozen=True)
class ScaleFit:
    """The global compute scale g, fitted with H pinned to the microbenchmark."""

    g: float
    at_bound: bool
    cells: int


def _check_form(form: str) -> None:
    if form not in FORMS:
        raise ValueError(f"unknown host form {form!r}; known: {', '.join(FORMS)}")


def host_basis(form: str, terms: Terms) -> np.ndarray:
    """Columns multiplying the form's free host parameters (n × p, p may be 0)."""
    n = terms.tp.size
    columns = {
        "baseline": [], "fixed_microbench": [],
        "free_constant": [np.ones(n)],
        "batch_linear": [np.ones(n), terms.batch],
        "c_times_k": [terms.tp],
        "c_over_k": [1.0 / terms.tp],
    }[form]
    return np.column_stack(columns) if columns else np.zeros((n, 0))


def fixed_s(form: str, terms: Terms) -> np.ndarray:
    """The parts of the prediction with no fitted parameter: T_ar, plus S(N) when fixed."""
    return terms.allreduce_s + (terms.microbench_s if form == "fixed_microbench" else 0.0)


def fit_scale(train: Terms, measured_ms: np.ndarray) -> ScaleFit:
    """g with H pinned to S(N): T_step − T_ar − S(N) = g·T_cmp/k, g >= 0."""
    if train.tp.size == 0:
        raise ValueError("no training cells: the training selection matched nothing in-regime")
    measured = np.asarray(measured_ms, float) / 1e3
    fit = bounded_relative_lsq(train.compute_s[:, None], measured - fixed_s("fixed_microbench", train), measured)
    return ScaleFit(float(fit.params[0]), bool(fit.at_lower_bound[0]), int(train.tp.size))


def fit_form(form: str, train: Terms, measured_ms: np.ndarray, g: float | None) -> FittedForm:
    """The form's host parameters with g held (the TP study's way), or with g fitted jointly (g=None)."""
    _check_form(form)
    if train.tp.size == 0:
        raise ValueError("no training cells: the training selection matched nothing in-regime")
    measured = np.asarray(measured_ms, float) / 1e3
    basis = host_basis(form, train)
    target = measured - fixed_s(form, train)
    if g is None:
        fit = bounded_relative_lsq(np.column_stack([train.compute_s, basis]), target, measured)
        names = ("g",) + FORMS[form].param_names
        g_value, host = float(fit.params[0]), fit.params[1:]
    else:
        fit = bounded_relative_lsq(basis, target - g * train.compute_s, measured)
        names, g_value, host = FORMS[form].param_names, float(g), fit.params
    at_bound = tuple(name for name, hit in zip(names, fit.at_lower_bound) if hit)
    return FittedForm(form, g_value, tuple(float(p) for p in host), at_bound, "global" if g is not None else "joint")


def identifiability(form: str, train: Terms, measured_ms: np.ndarray) -> dict[str, float]:
    """How well the training cells separate g from the form's host parameters: the
    condition number of the joint design and the relative spread of the compute term."""
    design = np.column_stack([train.compute_s, host_basis(form, train)])
    spread = float(np.ptp(train.compute_s) / np.mean(train.compute_s))
    return {"condition_number": design_condition(design, np.asarray(measured_ms, float)),
            "compute_spread": spread}


def predict_terms_s(fitted: FittedForm, terms: Terms) -> np.ndarray:
    basis = host_basis(fitted.form, terms)
    host_term = basis @ np.asarray(fitted.host_params) if basis.shape[1] else 0.0
    return fitted.g * terms.compute_s + fixed_s(fitted.form, terms) + host_term


def predict_s(fitted: FittedForm, cells: pd.DataFrame, allreduce: AllReduceTerms, host: HostFit) -> np.ndarray:
    return predict_terms_s(fitted, cell_terms(cells, allreduce, host))


def fit_all_forms(train: Terms, measured_ms: np.ndarray, g: float | None) -> dict[str, FittedForm]:
    """Every form, fitted on the same training cells (g held when given)."""
    return {form: fit_form(form, train, measured_ms, g) for form in FORMS}
