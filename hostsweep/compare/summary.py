"""A diff summed up (pure): how its cells were measured in one line, and per quantity the
geometric mean of the ratios with its CI and the verdict counts."""
from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence

import numpy as np
import pandas as pd

from scipy import stats

from hostsweep.compare import rules as R
from hostsweep.compare import stats as S
from hostsweep.compare.options import GATED, NO_BETWEEN, POINT, VERDICTS, DiffOptions, by_rounds
from hostsweep.compare.rounds import rounds_geometric_mean, widened
from hostsweep.compare.start_pairs import paired_geometric_mean
from hostsweep.measure.detectable import mde_from_se

def _counts_text(values: Sequence[int]) -> str:
    """Per-cell counts as 3, 3/5, or 22–24 when more than three differ."""
    distinct = sorted({int(v) for v in values})
    return "/".join(map(str, distinct)) if len(distinct) <= 3 else f"{distinct[0]}–{distinct[-1]}"


def _one_start_text(sources: Sequence[str]) -> str:
    """What the one-start sides of a sequential diff rest on: the between-start component they
    were widened by, or none (no verdict), with the lower bound the study showed of itself."""
    parts = []
    known = [w for w in sources if not w.startswith("none")]
    if known:
        parts.append(f"one-start sides widened by {' / '.join(known)}")
    bounds = [w[len("none ("):-1] for w in sources if w.startswith("none (")]
    if len(known) < len(sources):
        parts.append(f"one-start sides with {NO_BETWEEN}: no verdict" + (f" ({'; '.join(bounds)})" if bounds else ""))
    return "; ".join(parts)


def comparison_design(cells: pd.DataFrame, between: Mapping[str, str]) -> str:
    """How the compared cells were measured, in one line: paired (k start pairs, ABBA in one
    sweep; or N rounds, the sides timed back to back in each), sequential (two studies measured
    apart, and what widens a one-start side), or how many of each."""
    rows = cells[cells["quantity"] == GATED] if len(cells) else cells
    if rows.empty:
        return "no matched cell"
    timed_in_rounds = by_rounds(rows)
    rounds, paired = rows[timed_in_rounds], rows[(rows["design"] == "paired") & ~timed_in_rounds]
    sequential = rows[rows["design"] != "paired"]
    rounds_text = f"{_counts_text(rounds['rounds'])} rounds per cell, sides timed back to back in each round " \
        "(paired rounds)" if len(rounds) else ""
    paired_text = f"{_counts_text(paired['starts_base'])} start pairs per cell, sides alternated ABBA in one sweep"
    tested = sequential[sequential["ci_source"] != POINT]
    one = {name for name, column in (("base", "starts_base"), ("head", "starts_head")) if (tested[column] <= 1).any()}
    if tested.empty:
        seq_text = "two studies measured apart; no CI (no raw pairs or logged CIs)"
    elif one:
        sources = sorted({between.get(name, "none") for name in one})
        seq_text = "two studies measured apart; " + _one_start_text(sources)
    else:
        starts = sorted({int(k) for k in pd.concat([tested["starts_base"], tested["starts_head"]])})
        seq_text = f"two studies measured apart; each side's CI from its own {'/'.join(map(str, starts))} engine starts"
    kinds = [(len(rounds), f"paired by rounds ({rounds_text})"),
             (len(paired), f"paired{' by start pairs' if len(rounds) else ''} ({paired_text})"),
             (len(sequential), f"sequential ({seq_text})")]
    present = [(n, what) for n, what in kinds if n]
    if len(present) > 1:
        return "mixed: " + ", ".join(f"{n} {'cell(s) ' if i == 0 else ''}{what}" for i, (n, what) in enumerate(present))
    if len(rounds):
        return f"paired: {rounds_text}"
    if sequential.empty:
        return f"paired: {paired_text}"
    return f"sequential: {seq_text}"


def geometric_mean(d: np.ndarray, se: np.ndarray, df: np.ndarray, level: float,
                   between_var: Optional[np.ndarray] = None) -> tuple[float, float, float]:
    """The geometric mean of the cells' ratios and its CI: the mean log-ratio; its variance the
    cells' own (within-start) variances over m^2, as independent, plus the between-start
    variance the sides were widened by, once: a noise floor is one shift of a whole study, shared
    by its cells, which averaging over cells does not shrink (dividing it by m would leave a
    100-cell CI about 10x too narrow). Welch–Satterthwaite df."""
    keep = np.isfinite(d)
    if not keep.any():
        return math.nan, math.nan, math.nan
    shared_all = np.zeros_like(d, dtype=float) if between_var is None else np.nan_to_num(np.asarray(between_var, float))
    d, se, df, shared = d[keep], se[keep], df[keep], shared_all[keep]
    point = float(np.exp(d.mean()))
    if not np.isfinite(se).all():
        return point, math.nan, math.nan
    m = d.size
    within = np.clip(se ** 2 - shared, 0.0, None) / m ** 2
    common = float(shared.max()) if m else 0.0
    variance = float(within.sum()) + common
    low, high = S.ci(np.array(d.mean()), np.array(math.sqrt(variance)),
                     S.satterthwaite([*within, np.array(common)], [*df, np.array(math.inf)]), level)
    return point, float(low), float(high)


def widened_by_instances(mean: tuple[float, float, float, float], options: DiffOptions,
                         engines: Optional[Sequence[str]] = None, level: Optional[float] = None
                         ) -> tuple[float, float, float, float]:
    """A rounds geometric mean (ratio, low, high, coverage) with the instance floor added once
    per engine group (rounds.widened): every cell of a group ran on its side's one instance,
    so averaging over the group's cells leaves that instance effect whole, while the groups'
    instances are independent: the mean carries instance_var × Σ (share of the cells in
    group g)², the whole floor for one group. `engines`: each cell's engine group (none: one)."""
    ratio, low, high, _ = mean
    shares = pd.Series(list(engines)).value_counts(normalize=True) if engines is not None and len(engines) else None
    var = options.instance_var * (float((shares ** 2).sum()) if shares is not None else 1.0)
    level = options.level if level is None else level
    log_low, log_high = widened(math.log(ratio), (math.log(low), math.log(high)), var, level)
    return ratio, math.exp(log_low), math.exp(log_high), level


def _mean_at(tested: pd.DataFrame, options: DiffOptions, level: float
             ) -> tuple[tuple[float, float, float], Optional[tuple[float, float, float, float]]]:
    """The geometric mean of the tested cells with its CI at `level`, by the design they share
    (rounds, start pairs, else independent cells with a floor added once), and the rounds mean
    itself (its exact coverage) when that is the design."""
    by_rounds = rounds_geometric_mean(tested, level)
    if by_rounds and options.instance_var > 0:
        by_rounds = widened_by_instances(by_rounds, options,
                                         tested["engine"].tolist() if "engine" in tested else None, level)
    mean = by_rounds[:3] if by_rounds else paired_geometric_mean(tested, level) or \
        geometric_mean(*(tested[c].to_numpy(float) for c in ("d", "se", "df")), level,
                       tested["between_var"].to_numpy(float) if "between_var" in tested else None)
    return mean, by_rounds


def geomean_verdict(gm: float, low: float, high: float, v_low: float, v_high: float, options: DiffOptions
                    ) -> tuple[str, float]:
    """The geometric mean judged as one cell under the rule (one test, no multiplicity): its
    verdict read from its verdict interval [v_low, v_high] (one-sided bounds at alpha each, the
    CI at 1 - 2 alpha), `same` when its printed CI lies inside the band; and its MDE (%) from
    the printed CI's width read as a normal one (a planning figure, as for a rounds cell)."""
    if not all(math.isfinite(x) and x > 0 for x in (gm, low, high, v_low, v_high)):
        return "inconclusive", math.inf
    t = options.threshold_pct / 100
    verdict = R.rule_verdicts(np.array(math.log(gm)), np.array(math.log(v_low)), np.array(math.log(v_high)),
                              np.array((low >= 1 - t) & (high <= 1 + t)), options.rule, options.threshold_pct)
    se = (math.log(high) - math.log(low)) / (2 * float(stats.norm.ppf(0.5 + options.level / 2)))
    return str(verdict), mde_from_se(se, math.inf, options.alpha, 1, threshold_pct=options.threshold_pct,
                                     rule=options.rule)


def summarize_quantities(rows: pd.DataFrame, options: DiffOptions) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for quantity in options.quantities:
        mine = rows[rows["quantity"] == quantity] if len(rows) else rows
        if mine.empty:
            continue
        stable = mine[~mine["unstable"]]
        tested = stable[stable["verdict"].notna()]
        (gm, low, high), by_rounds = _mean_at(tested, options, options.level)
        # the interval the overall verdict is read from: one-sided bounds at alpha each
        _, v_low, v_high = _mean_at(tested, options, 1 - 2 * options.alpha)[0]
        overall, overall_mde = geomean_verdict(gm, low, high, v_low, v_high, options)
        everything = mine["ratio"][mine["ratio"] > 0].dropna()
        out[quantity] = {"geomean_ratio": gm, "ci_low": low, "ci_high": high, "overall": overall,
                         "verdict_low": v_low, "verdict_high": v_high, "overall_mde_pct": overall_mde,
                         # exact (order statistics) for cells paired by rounds; else the nominal level
                         "ci_coverage": by_rounds[3] if by_rounds else options.level, "cells": int(len(mine)),
                         "geomean_ratio_all": float(np.exp(np.log(everything).mean())) if len(everything) else math.nan,
                         "cells_in_geomean": int(len(tested)),
                         # the Holm family: the cells a test judged (a noted cell is inconclusive untested)
                         "judged": int(mine["test"].isin(("t", "sign")).sum()) if "test" in mine
                         else int(mine["verdict"].notna().sum()), "alpha": options.alpha,
                         "notes": {n: int((mine["note"] == n).sum()) for n in sorted(set(mine["note"])) if n}
                         if "note" in mine else {},
                         "ci_source": ", ".join(sorted(set(mine["ci_source"]))),
                         "counts": {v: int((stable["verdict"] == v).sum()) for v in VERDICTS},
                         "no_verdict": int(stable["verdict"].isna().sum()),
                         "unstable": int(mine["unstable"].sum()),
                         "unstable_counts": {v: int((mine[mine["unstable"]]["verdict"] == v).sum()) for v in VERDICTS},
                         "mde_pct_median": float(mine["mde_pct"].median()) if mine["mde_pct"].notna().any()
                         else math.nan,
                         # what the gate could have seen: the largest MDE of a judged cell
                         "mde_pct_max": float(mine["mde_pct"].max()) if mine["mde_pct"].notna().any()
                         else math.nan, "rule": options.rule}
    return out

