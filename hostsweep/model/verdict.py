"""Verdicts with evidence: is the host term k-invariant or k-scaling, judged on one
held-out (SKU, TP) group at a time with a paired bootstrap (pure, vectorized).

The rule, per group whose TP degree was not trained on:
    d = MAPE(best k-scaling form) − MAPE(best k-invariant form), both on the same cells;
    the best form of each family is re-chosen in every resample, so picking it on these
    cells is part of what the interval covers.
    d's 95% CI above +margin → "k-invariant"; below −margin → "k-scaling"; else "inconclusive".
The winner (the best form of the winning family, or of all forms when inconclusive)
beats the baseline only if MAPE(baseline) − MAPE(winner) has its CI above +margin.
A group at a training TP degree cannot separate the families (C, C·k and C/k are the
same function there) and is reported as inconclusive for that reason.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np
from scipy.stats import binom

from hostsweep.model.fit import ape as percentage_errors
from hostsweep.model.hostforms import FORM_CLASSES

FAMILIES = ("k-invariant", "k-scaling")
# A bootstrap over fewer cells has no interval to speak of: one cell resamples to itself (a
# zero-width "CI" that clears any margin), two to three values.
MIN_CELLS_FOR_A_FAMILY = 3


@dataclass(frozen=True)
class StartShift:
    """The machine's speed between engine starts, which a group's cells share and resampling
    its cells cannot show. The held-out cells were measured in other engine starts, at other
    times, than the training cells their predictions come from: each held-out start's cells
    move together by e^d, d ~ N(0, sd²), against the training starts' mean shift e^t,
    t ~ N(0, sd² / training_starts), which every held-out start shares. `sd` is the log of
    1 + fit.start_floor_pct / 100 (the SD between engine starts a paired A/A states)."""

    predicted: Mapping[str, np.ndarray]  # per form, the group's cells, ms
    measured: np.ndarray  # step_ms of the same cells
    start: np.ndarray  # each cell's engine start, 0 .. starts - 1
    sd: float
    training_starts: int

    @property
    def relative_sd(self) -> float:
        return relative_shift_sd(self.sd, self.training_starts)


def relative_shift_sd(sd: float, training_starts: int) -> float:
    """SD of one held-out start's log shift against the training starts' mean: its own, and
    the mean of `training_starts` others."""
    return sd * math.sqrt(1.0 + 1.0 / max(1, training_starts))


def drawn_start_shifts(rng: np.random.Generator, shift: StartShift, draws: int) -> np.ndarray:
    """(draws × starts) log shifts of the held-out engine starts against the training starts'
    mean: each start its own, less the training mean every start shares."""
    own = rng.normal(0.0, shift.sd, size=(draws, int(shift.start.max()) + 1))
    return own - rng.normal(0.0, shift.sd / math.sqrt(max(1, shift.training_starts)), size=(draws, 1))


def start_shift_sd(floor_pct: Optional[float]) -> float:
    """fit.start_floor_pct (SD in %, null: none) as the SD of the log step."""
    return math.log1p(floor_pct / 100.0) if floor_pct else 0.0


def resampled_mapes(ape: Mapping[str, np.ndarray], resamples: int, seed: int,
                    max_draws: int = 4_000_000, shift: Optional[StartShift] = None) -> dict[str, np.ndarray]:
    """Each form's mean APE over the same bootstrap resamples of the group's cells (paired),
    drawn in chunks of at most `max_draws` indices so a large group stays in memory. With a
    `shift`, every resample also moves each engine start's measured steps by its own drawn
    shift (StartShift) and scores each form's predictions against them."""
    n = len(next(iter(ape.values())))
    rng = np.random.default_rng(seed)
    chunk = max(1, max_draws // n)
    parts: dict[str, list[np.ndarray]] = {form: [] for form in ape}
    for start in range(0, resamples, chunk):
        size = min(chunk, resamples - start)
        index = rng.integers(0, n, size=(size, n))
        if shift is None:
            for form, errors in ape.items():
                parts[form].append(np.asarray(errors, float)[index].mean(axis=1))
            continue
        moved = shift.measured[index] * np.exp(np.take_along_axis(drawn_start_shifts(rng, shift, size),
                                                                   shift.start[index], axis=1))
        for form in ape:
            parts[form].append(percentage_errors(np.asarray(shift.predicted[form], float)[index], moved).mean(axis=1))
    return {form: np.concatenate(chunks) for form, chunks in parts.items()}


def _best(mapes: Mapping[str, np.ndarray], forms: list[str]) -> np.ndarray:
    return np.min(np.vstack([mapes[f] for f in forms]), axis=0)


def _interval(point: float, draws: np.ndarray) -> dict[str, float]:
    low, high = np.percentile(draws, [2.5, 97.5])
    return {"diff": float(point), "ci_low": float(low), "ci_high": float(high)}


def _decide(evidence: dict[str, float], margin: float) -> str:
    if evidence["ci_low"] > margin:
        return "k-invariant"
    if evidence["ci_high"] < -margin:
        return "k-scaling"
    return "inconclusive"


def host_family_verdict(ape: Mapping[str, np.ndarray], discriminating: bool, resamples: int = 2000,
                        seed: int = 0, margin: float = 1.0, shift: Optional[StartShift] = None) -> dict[str, Any]:
    """The verdict on one held-out group from each form's per-cell APE (percent); with a
    `shift`, its interval also holds the machine's speed between engine starts."""
    point = {form: float(np.mean(errors)) for form, errors in ape.items()}
    shift = shift if shift is not None and shift.sd > 0 else None
    draws = resampled_mapes(ape, resamples, seed, shift=shift)
    family = {name: [f for f in ape if FORM_CLASSES[f] == name] for name in FAMILIES}
    best = {name: min(forms, key=point.get) for name, forms in family.items()}
    spread = _interval(point[best["k-scaling"]] - point[best["k-invariant"]],
                       _best(draws, family["k-scaling"]) - _best(draws, family["k-invariant"]))
    cells = len(next(iter(ape.values())))
    verdict = _decide(spread, margin) if discriminating and cells >= MIN_CELLS_FOR_A_FAMILY else "inconclusive"
    if not discriminating:
        reason = "a training TP degree: every host family predicts the same term here"
    elif cells < MIN_CELLS_FOR_A_FAMILY:
        reason = (f"{cells} in-regime cell(s): a bootstrap over fewer than {MIN_CELLS_FOR_A_FAMILY} cells gives no "
                  f"interval (MAPE(k-scaling) − MAPE(k-invariant) = {spread['diff']:.2f} points, untested)")
    elif verdict == "inconclusive":
        reason = f"CI of MAPE(k-scaling) − MAPE(k-invariant) [{spread['ci_low']:.2f}, {spread['ci_high']:.2f}] " \
                 f"does not clear ±{margin:g} points"
    else:
        reason = f"CI of MAPE(k-scaling) − MAPE(k-invariant) [{spread['ci_low']:.2f}, {spread['ci_high']:.2f}] " \
                 f"clears ±{margin:g} points"
    # What the interval holds: the cells' spread only, or also the speed between engine starts.
    between = (f"{100 * math.expm1(shift.relative_sd):.1f} % between the held-out and the training engine starts "
               "(fit.start_floor_pct)" if shift is not None else None)
    if discriminating and cells >= MIN_CELLS_FOR_A_FAMILY:
        reason += (f"; the interval holds the cells' spread and the machine's speed, {between}" if between else
                   "; the interval holds the cells' spread only, not the machine's speed between engine starts "
                   "(fit.start_floor_pct: null)")
    pool = family[verdict] if verdict in FAMILIES else family["k-invariant"] + family["k-scaling"]
    winner = min(pool, key=point.get)
    versus = _interval(point["baseline"] - point[winner], draws["baseline"] - _best(draws, pool))
    return {
        "verdict": verdict, "reason": reason, "discriminating": discriminating,
        "best_k_invariant": best["k-invariant"], "best_k_scaling": best["k-scaling"],
        "scaling_minus_invariant": spread, "winner": winner,
        "baseline_minus_winner": versus, "beats_baseline": versus["ci_low"] > margin,
        "start_shift_pct": None if shift is None else 100 * math.expm1(shift.relative_sd),
    }


def overall_verdict(groups: list[dict[str, Any]], falsified: Sequence[tuple[str, int]] = ()) -> dict[str, Any]:
    """One answer across the held-out groups the comparison kept (the `falsified` ones, named
    as (sku, tp), are out): the family every conclusive group names, or inconclusive when
    none is conclusive or they disagree."""
    named = {(g["sku"], g["tp"]): g["verdict"] for g in groups if g["verdict"] in FAMILIES}
    families = sorted(set(named.values()))
    if len(families) == 1:
        supporting = ", ".join(f"{sku} TP-{tp}" for sku, tp in sorted(named))
        return {"verdict": families[0], "reason": f"held-out groups {supporting} say {families[0]}"}
    if families:
        split = "; ".join(f"{sku} TP-{tp}: {v}" for (sku, tp), v in sorted(named.items()))
        return {"verdict": "inconclusive", "reason": f"held-out groups disagree ({split})"}
    if groups:
        return {"verdict": "inconclusive", "reason": "no held-out group separates the families with its CI"}
    if falsified:
        named_out = ", ".join(f"{sku} TP-{tp}" for sku, tp in falsified)
        return {"verdict": "inconclusive", "reason": f"the held-out groups at an untrained TP degree ({named_out}) were "
                                                     "falsified: no host-term family is compared on cells the bound "
                                                     "already rules out"}
    return {"verdict": "inconclusive", "reason": "no held-out group at an untrained TP degree is left to compare"}


def falsifying_threshold(cells: int, with_ci: bool, level: float = 0.05, per_cell: float = 0.025) -> int:
    """How many falsifying cells make a group falsified. A cell's 95% CI lies wholly below
    a bound the truth sits on with probability 2.5%, so among n CI-judged cells some will
    by chance: the group is falsified only when the count is improbable at `level`
    (one-sided binomial). Point values carry no such rate: one cell is enough."""
    if not with_ci or cells == 0:
        return 1
    # the smallest k with P(X >= k) <= level, X ~ Binomial(cells, per_cell)
    return int(binom.isf(level, cells, per_cell)) + 1
