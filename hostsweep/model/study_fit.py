"""The fit stage as one pure function: `fit_study(cells, terms, options) -> FitReport`.

The method of the tensor-parallel study [2] (README.md#references): one global compute
scale g fitted on the in-regime training cells with H pinned to the microbenchmark; each
host form then fits its own parameters with g held; every form scored per held-out (SKU,
TP) group; groups with a cell whose 95% CI lies below
H + T_ar are falsified and kept out of the form comparison; verdicts with a paired
bootstrap CI; the TP shrink and g with and without the out-of-regime cells.

`FitReport.to_dict()` is the JSON other tools read (`hostsweep-model fit` writes it as
fit.json); `hostsweep.model.fit_console` renders the same report for a terminal.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional

import numpy as np
import pandas as pd

from hostsweep.config.schema import CalibrationConfig
from hostsweep.model.evidence import CI_COLUMNS, falsifying, tp_shrink
from hostsweep.model.fit import CELL_COLUMNS, AllReduceFit, HostFit, ape
from hostsweep.model.hostforms import (DEFAULT_FORM, FORMS, FittedForm, ScaleFit, Terms, cell_terms, fit_all_forms,
                                       fit_scale, identifiability, predict_terms_s)
from hostsweep.model.inputs import in_regime
from hostsweep.model.resolution import inconclusive_noise, overall_noise
from hostsweep.model.term_checks import (ALLREDUCE_MISMATCH, INSITU_COLUMNS, SPLIT_COLUMNS, STANDALONE,
                                         decomposition_table, guard_group, insitu_fallback, mark_insitu,
                                         path_of, term_paths)
from hostsweep.model.verdict import (StartShift, falsifying_threshold, host_family_verdict, overall_verdict,
                                     relative_shift_sd, start_shift_sd)

SCHEMA = "hostsweep.fit/1"
G_MODES = ("pinned", "joint")
BOUNDS = ("microbench", "conservative")


@dataclass(frozen=True)
class CalibrationTerms:
    """A calibration in the model's units: all-reduce fits by SKU, H(N), measured roofs."""

    allreduce: dict[str, AllReduceFit]
    host: HostFit
    roofs: dict[str, dict[str, float]] = field(default_factory=dict)
    # "engine" when H(N) was fitted to the engine's own TP-1 host time, else the calibration's
    # line (model/term_checks.host_path): the falsification guard reads it
    host_path: str = STANDALONE
    # By SKU, the path T_ar was measured on (ENGINE / STANDALONE) and what ran (the guard and
    # the report read them); the standalone fits (the TP study's method) recorded beside
    allreduce_paths: dict[str, str] = field(default_factory=dict)
    allreduce_methods: dict[str, str] = field(default_factory=dict)
    allreduce_standalone: dict[str, AllReduceFit] = field(default_factory=dict)
    allreduce_standalone_methods: dict[str, str] = field(default_factory=dict)
    allreduce_requested: str = ""  # fit.allreduce (engine | standalone); "" where no stage chose

    def to_dict(self) -> dict[str, Any]:
        def fits(items: dict[str, AllReduceFit], paths: dict[str, str], methods: dict[str, str]) -> dict[str, Any]:
            return {sku: {"latency_us": f.latency_s * 1e6, "bandwidth_gbps": f.bandwidth_Bps / 1e9,
                          "path": paths.get(sku, STANDALONE), "method": methods.get(sku, "")}
                    for sku, f in items.items()}

        standalone = {sku: STANDALONE for sku in self.allreduce_standalone}
        return {"host": {"s0_ms": self.host.s0_s * 1e3, "s1_ms": self.host.s1_s * 1e3, "path": self.host_path},
                "allreduce": fits(self.allreduce, self.allreduce_paths, self.allreduce_methods),
                "allreduce_requested": self.allreduce_requested,
                "allreduce_standalone": fits(self.allreduce_standalone, standalone, self.allreduce_standalone_methods),
                "roofs": self.roofs}


def calibration_terms(calibration: CalibrationConfig) -> CalibrationTerms:
    allreduce = {sku: AllReduceFit(v.latency_us * 1e-6, v.bandwidth_gbps * 1e9)
                 for sku, v in calibration.allreduce.items()}
    host = HostFit(calibration.host.s0_ms * 1e-3, calibration.host.s1_ms * 1e-3)
    roofs = {sku: asdict(r) for sku, r in calibration.roofs.items()}
    roofs.update({key: asdict(r) for key, r in calibration.roofs_by_dtype.items()})
    standalone = {sku: AllReduceFit(v.latency_us * 1e-6, v.bandwidth_gbps * 1e9)
                  for sku, v in calibration.allreduce_standalone.items()}
    return CalibrationTerms(allreduce, host, roofs,
                            allreduce_paths={sku: path_of(v) for sku, v in calibration.allreduce.items()},
                            allreduce_methods={sku: v.method for sku, v in calibration.allreduce.items()},
                            allreduce_standalone=standalone,
                            allreduce_standalone_methods={sku: v.method
                                                          for sku, v in calibration.allreduce_standalone.items()})


@dataclass(frozen=True)
class FitOptions:
    train_sku: str
    train_tp: tuple[int, ...] = (2,)
    form: str = DEFAULT_FORM  # the form whose predictions the logged model makes
    g_mode: str = "pinned"  # "pinned": as in [2] (H = S(N) while fitting g); "joint": g refitted per form
    bound: str = "microbench"  # falsification bound H: the microbenchmark S(N), or the lowest k-invariant fit
    utilization: float = 0.9  # the a-priori memory criterion
    resamples: int = 2000
    seed: int = 0
    margin_pct: float = 1.0  # MAPE points a CI must clear for a verdict (about what 1.5% noise alone gives)
    # SD (%) of the step between engine starts on the measuring machine (fit.start_floor_pct,
    # verdict.StartShift); None: the verdicts' intervals hold the cells' spread only
    start_floor_pct: Optional[float] = None
    condition_warning: float = 30.0  # joint fits with a worse condition number are flagged

    def check(self) -> None:
        if self.form not in FORMS:
            raise ValueError(f"form {self.form!r} is not a host form; known: {', '.join(FORMS)}")
        if self.g_mode not in G_MODES:
            raise ValueError(f"g_mode {self.g_mode!r} is not one of {', '.join(G_MODES)}")
        if self.bound not in BOUNDS:
            raise ValueError(f"bound {self.bound!r} is not one of {', '.join(BOUNDS)}")
        if self.start_floor_pct is not None and not 0 <= self.start_floor_pct < 100:
            raise ValueError(f"start_floor_pct must be a percentage in [0, 100) or null, got {self.start_floor_pct}")


@dataclass
class FitReport:
    options: FitOptions
    calibration: dict[str, Any]  # the pinned terms, in ms / µs / GB/s
    scale: dict[str, Any]
    forms: dict[str, FittedForm]
    scores: list[dict[str, Any]]  # per form and (sku, tp, role) group: MAPE mean/p95/max, n
    groups: list[dict[str, Any]]  # per (sku, tp, role): cells, regime, falsification, verdict
    verdict: dict[str, Any]
    falsification: dict[str, Any]
    shrink: list[dict[str, Any]]
    predictions: pd.DataFrame  # one row per cell
    warnings: list[str]

    @property
    def chosen(self) -> FittedForm:
        return self.forms[self.options.form]

    def to_dict(self) -> dict[str, Any]:
        forms = [{"form": name, "family": FORMS[name].family, "formula": FORMS[name].formula, "g": f.g,
                  "g_source": f.g_source, "params_ms": f.named_params_ms(), "at_bound": list(f.at_bound)}
                 for name, f in self.forms.items()]
        return _clean({
            "schema": SCHEMA, "options": {**asdict(self.options), "train_tp": list(self.options.train_tp)},
            "calibration": self.calibration, "scale": self.scale, "forms": forms, "scores": self.scores, "groups": self.groups,
            "verdict": self.verdict, "falsification": self.falsification, "shrink": self.shrink,
            "warnings": self.warnings, "cells": self.predictions.to_dict(orient="records"),
            # the chosen form's additive term taken apart per (sku, model, tp): the report draws it as given
            "decomposition": decomposition_table(self.predictions, self.options.form).to_dict(orient="records"),
        })


def _clean(value: Any) -> Any:
    """JSON-safe: numpy scalars to Python, NaN/inf to None."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, (np.integer, np.bool_)):
        return value.item()
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    return value


def _roles(cells: pd.DataFrame, options: FitOptions) -> np.ndarray:
    selected = ((cells["sku"] == options.train_sku) & cells["tp"].isin(options.train_tp)).to_numpy()
    regime = cells["in_regime"].to_numpy(bool)
    return np.where(selected & regime, "train", np.where(selected, "excluded", "held-out"))


def _scale(pinned: ScaleFit, terms: Terms, step_ms: np.ndarray, roles: np.ndarray,
           forms: dict[str, FittedForm], options: FitOptions, warnings: list[str]) -> dict[str, Any]:
    """g as fitted (pinned H), g with the out-of-regime training cells, and in joint mode
    each form's own g with how well the training cells identify it."""
    train = roles == "train"
    selected = roles != "held-out"
    outliers: ScaleFit = fit_scale(terms.take(selected), step_ms[selected])
    scale = {"g": pinned.g, "method": "one global g on the training cells, H pinned to the microbenchmark S(N)",
             "at_bound": pinned.at_bound, "cells": pinned.cells, "g_mode": options.g_mode,
             "g_with_out_of_regime": outliers.g, "cells_with_out_of_regime": outliers.cells}
    if pinned.at_bound:
        warnings.append("g hit its lower bound 0: the training cells sit below T_ar + S(N)")
    if options.g_mode == "joint":
        scale["joint"] = {}
        for name, fitted in forms.items():
            check = identifiability(name, terms.take(train), step_ms[train])
            scale["joint"][name] = {"g": fitted.g, **check}
            if check["condition_number"] > options.condition_warning:
                warnings.append(f"{name}: g and the host parameters are not identifiable from the training cells "
                                f"(condition number {check['condition_number']:.0f}, compute term spans "
                                f"{check['compute_spread']:.1%}); prefer the pinned-H g (g_mode=pinned)")
    return scale


# Identity columns carried through to the predictions when the cells have them, so every
# row of fit.json can be traced to its MLflow run.
TRACE_COLUMNS = ("mode", "run_id", "cell_key", "parent_run_id")


# What makes two cells one engine start: the engine's identity within one sweep (its parent run).
START_COLUMNS = ("sku", "model", "mode", "tp", "parent_run_id")


def engine_starts(cells: pd.DataFrame) -> np.ndarray:
    """Each cell's engine start as an index 0 .. k-1: cells of one engine in one sweep met
    one machine speed together (the columns of START_COLUMNS the cells carry)."""
    columns = [c for c in START_COLUMNS if c in cells]
    keys = cells[columns].astype(str).agg("|".join, axis=1) if columns else pd.Series("", index=cells.index)
    return pd.factorize(keys)[0].astype(int)


def training_start_count(cells: pd.DataFrame, roles: np.ndarray) -> int:
    """How many engine starts the fit's training cells came from (the in-regime ones)."""
    train = (roles == "train") & cells["in_regime"].to_numpy(bool)
    return max(1, len(np.unique(engine_starts(cells)[train])))


def _predictions(cells: pd.DataFrame, predicted: dict[str, np.ndarray], roles: np.ndarray,
                 bound_ms: np.ndarray, terms: Terms, g: float, options: FitOptions,
                 training_starts: int) -> pd.DataFrame:
    keep = [c for c in ("sku", "model", "tp", "batch", "ctx", "step_ms", *CI_COLUMNS, *TRACE_COLUMNS, *SPLIT_COLUMNS,
                        *INSITU_COLUMNS) if c in cells]
    regime = cells["in_regime"].to_numpy(bool)
    columns = {c: cells[c].to_numpy() for c in keep}
    columns |= {"role": roles, "in_regime": regime, "predicted_ms": predicted[options.form],
                "ape_pct": ape(predicted[options.form], columns["step_ms"])}
    columns |= {f"{name}_ms": values for name, values in predicted.items()}
    # the model's pieces per cell: g·T_cmp/k with the global g, T_ar and S(N)
    columns |= {"compute_ms": g * terms.compute_s * 1e3, "allreduce_ms": terms.allreduce_s * 1e3,
                "microbench_ms": terms.microbench_s * 1e3}
    relative = relative_shift_sd(start_shift_sd(options.start_floor_pct), training_starts)
    verdicts = falsifying(cells, bound_ms, (roles == "held-out") & regime, relative)
    return pd.DataFrame(columns).join(verdicts.reset_index(drop=True))


def _bound_ms(terms: Terms, forms: dict[str, FittedForm], options: FitOptions) -> np.ndarray:
    """H + T_ar from the microbenchmark, or the lowest H any k-invariant fit gives."""
    if options.bound == "microbench":
        return (terms.microbench_s + terms.allreduce_s) * 1e3
    hosts = [predict_terms_s(FittedForm(f.form, 0.0, f.host_params), terms)
             for f in forms.values() if f.form_class == "k-invariant"]
    return np.min(np.vstack(hosts), axis=0) * 1e3


def _shift(starts: np.ndarray, inside: np.ndarray, predicted: dict[str, np.ndarray], step: np.ndarray,
           sd: float, training_starts: int) -> Optional[StartShift]:
    """The held-out group's shared start shift (verdict.StartShift) over its `inside` cells,
    `starts` being every cell's engine start; None without a floor (sd 0)."""
    if sd <= 0:
        return None
    own = pd.factorize(starts[inside])[0].astype(int)
    return StartShift({f: v[inside] for f, v in predicted.items()}, step[inside], own, sd, training_starts)


def _groups(table: pd.DataFrame, options: FitOptions, terms: CalibrationTerms,
            training_starts: int) -> tuple[list[dict], list[dict]]:
    """Per (sku, tp, role): counts, falsification, each form's MAPE and the group verdict,
    a held-out one guarded by its own terms (model/term_checks.guard_group)."""
    groups, scores = [], []
    step = table["step_ms"].to_numpy(float)
    regime, falsifies = table["in_regime"].to_numpy(bool), table["falsifies"].to_numpy(bool)
    judged = table["judged_on"].to_numpy()
    predicted = {form: table[f"{form}_ms"].to_numpy(float) for form in FORMS}
    errors = {form: ape(values, step) for form, values in predicted.items()}
    low, high = (table[c].to_numpy(float) if c in table else np.full(len(table), np.nan) for c in CI_COLUMNS)
    starts, sd = engine_starts(table), start_shift_sd(options.start_floor_pct)
    for (sku, tp, role), index in sorted(table.groupby(["sku", "tp", "role"]).indices.items()):
        inside = index[regime[index]]
        below = int(falsifies[index].sum())
        needed = falsifying_threshold(len(inside), bool(len(inside)) and bool((judged[inside] == "ci_high").all()))
        falsified = below > 0 and below >= needed
        row = {"sku": sku, "tp": int(tp), "role": role, "cells": len(index), "n": len(inside),
               "out_of_regime": len(index) - len(inside), "falsifying_cells": below,
               "falsifying_needed": needed, "falsified": falsified, "judged_on": sorted(set(judged[inside]))}
        scores += [{"form": form, "sku": sku, "tp": int(tp), "role": role, **_summary(errors[form][inside])}
                   for form in FORMS]
        if role == "held-out" and len(inside):
            shift = _shift(starts, inside, predicted, step, sd, training_starts)
            evidence = host_family_verdict({form: e[inside] for form, e in errors.items()}, int(tp) not in options.train_tp,
                                           options.resamples, options.seed, options.margin_pct, shift)
            # an inconclusive question: could the cells' own CIs have resolved it at all?
            noise = inconclusive_noise(evidence, {f: v[inside] for f, v in predicted.items()}, step[inside],
                                       low[inside], high[inside], options.margin_pct, options.resamples, options.seed,
                                       shift)
            if noise:
                evidence["noise"] = noise
            row.update(evidence if not falsified else {
                "verdict": "falsified", "reason": f"{below} cell(s) below H + T_ar: kept out of the comparison",
                "evidence_apart": evidence})
        if role == "held-out" and len(inside):
            paths = term_paths(terms, sku)
            row = guard_group(row, table.iloc[inside], paths)
        groups.append(row)
    return groups, scores


def _summary(errors: np.ndarray) -> dict[str, float]:
    if errors.size == 0:
        return {"mape_mean": float("nan"), "mape_p95": float("nan"), "mape_max": float("nan"), "n": 0}
    return {"mape_mean": float(errors.mean()), "mape_p95": float(np.percentile(errors, 95)),
            "mape_max": float(errors.max()), "n": int(errors.size)}


def _falsification(table: pd.DataFrame, groups: list[dict], options: FitOptions,
                   warnings: list[str]) -> dict[str, Any]:
    judged = (table["role"] == "held-out") & table["in_regime"]
    points_only = int((judged & (table["judged_on"] == "point")).sum())
    if points_only:
        warnings.append(f"{points_only} held-out cells carry no CI columns: judged on their point value")
    return {
        "bound": "S(N) + T_ar (microbenchmark H)" if options.bound == "microbench" else "lowest k-invariant H + T_ar",
        "rule": "a held-out in-regime cell falsifies when its 95% CI upper end (or, without CI, its point value) "
                "lies below the bound; a (sku, tp) group is falsified when more of its cells do than their CIs "
                "would put there by chance (one-sided binomial, 2.5% per cell, 5% level; without CIs: one cell)",
        "judged_on_point": points_only,
        "falsified_groups": [{"sku": g["sku"], "tp": g["tp"]} for g in groups if g["falsified"]],
        # groups whose calibrated T_ar misses their in-situ all-reduce: not judged (term_checks)
        "allreduce_mismatch_groups": [{"sku": g["sku"], "tp": g["tp"]} for g in groups
                                      if g.get("verdict") == ALLREDUCE_MISMATCH],
        # groups judged with T_ar from their own traces, the calibration having missed it
        "insitu_allreduce_groups": [{"sku": g["sku"], "tp": g["tp"]} for g in groups
                                    if g.get("allreduce_source") == "insitu"],
        "cells": table[table["falsifies"]].to_dict(orient="records"),
    }


def fit_study(cells: pd.DataFrame, terms: CalibrationTerms, options: FitOptions) -> FitReport:
    """Fit, score, compare and falsify on a cell frame (inputs.model_inputs' columns and
    step_ms, optionally step_ci_low_ms/step_ci_high_ms and in_regime)."""
    options.check()
    missing = [c for c in (*CELL_COLUMNS, "sku", "model", "step_ms", "T") if c not in cells]
    if missing:
        raise ValueError(f"cells lack columns {missing}: build them with hostsweep.model.inputs.model_inputs")
    cells = cells.reset_index(drop=True)
    if "in_regime" not in cells:
        cells = cells.assign(in_regime=in_regime(cells, options.utilization))
    roles = _roles(cells, options)
    if not (roles == "train").any():
        raise ValueError(f"no training cells: nothing in-regime on sku {options.train_sku!r} at tp {list(options.train_tp)}")
    all_terms = cell_terms(cells, terms.allreduce, terms.host)
    step_ms = cells["step_ms"].to_numpy(float)
    train = roles == "train"
    warnings: list[str] = []
    pinned = fit_scale(all_terms.take(train), step_ms[train])
    forms = fit_all_forms(all_terms.take(train), step_ms[train], None if options.g_mode == "joint" else pinned.g)
    scale = _scale(pinned, all_terms, step_ms, roles, forms, options, warnings)
    training_starts = training_start_count(cells, roles)

    def judged(with_terms: Terms) -> tuple[dict[str, np.ndarray], pd.DataFrame, list[dict], list[dict]]:
        predicted = {name: predict_terms_s(f, with_terms) * 1e3 for name, f in forms.items()}
        table = _predictions(cells, predicted, roles, _bound_ms(with_terms, forms, options), with_terms, pinned.g,
                             options, training_starts)
        return (predicted, table, *_groups(table, options, terms, training_starts))

    predicted, table, groups, scores = judged(all_terms)
    if (insitu := insitu_fallback(cells, groups)) is not None:
        # the calibration missed the all-reduce the engine paid: judge those groups with T_ar from
        # their own traces instead of not at all (term_checks.insitu_fallback says why)
        calibrated = {(g["sku"], g["tp"]): g["allreduce_check"] for g in groups if g.get("verdict") == ALLREDUCE_MISMATCH}
        predicted, table, groups, scores = judged(replace(all_terms, allreduce_s=np.where(
            np.isfinite(insitu), insitu, all_terms.allreduce_s)))
        groups = [mark_insitu(g, calibrated[(g["sku"], g["tp"])]) if (g["sku"], g["tp"]) in calibrated
                  and g["role"] == "held-out" else g for g in groups]
    compared = [g for g in groups if g["role"] == "held-out" and "verdict" in g
                and g["verdict"] not in ("falsified", ALLREDUCE_MISMATCH)]
    falsification = _falsification(table, groups, options, warnings)
    shrink = tp_shrink(cells, {"measured": step_ms, "baseline": predicted["baseline"],
                               "model": predicted[options.form]})
    verdict = overall_verdict(compared, [(g["sku"], g["tp"]) for g in groups if g["role"] == "held-out"
                                         and g.get("verdict") == "falsified" and g["tp"] not in options.train_tp])
    if mismatched := [f"{g['sku']} TP-{g['tp']}" for g in groups if g.get("verdict") == ALLREDUCE_MISMATCH]:
        verdict["reason"] += f"; not judged, the calibrated T_ar misses the in-situ all-reduce: {', '.join(mismatched)}"
    if verdict["verdict"] == "inconclusive" and (noise := overall_noise(compared)):
        verdict["noise"] = noise
    return FitReport(options, terms.to_dict(), scale, forms, scores, groups, verdict, falsification,
                     shrink, table, warnings)

