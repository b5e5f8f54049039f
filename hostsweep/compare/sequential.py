"""Two studies measured apart (the sequential design, pure): each side's log step from its raw
pairs or logged CI, a one-start side widened by a between-start component, and where that
component came from."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import numpy as np
import pandas as pd

from hostsweep.compare import stats as S
from hostsweep.config.grid import engine_label
from hostsweep.compare.options import (GATED, HOST_FIXED, NO_BETWEEN, POINT, RAW, SUMMARY, DiffOptions, RawPairs,
                                       device_error, finite_value)
from hostsweep.compare.quantity import Compared
from hostsweep.measure.detectable import se_from_ci

def starts_of(raw: Optional[RawPairs]) -> Optional[list[np.ndarray]]:
    """A run's pairs as one array per engine start; None when it has fewer than 2 pairs."""
    if raw is None:
        return None
    groups = [np.asarray(raw, dtype=float)] if isinstance(raw, np.ndarray) and np.ndim(raw) == 1 else \
        [np.asarray(g, dtype=float) for g in raw]
    groups = [g[np.isfinite(g) & (g > 0)] for g in groups]
    groups = [g for g in groups if g.size]
    return groups if sum(g.size for g in groups) >= 2 and all(g.size >= 1 for g in groups) else None


@dataclass(frozen=True)
class Between:
    """The between-start component a one-start side is widened by, and where it came from."""

    var: float
    df: float
    source: str

    @property
    def known(self) -> bool:
        return math.isfinite(self.var)


def between_component(cells: pd.DataFrame, options: DiffOptions) -> Between:
    """A side's between-start component: the noise floor when stated (diff.noise_floor_pct,
    from a start-pairs A/A of this machine); else none (nan), and the diff's sequential cells
    with a one-start side are inconclusive. What the study shows of itself within one engine
    start (the spread between its periods, a replicate-first re-measure) is named in `source`
    as a lower bound only: minutes apart in one engine start it misses what a new start and an
    hour's drift change, and two quiet periods would put it near 0."""
    if options.noise_floor_pct is not None:
        return Between(math.log1p(options.noise_floor_pct / 100) ** 2, math.inf,
                       f"noise floor diff.noise_floor_pct={options.noise_floor_pct:g}")
    lower = within_start_spread(cells)
    return Between(math.nan, 0.0, "none" if lower is None else
                   f"none (within one engine start the study shows {lower:.1f}% between periods or re-measures: "
                   "a lower bound, not between-study evidence)")


def within_start_spread(cells: pd.DataFrame) -> Optional[float]:
    """The spread (SD, %) a side shows of itself within its engine starts: between the periods
    of re-measured groups and replicate-first re-measures, pooled with one df per engine group
    (the cells of a group share its periods' machine, so they are one observation); None when
    it shows none."""
    variances, dfs = [], []
    if "period_var" in cells and "period_df" in cells:
        v, d = S.pooled_per_group([engine_label(r) for r in cells.to_dict("records")],
                                  cells["period_var"].tolist(), cells["period_df"].tolist())
        variances, dfs = variances + [v], dfs + [d]
    if "replicate_step_ms" in cells and GATED in cells:
        v, d = S.replicate_component(cells[GATED].tolist(), cells["replicate_step_ms"].tolist())
        variances, dfs = variances + [v], dfs + [d]
    var, df = S.pooled(variances, dfs)
    return S.noise_floor_pct(var) if df else None


def step_side(row: Mapping[str, Any], groups: Optional[list[np.ndarray]], between: Between,
               level: float) -> Optional[tuple[S.LogEstimate, str]]:
    """One side's log step (raw pairs, else its logged CI), a one-start side widened. A
    one-start side is centred on the cell's own step_ms (what cells.csv and the table print),
    its variance from its pairs: the pairs may include periods or contended rounds the cell's
    estimate left out, and the ratio must be the one the reader can check."""
    if groups is not None:
        e = S.side_estimate(groups, level)
        own = finite_value(row, "step_ms")
        if e.starts == 1 and own is not None and own > 0:
            e = S.LogEstimate(math.log(own), e.var, e.df, e.starts, e.pairs)
    elif all(finite_value(row, n) and finite_value(row, n) > 0 for n in ("step_ms", "step_ci_low_ms", "step_ci_high_ms")):
        k = int(finite_value(row, "replicates") or 1)
        coverage = finite_value(row, "ci_coverage") or level
        se = se_from_ci(float(row["step_ms"]), float(row["step_ci_low_ms"]), float(row["step_ci_high_ms"]),
                        coverage, k - 1 if k > 1 else math.inf)
        e = S.LogEstimate(math.log(float(row["step_ms"])), se ** 2, k - 1.0 if k > 1 else math.inf, k, 0)
    else:
        return None
    if e.starts > 1:
        return e, f"{e.starts} starts"
    if not between.known:
        return e, f"one start, {NO_BETWEEN}"
    var, df = S.widen(np.array(e.var), np.array(e.df), between.var, between.df)
    return S.LogEstimate(e.est, float(var), float(df), 1, e.pairs), f"one start + {between.source}"


def host_side(e: S.LogEstimate, device_ms: Optional[float], device_var: float = 0.0,
              device_df: float = math.inf) -> Optional[S.LogEstimate]:
    """host = step - device_ms: its log and variance by the delta method, the step's error and
    device_ms's own (device_var, from the split's profiled pairs: options.device_error) added,
    Welch–Satterthwaite df."""
    step = math.exp(e.est)
    if device_ms is None or step - device_ms <= 0:
        return None
    host = step - device_ms
    parts = [e.var * step ** 2 / host ** 2, device_var / host ** 2]
    df = float(S.satterthwaite([np.array(v) for v in parts], [np.array(e.df), np.array(device_df)]))
    return S.LogEstimate(math.log(host), sum(parts), df, e.starts, e.pairs)



def sequential_compared(quantity: str, base: Mapping[str, Any], head: Mapping[str, Any],
                        groups: tuple[Optional[list[np.ndarray]], Optional[list[np.ndarray]]],
                        between: tuple[Between, Between], level: float) -> Compared:
    """One quantity of a cell whose sides were measured apart: step_ms from each side's raw
    pairs (else its logged CI), host_ms the same with each side's device_ms held fixed,
    anything else point only. A one-start side with no between-start component leaves the cell
    with a ratio and a note (NO_BETWEEN), no se: the verdict is inconclusive, never faster or
    slower, whatever the pairs of one engine start say."""
    both_raw = groups[0] is not None and groups[1] is not None
    if quantity in (GATED, "host_ms") and (both_raw or quantity == GATED):
        sides = [step_side(r, g if both_raw else None, w, level) for r, g, w in zip((base, head), groups, between)]
        if all(sides):
            (b, why_b), (h, why_h) = sides  # type: ignore[misc]
            source = RAW if both_raw else SUMMARY
            if quantity == "host_ms":
                b, h, source = host_side(b, finite_value(base, "device_ms"), *device_error(base)), \
                    host_side(h, finite_value(head, "device_ms"), *device_error(head)), HOST_FIXED
            if b is not None and h is not None:
                d, why = h.est - b.est, f"base: {why_b}; head: {why_h}"
                if NO_BETWEEN in why:
                    return Compared(math.exp(d), source, d, between=why, starts=(b.starts, h.starts), note=NO_BETWEEN)
                df = float(S.satterthwaite([np.array(b.var), np.array(h.var)], [np.array(b.df), np.array(h.df)]))
                widened = sum(w.var for w, e in zip(between, (b, h)) if e.starts == 1 and w.known)
                return Compared(math.exp(d), source, d, math.sqrt(b.var + h.var), df, why, (b.starts, h.starts),
                                between_var=widened)
    b_value, h_value = finite_value(base, quantity), finite_value(head, quantity)
    return Compared(h_value / b_value if b_value is not None and h_value is not None and b_value > 0
                    and h_value > 0 else math.nan, POINT)
