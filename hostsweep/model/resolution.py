"""Could the cells' noise have resolved an inconclusive verdict at all? (pure, vectorized)

A verdict compares two MAPEs on the same held-out cells, d = MAPE(best form of A) −
MAPE(best form of B) (A the k-scaling forms and B the k-invariant ones; or A the baseline
and B the winner's family), and needs d's 95% CI to clear ±margin. Every cell's measured
step is itself uncertain: its own 95% CI. Redrawing each cell's step from its CI (normal,
sd = half-width / 1.96) and recomputing d, best forms re-chosen per draw as the verdict
does, gives the spread the measurement noise alone puts on d: ±w, half its central 95%
range. A difference resolves only beyond margin + w (the detectable difference), and no
outcome of these cells can show a larger |d| than the forms' predictions differ by,
mean |pred_A − pred_B| / step (the separation: the triangle inequality bounds each
cell's APE difference by it).

With a between-start floor (fit.start_floor_pct, verdict.StartShift) each draw also moves
every engine start's cells together by a drawn shift: the machine's speed between starts is
measurement noise too, and the one a group's cells share.

So an inconclusive verdict is explained: the observed |d| is above the detectable
difference (the noise could have resolved it: the error differs from cell to cell, and
that leaves the CI across the margin), or below it, where the forms' separation says
whether any CIs could (`limited_by`).
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from hostsweep.model.evidence import Z95
from hostsweep.model.hostforms import FORM_CLASSES
from hostsweep.model.verdict import StartShift, drawn_start_shifts


def _best_mape(predicted: Mapping[str, np.ndarray], forms: Sequence[str], step: np.ndarray) -> np.ndarray:
    """Per row of `step` (draws × cells): the lowest MAPE (%) among `forms`."""
    return np.min(np.vstack([(np.abs(predicted[f] - step) / step).mean(axis=-1) * 100 for f in forms]), axis=0)


def noise_resolution(predicted_ms: Mapping[str, np.ndarray], step_ms: np.ndarray, ci_low_ms: np.ndarray,
                     ci_high_ms: np.ndarray, minuend: Sequence[str], subtrahend: Sequence[str], observed: float,
                     margin: float, label: str, resamples: int = 2000, seed: int = 0,
                     shift: Optional[StartShift] = None) -> dict[str, Any]:
    """What the cells' CIs (and a between-start `shift`) let d = MAPE(best of minuend) −
    MAPE(best of subtrahend) resolve, against the observed d; `label` names d in the sentence."""
    step = np.asarray(step_ms, float)
    half = (np.asarray(ci_high_ms, float) - np.asarray(ci_low_ms, float)) / 2 / step
    has_ci = np.isfinite(half)
    predicted = {f: np.asarray(predicted_ms[f], float) for f in (*minuend, *subtrahend)}
    best_a = min(minuend, key=lambda f: np.mean(np.abs(predicted[f] - step) / step))
    best_b = min(subtrahend, key=lambda f: np.mean(np.abs(predicted[f] - step) / step))
    separation = float(np.mean(np.abs(predicted[best_a] - predicted[best_b]) / step) * 100)
    out: dict[str, Any] = {"question": label, "cells": int(step.size), "cells_with_ci": int(has_ci.sum()),
                           "observed_points": float(observed), "margin_points": float(margin),
                           "separation_points": separation}
    if not has_ci.any():
        return out | {"resolvable": None, "limited_by": "unknown",
                      "sentence": "the cells carry no CIs: whether their noise could have resolved the "
                                  "question is unknown"}
    rng = np.random.default_rng(seed)
    sd = np.where(has_ci, half, 0.0) / Z95
    drawn = step * (1.0 + rng.standard_normal((resamples, step.size)) * sd)
    if shift is not None and shift.sd > 0:
        drawn = drawn * np.exp(drawn_start_shifts(rng, shift, resamples)[:, shift.start])
        out["start_shift_pct"] = 100 * math.expm1(shift.relative_sd)
    drawn = np.maximum(drawn, step * 1e-3)  # a step is positive; keeps a huge CI from dividing by ~0
    diffs = _best_mape(predicted, minuend, drawn) - _best_mape(predicted, subtrahend, drawn)
    low, high = np.percentile(diffs, [2.5, 97.5])
    noise = float((high - low) / 2)
    detectable = margin + noise
    resolvable = bool(abs(observed) >= detectable)
    out |= {"median_ci_half_width_pct": float(np.median(half[has_ci]) * 100), "noise_half_width_points": noise,
            "detectable_points": detectable, "resolvable": resolvable}
    out["limited_by"] = limited_by(out)
    return out | {"sentence": _sentence(out, label)}


def limited_by(r: Mapping[str, Any]) -> str:
    """What left the question open: the error's spread from cell to cell (the noise could
    have resolved the observed difference), the forms' separation (they differ by less
    than the margin: no CI could), the noise (the difference clears the margin, its noise
    does not), or a difference within the margin."""
    if r["resolvable"]:
        return "cell-to-cell spread"
    if r["separation_points"] <= r["margin_points"]:
        return "separation"
    return "noise" if abs(r["observed_points"]) > r["margin_points"] else "difference within margin"


def _sentence(r: Mapping[str, Any], label: str) -> str:
    ci, d = f"the cells' CIs (±{r['median_ci_half_width_pct']:.1f} % median)", abs(r["observed_points"])
    if r.get("start_shift_pct"):
        ci += f" with the machine's speed between engine starts ({r['start_shift_pct']:.1f} % SD)"
    noise = (f"their noise alone moves {label} by ±{r['noise_half_width_points']:.2f} points; with the "
             f"±{r['margin_points']:g}-point margin a difference above {r['detectable_points']:.2f} points resolves")
    reason = r["limited_by"]
    if reason == "cell-to-cell spread":
        return (f"{ci} could have resolved a MAPE difference of {d:.2f} points ({noise}): the error's spread from "
                "cell to cell, not the cells' noise, leaves the verdict inconclusive")
    head = f"{ci} could not resolve a MAPE difference of {d:.2f} points ({noise})"
    if reason == "separation":
        return (f"{head}, and no CIs could: the forms' predictions on these cells differ by "
                f"{r['separation_points']:.2f} points at most, inside the margin")
    if reason == "noise":
        return (f"{head}; the forms' predictions differ by up to {r['separation_points']:.2f} points, so narrower "
                "CIs (a quieter host, more reps or replicates) could")
    return (f"{head}; the observed difference is itself inside the margin (the forms' predictions differ by up to "
            f"{r['separation_points']:.2f} points)")


def family_forms(family: str) -> list[str]:
    return [form for form, name in FORM_CLASSES.items() if name == family]


def inconclusive_noise(evidence: Mapping[str, Any], predicted_ms: Mapping[str, np.ndarray], step_ms: np.ndarray,
                       ci_low_ms: np.ndarray, ci_high_ms: np.ndarray, margin: float, resamples: int = 2000,
                       seed: int = 0, shift: Optional[StartShift] = None) -> dict[str, Any] | None:
    """The noise statement for a group's inconclusive question (verdict.host_family_verdict's
    evidence): the families when they are not told apart, or the baseline when a
    k-invariant winner does not beat it; None for a conclusive or non-discriminating group."""
    if not evidence.get("discriminating"):
        return None
    if evidence["verdict"] == "inconclusive":
        sides, observed = (family_forms("k-scaling"), family_forms("k-invariant")), evidence["scaling_minus_invariant"]
        label = "MAPE(k-scaling) − MAPE(k-invariant)"
    elif evidence["verdict"] == "k-invariant" and not evidence["beats_baseline"]:
        sides, observed = (["baseline"], family_forms("k-invariant")), evidence["baseline_minus_winner"]
        label = "MAPE(baseline) − MAPE(winner)"
    else:
        return None
    return noise_resolution(predicted_ms, step_ms, ci_low_ms, ci_high_ms, *sides, observed["diff"], margin, label,
                            resamples, seed, shift)


def overall_noise(groups: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Across the compared held-out groups with a noise statement: in how many the cells'
    noise could not resolve the question (None when no group has a statement)."""
    stated = [g for g in groups if g.get("noise")]
    if not stated:
        return None
    unresolved = [f"{g['sku']} TP-{g['tp']}" for g in stated if g["noise"]["resolvable"] is False]
    unknown = [f"{g['sku']} TP-{g['tp']}" for g in stated if g["noise"]["resolvable"] is None]
    parts = [f"the cells' noise could not resolve the question in {len(unresolved)} of {len(stated)} "
             f"inconclusive held-out group(s)" + (f" ({', '.join(unresolved)})" if unresolved else "")]
    if unknown:
        parts.append(f"unknown in {', '.join(unknown)} (no CIs)")
    return {"groups": len(stated), "unresolved": unresolved, "unknown": unknown, "summary": "; ".join(parts)}
