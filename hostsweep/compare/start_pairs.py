"""Paired engine starts (pure): side a's start i and side b's start i of one sweep were adjacent
in time, so a cell's log ratio is the mean over start pairs; the machine's between-start
noise floor those starts show; the geometric mean over start pairs."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Collection, Mapping, Optional, Sequence

import numpy as np
import pandas as pd

from hostsweep.compare import stats as S
from hostsweep.config.grid import engine_label
from hostsweep.compare.floors import floor_text
from hostsweep.compare.options import GATED, PAIRED, PAIRED_HOST, POINT, RawPairs
from hostsweep.compare.options import device_error, finite_value
from hostsweep.compare.quantity import Compared, paired_sides
from hostsweep.compare.sequential import starts_of

def paired_starts(base: Mapping[str, Any], head: Mapping[str, Any],
                  groups: tuple[Optional[list[np.ndarray]], Optional[list[np.ndarray]]]) -> int:
    """k when the matched cell is paired: the base row is side a and the head row side b of one
    sweep (equal parent_run_id), both with raw pairs in the same k >= 2 engine starts; else 0."""
    if not paired_sides(base, head) or groups[0] is None or groups[1] is None:
        return 0
    k = len(groups[0])
    return k if k >= 2 and len(groups[1]) == k else 0


def start_pairs_compared(quantity: str, base: Mapping[str, Any], head: Mapping[str, Any], groups: tuple[list[np.ndarray], ...],
            k: int) -> Compared:
    """One quantity of a paired cell: step_ms and host_ms from the start pairs' medians (host
    with each side's device_ms subtracted, its own error added once: it is one number per
    side, the same in every start pair, so the start pairs' spread cannot hold it), anything
    else point only."""
    if quantity in (GATED, "host_ms"):
        medians = [np.array([np.median(g) for g in side]) for side in groups]
        source = PAIRED
        if quantity == "host_ms":
            device = finite_value(base, "device_ms"), finite_value(head, "device_ms")
            medians = [m - dev if dev is not None else m * math.nan for m, dev in zip(medians, device)]
            source = PAIRED_HOST
        if all(np.isfinite(m).all() and (m > 0).all() for m in medians):
            d, se, df = S.paired_log_ratio(medians[0], medians[1])
            if quantity == "host_ms":
                errors = [device_error(row) for row in (base, head)]
                parts = [v / float(np.mean(m)) ** 2 for (v, _), m in zip(errors, medians)]
                df = S.satterthwaite([np.array(se ** 2), *map(np.array, parts)],
                                     [np.array(df), *(np.array(f) for _, f in errors)])
                se = np.sqrt(se ** 2 + sum(parts))
            return Compared(math.exp(float(d)), source, float(d), float(se), float(df), f"paired: {k} start pairs",
                            (k, k), "paired", tuple(float(x) for x in np.log(medians[1]) - np.log(medians[0])))
    b, h = finite_value(base, quantity), finite_value(head, quantity)
    return Compared(h / b if b is not None and h is not None and b > 0 and h > 0 else math.nan, POINT,
                    design="paired")


@dataclass(frozen=True)
class NoiseFloor:
    """The between-start spread of a paired diff: the log start medians' variance of each side
    of each paired cell, averaged over the cells of an engine group and pooled over groups and
    sides (df = k - 1 per group and side: a group's cells share its engine starts)."""

    var: float
    df: float
    cells: int

    @property
    def pct(self) -> float:
        return S.noise_floor_pct(self.var)


def paired_noise_floor(pairs: Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]], raw: Mapping[str, RawPairs],
                       by_rounds: Collection[str] = ()) -> Optional[NoiseFloor]:
    """The machine's between-start spread from the cells paired by start pairs, flagged ones
    included (what flagged them is the machine's noise too: leaving them out would state a
    floor lower than the machine's, and a low floor lets a sequential gate's false alarms
    through); None when none is. Cells judged by paired rounds (base run ids in by_rounds)
    have each side started once: no spread between starts to state. Degrees of freedom are
    counted per engine group, not per cell."""
    # per engine group and side: the cells' start-median spreads, the starts' k - 1 df counted
    # once (S.pooled_per_group)
    keys, variances, dfs = [], [], []
    cells = 0
    for b, h in pairs:
        if str(b.get("run_id")) in by_rounds:
            continue
        groups = starts_of(raw.get(str(b.get("run_id")))), starts_of(raw.get(str(h.get("run_id"))))
        if not paired_starts(b, h, groups):
            continue
        cells += 1
        for i, side in enumerate(groups):
            var, df = S.start_spread(np.array([np.median(g) for g in side]))  # type: ignore[union-attr]
            keys.append((engine_label(b), i))
            variances.append(float(var))
            dfs.append(float(df))
    var, df = S.pooled_per_group(keys, variances, dfs)
    return NoiseFloor(var, df, cells) if df else None


def paired_geometric_mean(rows: pd.DataFrame, level: float) -> Optional[tuple[float, float, float]]:
    """The geometric mean of paired cells' ratios with its CI over the start pairs: the cells of
    one start pair met the same machine, so their errors are not independent; per start pair
    the mean log ratio over the cells, then a t-interval over the k start pairs (k - 1 df).
    None unless every row is paired with the same k >= 2."""
    if rows.empty or not (rows["design"] == "paired").all():
        return None
    starts = [[float(x) for x in str(v).split()] for v in rows["d_starts"]]
    k = len(starts[0])
    if k < 2 or any(len(d) != k for d in starts):
        return None
    per_pair = np.array(starts).mean(axis=0)
    low, high = S.ci(np.array(per_pair.mean()), np.array(per_pair.std(ddof=1) / math.sqrt(k)), np.array(k - 1.0),
                     level)
    return float(np.exp(per_pair.mean())), float(low), float(high)

