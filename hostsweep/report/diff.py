"""Two sides of measured cells compared cell by cell (pure): what differs between them,
which cells match, and per matched cell and quantity the ratio head/base with a bootstrap
CI from both cells' raw timed pairs and a verdict. What `stage=diff` computes.

The rules, in one place:
- A cell dimension (a cell param: sku, mode, engine_args, batch...) that holds one value on
  each side, a different one on each, is *what differs*: it is left out of the matching.
  Every other cell dimension is matched on, so cells the other side lacks stay unmatched.
  Provenance (versions, git SHA, device, host) is never matched on, only reported.
- step_ms: the ratio of the two medians of the timed pairs, its CI the percentile
  bootstrap of that ratio, each side resampled on its own (they are independent runs).
  host_ms: the same draws less each cell's device_ms, held fixed (the split has no raw
  pairs). Other quantities: the point ratio only, with no verdict.
- Verdict, with t = threshold_pct/100: `slower` when the CI lies above 1 and the ratio
  above 1+t, `faster` when it lies below 1 and the ratio below 1−t, `same` when the whole
  CI lies inside [1−t, 1+t], else `inconclusive`.
- A cell flagged stable=false on either side keeps its verdict but is counted apart, and
  never gates.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import pandas as pd

from hostsweep.report.diff_match import (  # noqa: F401 - re-exported: the rules live in one place for readers
    CELL_DIMS, PROVENANCE_DIMS, Difference, cell_label, dimensions, match_cells, text,
)

VERDICTS = ("faster", "slower", "same", "inconclusive")
FAIL_ON = ("slower", "inconclusive")
GATED = "step_ms"  # the quantity fail_on judges: the one with raw pairs on both sides
RAW, SUMMARY, HOST_FIXED, POINT = ("raw pairs", "summary CIs (approximate: no raw_timings.csv)",
                                   "step pairs, device_ms held fixed", "point only (no raw pairs)")


@dataclass(frozen=True)
class DiffOptions:
    threshold_pct: float = 5.0
    quantities: tuple[str, ...] = ("step_ms", "device_ms", "host_ms")
    resamples: int = 2000
    level: float = 0.95
    seed: int = 0
    fail_on: Optional[str] = None

    def check(self) -> None:
        """ValueError naming the field (the stage makes it a one-line ConfigError)."""
        if not 0 < self.threshold_pct < 100:
            raise ValueError(f"threshold_pct must be in (0, 100), got {self.threshold_pct}")
        if self.resamples < 100:
            raise ValueError(f"resamples must be >= 100, got {self.resamples}")
        if not 0.5 <= self.level < 1:
            raise ValueError(f"ci_level must be in [0.5, 1), got {self.level}")
        if not self.quantities:
            raise ValueError("quantities must name at least one metric, e.g. [step_ms]")
        if self.fail_on is not None and self.fail_on not in FAIL_ON:
            raise ValueError(f"fail_on={self.fail_on!r} is not allowed; allowed: null, {', '.join(FAIL_ON)}")


def median_draws(values: np.ndarray, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """Bootstrap medians of `values` (vectorized over resamples)."""
    index = rng.integers(0, values.size, size=(resamples, values.size))
    return np.median(values[index], axis=1)


def _positive_ratio(head: np.ndarray, base: np.ndarray) -> np.ndarray:
    ok = (base > 0) & (head > 0)
    return np.where(ok, head / np.where(ok, base, 1.0), np.nan)


def ratio_from_pairs(base: np.ndarray, head: np.ndarray, resamples: int, rng: np.random.Generator,
                     base_shift: float = 0.0, head_shift: float = 0.0) -> tuple[float, np.ndarray]:
    """(median(head) − head_shift) / (median(base) − base_shift) and its bootstrap draws."""
    point = _positive_ratio(np.array([np.median(head) - head_shift]), np.array([np.median(base) - base_shift]))[0]
    draws = _positive_ratio(median_draws(head, resamples, rng) - head_shift,
                            median_draws(base, resamples, rng) - base_shift)
    return float(point), draws


def ratio_from_summaries(base: tuple[float, float, float], head: tuple[float, float, float], resamples: int,
                         level: float, rng: np.random.Generator) -> tuple[float, np.ndarray]:
    """Ratio draws from each side's (median, CI low, CI high) read as log-normal: the
    fallback for cells logged without raw_timings.csv."""
    z = _z(level)
    spread = [(math.log(hi) - math.log(lo)) / (2 * z) for _, lo, hi in (base, head)]
    point = head[0] / base[0]
    return point, point * np.exp(rng.normal(0.0, math.hypot(*spread), size=resamples))


def _z(level: float) -> float:
    from statistics import NormalDist

    return NormalDist().inv_cdf(0.5 + level / 2)


def interval(draws: np.ndarray, level: float) -> tuple[float, float]:
    """Percentile interval of the draws; NaN when under 90% of them are usable ratios."""
    finite = draws[np.isfinite(draws)]
    if draws.size == 0 or finite.size < 0.9 * draws.size:
        return math.nan, math.nan
    tail = (1.0 - level) / 2.0 * 100.0
    low, high = np.percentile(finite, [tail, 100.0 - tail])
    return float(low), float(high)


def verdict(ratio: float, low: float, high: float, threshold_pct: float) -> str:
    """faster, slower, same (the CI inside ±threshold) or inconclusive."""
    t = threshold_pct / 100.0
    if not all(math.isfinite(v) for v in (ratio, low, high)):
        return "inconclusive"
    if low > 1.0 and ratio > 1.0 + t:
        return "slower"
    if high < 1.0 and ratio < 1.0 - t:
        return "faster"
    if low >= 1.0 - t and high <= 1.0 + t:
        return "same"
    return "inconclusive"


def stable_flag(value: Any) -> Optional[bool]:
    """A cell's `stable` tag, param or metric as True/False; None when the cell has none."""
    word = text(value).strip().lower()
    if word in ("false", "0", "no"):
        return False
    if word in ("true", "1", "yes"):
        return True
    return None


def _finite(row: Mapping[str, Any], name: str) -> Optional[float]:
    try:
        value = float(row.get(name))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class Compared:
    """One quantity of one matched cell."""

    ratio: float
    low: float
    high: float
    source: str
    verdict: Optional[str]  # None: no CI, so no verdict
    draws: Optional[np.ndarray] = None


def compare_quantity(quantity: str, base: Mapping[str, Any], head: Mapping[str, Any], raw_base: Optional[np.ndarray],
                     raw_head: Optional[np.ndarray], options: DiffOptions, rng: np.random.Generator) -> Compared:
    """The ratio head/base of one quantity of a matched cell, its CI and its verdict."""
    paired = raw_base is not None and raw_head is not None and raw_base.size >= 2 and raw_head.size >= 2
    draws, source = None, POINT
    if quantity == "step_ms" and paired:
        ratio, draws = ratio_from_pairs(raw_base, raw_head, options.resamples, rng)
        source = RAW
    elif quantity == "step_ms" and all(_finite(r, n) for r in (base, head)
                                       for n in ("step_ms", "step_ci_low_ms", "step_ci_high_ms")):
        ratio, draws = ratio_from_summaries(*(tuple(float(r[n]) for n in ("step_ms", "step_ci_low_ms",
                                                                            "step_ci_high_ms")) for r in (base, head)),
                                            options.resamples, options.level, rng)
        source = SUMMARY
    elif quantity == "host_ms" and paired and _finite(base, "device_ms") and _finite(head, "device_ms"):
        ratio, draws = ratio_from_pairs(raw_base, raw_head, options.resamples, rng,
                                        float(base["device_ms"]), float(head["device_ms"]))
        source = HOST_FIXED
    else:
        b, h = _finite(base, quantity), _finite(head, quantity)
        ratio = h / b if b is not None and h is not None and b > 0 and h > 0 else math.nan
    if draws is None:
        return Compared(ratio, math.nan, math.nan, source, None)
    low, high = interval(draws, options.level)
    return Compared(ratio, low, high, source, verdict(ratio, low, high, options.threshold_pct), draws)


@dataclass
class DiffResult:
    options: DiffOptions
    matched_on: list[str]
    differs: list[Difference]
    shared: dict[str, str]  # provenance both sides share
    label_dims: list[str]  # the matching dims that vary across matched cells (labels, groups)
    cells: pd.DataFrame  # one row per (matched cell, quantity)
    unmatched: pd.DataFrame
    summary: dict[str, dict[str, Any]] = field(default_factory=dict)  # per quantity
    warnings: list[str] = field(default_factory=list)

    def failing(self) -> pd.DataFrame:
        """The GATED rows fail_on fails on. slower: stable cells judged slower. inconclusive:
        every cell not shown stable and same or faster (unstable cells are inconclusive)."""
        rows = self.cells[self.cells["quantity"] == GATED] if len(self.cells) else self.cells
        if self.options.fail_on is None or rows.empty:
            return rows.iloc[0:0]
        if self.options.fail_on == "slower":
            return rows[~rows["unstable"] & (rows["verdict"] == "slower")]
        return rows[rows["unstable"] | ~rows["verdict"].isin(("same", "faster"))]

    def gate(self) -> tuple[bool, str]:
        """(failed, why) under fail_on. A gate with no stable cell to judge fails: a release
        must not pass on no evidence."""
        if self.options.fail_on is None:
            return False, ""
        rows = self.cells[self.cells["quantity"] == GATED] if len(self.cells) else self.cells
        unstable = rows[rows["unstable"]] if len(rows) else rows
        note = (f"; {len(unstable)} unstable cell(s) not judged ({int((unstable['verdict'] == 'slower').sum())} "
                "measured slower: measure them again on a quiet machine)" if len(unstable) else "")
        failing, t = self.failing(), self.options.threshold_pct
        if len(failing):
            return True, (f"{len(failing)} cell(s) {self.options.fail_on} (±{t:g}%): "
                          f"{', '.join(failing['cell'])}{note}")
        judged = len(rows) - len(unstable)
        if not judged:
            return True, f"no stable matched cell to judge{note}"
        return False, f"{judged} stable cell(s) judged, none {self.options.fail_on} (±{t:g}%){note}"


def _cell_rows(pairs: list[tuple[dict, dict]], raw: Mapping[str, np.ndarray], label_dims: Sequence[str],
               options: DiffOptions) -> tuple[list[dict[str, Any]], dict[str, list[np.ndarray]]]:
    rows: list[dict[str, Any]] = []
    draws: dict[str, list[np.ndarray]] = {q: [] for q in options.quantities}
    for i, (b, h) in enumerate(pairs):
        flags = (stable_flag(b.get("stable")), stable_flag(h.get("stable")))
        unstable = False in flags
        for j, quantity in enumerate(options.quantities):
            if _finite(b, quantity) is None and _finite(h, quantity) is None:
                continue  # neither cell has it (no split, no phases)
            rng = np.random.default_rng([options.seed, i, j])
            c = compare_quantity(quantity, b, h, raw.get(str(b.get("run_id"))), raw.get(str(h.get("run_id"))),
                                 options, rng)
            rows.append({"cell": cell_label(b, label_dims), "quantity": quantity, "base": _finite(b, quantity),
                         "head": _finite(h, quantity), "ratio": c.ratio, "ci_low": c.low, "ci_high": c.high,
                         "verdict": c.verdict, "ci_source": c.source, "unstable": unstable,
                         "stable_flag": "unknown" if flags == (None, None) else "present",
                         "base_run": b.get("run_id"), "head_run": h.get("run_id"),
                         **{d: b.get(d) for d in label_dims}})
            if c.draws is not None and not unstable and np.isfinite(c.draws).mean() >= 0.9:
                draws[quantity].append(c.draws)
    return rows, draws


def geometric_mean(points: Sequence[float], draws: list[np.ndarray], level: float) -> tuple[float, float, float]:
    """The geometric mean of the cells' ratios, its CI from the per-cell bootstrap draws
    taken together resample by resample (the cells are fixed; their noise is resampled)."""
    finite = np.array([p for p in points if p > 0 and math.isfinite(p)])
    point = float(np.exp(np.log(finite).mean())) if finite.size else math.nan
    if not draws:
        return point, math.nan, math.nan
    low, high = interval(np.exp(np.nanmean(np.log(np.vstack(draws)), axis=0)), level)
    return point, low, high


def _summary(rows: pd.DataFrame, draws: dict[str, list[np.ndarray]], options: DiffOptions) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for quantity in options.quantities:
        mine = rows[rows["quantity"] == quantity] if len(rows) else rows
        if mine.empty:
            continue
        stable = mine[~mine["unstable"]]
        with_ci = stable[stable["ci_low"].notna()] if draws[quantity] else stable
        gm, low, high = geometric_mean(with_ci["ratio"].tolist(), draws[quantity], options.level)
        counts = {v: int((stable["verdict"] == v).sum()) for v in VERDICTS}
        everything = mine["ratio"][mine["ratio"] > 0].dropna()
        out[quantity] = {"geomean_ratio": gm, "ci_low": low, "ci_high": high, "cells": int(len(mine)),
                         "geomean_ratio_all": float(np.exp(np.log(everything).mean())) if len(everything) else math.nan,
                         "cells_in_geomean": int(with_ci["ratio"].gt(0).sum()),
                         "ci_source": ", ".join(sorted(set(mine["ci_source"]))), "counts": counts,
                         "no_verdict": int(stable["verdict"].isna().sum()),
                         "unstable": int(mine["unstable"].sum()),
                         "unstable_counts": {v: int((mine[mine["unstable"]]["verdict"] == v).sum()) for v in VERDICTS}}
    return out


def diff(base: pd.DataFrame, head: pd.DataFrame, raw: Mapping[str, np.ndarray], options: DiffOptions) -> DiffResult:
    """Compare two sides' cells (one row per cell: its params, metrics, provenance tags,
    run_id and an optional `stable`); `raw` holds each run's timed step_ms pairs."""
    matched_on, differs, shared = dimensions(base, head)
    pairs, unmatched, warnings = match_cells(base, head, matched_on)
    label_dims = [d for d in matched_on if len({text(b.get(d)) for b, _ in pairs}) > 1] or \
        [d for d in ("batch", "ctx") if d in matched_on]  # one cell: still named b1-ctx128
    rows, draws = _cell_rows(pairs, raw, label_dims, options)
    columns = ["cell", "quantity", "base", "head", "ratio", "ci_low", "ci_high", "verdict", "ci_source", "unstable",
               "stable_flag", "base_run", "head_run", *label_dims]
    cells = pd.DataFrame(rows, columns=columns)
    if not pairs:
        warnings.append("no cell of one side matches a cell of the other on " + (", ".join(matched_on) or "anything"))
    result = DiffResult(options, matched_on, differs, shared, label_dims, cells, unmatched, warnings=warnings)
    result.summary = _summary(cells, draws, options)
    return result
