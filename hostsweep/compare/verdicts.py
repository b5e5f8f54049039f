"""Multiplicity and verdicts (pure): the p-values of every judged row, Holm over each
quantity's cells, the verdicts, the CIs and each row's minimum detectable effect."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from hostsweep.compare import rules as R
from hostsweep.compare import stats as S
from hostsweep.compare.options import MIN_ROUNDS, DiffOptions
from hostsweep.measure.detectable import mde_from_se

def rounds_for_a_verdict(cells: int, alpha: float) -> int:
    """The fewest rounds whose sign test can call one of `cells` cells slower or faster under
    Holm at alpha (its smallest p-value, 2^-n, times the cells at Holm's first step), and whose
    order-statistic CI reaches the level (MIN_ROUNDS): below it no verdict but same can happen."""
    return max(MIN_ROUNDS, math.ceil(math.log2(max(cells, 1) / alpha) - 1e-12))


def _round_values(text: object) -> np.ndarray:
    """A rounds row's d_r, read back from its d_rounds text ("key=value ..."): the numbers the
    row prints, so its sign tests and verdict interval are those of what a reader sees."""
    return np.array([float(item.rsplit("=", 1)[1]) for item in str(text).split()], dtype=float)


def _floor_of(row: pd.Series) -> float:
    """The instance variance a rounds row was widened by (0: none)."""
    value = pd.to_numeric(row.get("between_var", 0.0), errors="coerce")
    return float(value) if np.isfinite(value) and value > 0 else 0.0


def judge_cells(cells: pd.DataFrame, options: DiffOptions) -> pd.DataFrame:
    """p-values under the rule in force, Holm over each quantity's tested cells, the verdict
    interval and the verdicts read from it (compare/rules.py), the printed CIs and the MDE per
    row. A t row (d, se, df) gets its p-values, CI and bounds from the t; a paired-rounds row
    (test "sign") its sign tests and order-statistic CI and bounds from its rounds, widened
    by its instance floor (between_var) where it has one. A row with a
    note (NO_BETWEEN) is inconclusive with no CI; a rounds row with fewer rounds than any
    slower/faster verdict needs says so in its note, and its MDE is infinite."""
    out = cells.copy()
    if "note" not in out:
        out["note"] = ""
    for column in ("p_slower", "p_faster", "p_same", "ci_low", "ci_high", "ci_coverage"):
        if column not in out:
            out[column] = math.nan
    if "test" not in out:
        out["test"] = ""
    for column in ("p_slower_holm", "p_faster_holm", "mde_pct", "verdict_low", "verdict_high", "verdict_alpha"):
        out[column] = math.nan
    out["verdict"] = None
    null = options.null_pct
    for quantity in out["quantity"].unique() if len(out) else []:
        sign = (out["quantity"] == quantity) & (out["test"] == "sign")
        t = (out["quantity"] == quantity) & ~sign & out["se"].notna() & (out["se"] > 0)
        mine = t | sign
        if not mine.any():
            continue
        if t.any():
            d, se, df = (out.loc[t, c].to_numpy(float) for c in ("d", "se", "df"))
            low, high = S.ci(d, se, df, options.level)
            # a CI the row came with (a rounds CI widened by the instance floor) is the one printed
            carried = out.loc[t, "ci_low"].notna().to_numpy() & out.loc[t, "ci_high"].notna().to_numpy()
            low = np.where(carried, out.loc[t, "ci_low"].to_numpy(float), low)
            high = np.where(carried, out.loc[t, "ci_high"].to_numpy(float), high)
            out.loc[t, ["p_slower", "p_faster", "p_same", "ci_low", "ci_high"]] = \
                np.column_stack([*S.pvalues(d, se, df, options.threshold_pct, null), low, high])
        rounds = {i: _round_values(text) for i, text in out.loc[sign, "d_rounds"].items()}
        # a rounds row widened by the instance floor: its sign tests and bounds widened alike
        floor = {i: _floor_of(out.loc[i]) for i in rounds}
        for i, values in rounds.items():
            out.loc[i, ["p_slower", "p_faster", "p_same"]] = [
                float(x) for x in S.widened_sign_pvalues(values, options.threshold_pct, null, floor[i])]
        slower, faster, same = (out.loc[mine, c].to_numpy(float) for c in ("p_slower", "p_faster", "p_same"))
        out.loc[mine, "p_slower_holm"], out.loc[mine, "p_faster_holm"] = S.holm(slower), S.holm(faster)
        is_t = t[mine].to_numpy()
        index = out.index[mine]

        def bounds(a_low: np.ndarray, a_high: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            low, high = np.full(a_low.shape, math.nan), np.full(a_low.shape, math.nan)
            if is_t.any():
                low[is_t], high[is_t] = R.t_bounds(*(out.loc[index[is_t], c].to_numpy(float) for c in ("d", "se", "df")),
                                                   a_low[is_t], a_high[is_t])
            for j in np.flatnonzero(~is_t):
                low[j], high[j] = (float(x) for x in R.widened_sign_bounds(rounds[index[j]], a_low[j], a_high[j],
                                                                           floor[index[j]]))
            return low, high

        shown = R.same_shown(same, options.alpha, out.loc[mine, "ci_low"].to_numpy(float),
                             out.loc[mine, "ci_high"].to_numpy(float), options.threshold_pct)
        verdict, v_low, v_high, a_low = R.judge_family(out.loc[mine, "d"].to_numpy(float), slower, faster, shown,
                                                       options.alpha, options.rule, options.threshold_pct, bounds)
        out.loc[mine, "verdict"] = verdict
        out.loc[mine, "verdict_low"], out.loc[mine, "verdict_high"] = np.exp(v_low), np.exp(v_high)
        out.loc[mine, "verdict_alpha"] = a_low
        m = int(mine.sum())
        if t.any():
            out.loc[t, "mde_pct"] = [mde_from_se(e, f, options.alpha, m, threshold_pct=options.threshold_pct,
                                                 rule=options.rule) for e, f in zip(out.loc[t, "se"], out.loc[t, "df"])]
        need = rounds_for_a_verdict(m, options.alpha)
        short = sign & (out["rounds"] < need) if "rounds" in out else sign & False
        # a rounds cell's MDE from its own test's power (the sign test, widened by its floor);
        # a cell short of rounds gets infinity below, without the simulation
        for i, values in rounds.items():
            if not short[i]:
                out.loc[i, "mde_pct"] = S.sign_mde_pct(values, floor[i], options.alpha / m, options.threshold_pct,
                                                       options.rule)
        if short.any():
            out.loc[short, "mde_pct"] = math.inf
            out.loc[short, "note"] = [f"too few rounds for slower or faster ({int(n)} of the {need} that "
                                      f"{m} cell(s) at alpha {options.alpha:g} need)" for n in out.loc[short, "rounds"]]
    noted = out["verdict"].isna() & out["note"].astype(str).ne("") & out["ratio"].notna()
    out.loc[noted, "verdict"] = "inconclusive"
    out.loc[noted, "mde_pct"] = math.inf
    return out
