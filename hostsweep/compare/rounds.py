"""Paired rounds (pure): a cell's side-a and side-b pairs timed back to back in every round,
matched by round; the cell's ratio, CI and sign tests over its rounds; the geometric mean
over shared rounds; what a reader of a rounds diff must be warned of."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import pandas as pd
from scipy import stats

from hostsweep.compare import stats as S
from hostsweep.compare.match import cell_label, text
from hostsweep.compare.options import GATED, MIN_ROUNDS, PAIRED_ROUNDS, PAIRED_ROUNDS_HOST, POINT, DiffOptions, RawRounds
from hostsweep.compare.options import by_rounds, finite_value
from hostsweep.compare.quantity import Compared, paired_sides
from hostsweep.measure.intervals import median_ci
from hostsweep.config.pairing import ROUND_CYCLE

@dataclass(frozen=True)
class MatchedRounds:
    """A paired cell's side-a and side-b pairs matched by their paired round (pair_round), in
    the order they ran: the pairs of one round were timed back to back, seconds apart."""

    base: np.ndarray  # side a's step_ms per matched round
    head: np.ndarray  # side b's
    base_canary: np.ndarray  # the canary timed beside each pair (nan: none)
    head_canary: np.ndarray
    keys: tuple[str, ...]  # the shared round (replicate.period.round) each ran in, "" when not recorded
    dropped: int  # matched rounds left out: a step not > 0 (or not a number) on either side

    @property
    def n(self) -> int:
        return int(self.base.size)


def _shared_round(rows: pd.DataFrame) -> list[str]:
    """Where each pair ran, as one key every cell of its group shares for that round:
    replicate.period.round ("" when a column is missing)."""
    parts = [pd.to_numeric(rows[c], errors="coerce") if c in rows else pd.Series(math.nan, index=rows.index)
             for c in ("replicate", "period", "round")]
    return [".".join(str(int(v)) for v in values) if all(math.isfinite(v) for v in values) else ""
            for values in zip(*(p.to_numpy(dtype=float) for p in parts))]


def match_rounds(base: Optional[RawRounds], head: Optional[RawRounds]) -> Optional[MatchedRounds]:
    """Side a's pairs and side b's matched by pair_round id; None when neither run was timed in
    paired rounds, else the matched rounds (maybe none). An id held by two pairs of one run
    names no one round: those pairs are left out."""
    if base is None and head is None:
        return None
    empty = np.array([], dtype=float)
    if base is None or head is None or base.empty or head.empty:
        return MatchedRounds(empty, empty, empty, empty, (), 0)
    columns = ["pair_round", "step_ms", "canary_ms", "replicate", "period", "round"]
    a, b = ((t.reindex(columns=columns).drop_duplicates("pair_round", keep=False)) for t in (base, head))
    a = a.assign(order=np.arange(len(a)))
    m = a.merge(b, on="pair_round", suffixes=("_a", "_b")).sort_values("order")
    step_a, step_b = (pd.to_numeric(m[f"step_ms_{x}"], errors="coerce").to_numpy(dtype=float) for x in "ab")
    with np.errstate(invalid="ignore"):
        good = np.isfinite(step_a) & np.isfinite(step_b) & (step_a > 0) & (step_b > 0)
    canary = [pd.to_numeric(m[f"canary_ms_{x}"], errors="coerce").to_numpy(dtype=float)[good] for x in "ab"]
    keys = _shared_round(m.rename(columns={f"{c}_a": c for c in ("replicate", "period", "round")}))
    return MatchedRounds(step_a[good], step_b[good], canary[0], canary[1], tuple(k for k, g in zip(keys, good) if g),
                  int((~good).sum()))


def rounds_statistic(base: np.ndarray, head: np.ndarray, level: float, threshold_pct: float,
                     null_pct: Optional[float] = None
                     ) -> tuple[float, tuple[float, float], float, tuple[float, float, float], np.ndarray]:
    """(median d_r, its CI on log scale, the CI's exact coverage, (p_slower, p_faster, p_same),
    the d_r) of one cell's rounds (stats.rounds_log_ratio, sign_pvalues with the rule's null)."""
    d = np.log(head) - np.log(base)
    median, low, high, coverage = S.rounds_log_ratio(base, head, level)
    p = S.sign_pvalues(d, threshold_pct, null_pct)
    return float(median), (float(low), float(high)), float(coverage), tuple(float(x) for x in p), d


def rounds_compared(quantity: str, base: Mapping[str, Any], head: Mapping[str, Any], rounds: MatchedRounds,
                   options: DiffOptions) -> Compared:
    """One quantity of a cell paired by rounds: step_ms over the matched rounds; host_ms the
    same with each side's device_ms held fixed, when every round leaves a positive host time on
    both sides (leaving out rounds whose host came out negative would keep only one side's slow
    rounds); anything else point only."""
    left_out = f" ({rounds.dropped} left out: a step not > 0)" if rounds.dropped else ""
    starts = len({k.split(".")[0] for k in rounds.keys}) or 1
    if quantity in (GATED, "host_ms"):
        sides, source = (rounds.base, rounds.head), PAIRED_ROUNDS
        if quantity == "host_ms":
            device = finite_value(base, "device_ms"), finite_value(head, "device_ms")
            sides = tuple(s - dev if dev is not None else s * math.nan for s, dev in zip(sides, device))
            source = PAIRED_ROUNDS_HOST
        if all(np.isfinite(s).all() and (s > 0).all() for s in sides):
            median, log_ci, coverage, p, d = rounds_statistic(*sides, options.level, options.threshold_pct,
                                                            options.null_pct)
            d_rounds = tuple(zip(rounds.keys, (float(x) for x in d)))
            if options.instance_var > 0:
                # one instance a side, shared by every round: its variance added to each half of
                # the rounds' CI in quadrature (exact when it is 0); the sign tests widened the
                # same way at every level (stats.widened_sign_pvalues), so the verdict and the
                # printed CI agree, and Holm's levels are read from the rounds, not a normal
                log_ci = widened(median, log_ci, options.instance_var, options.level)
                p = S.widened_sign_pvalues(d, options.threshold_pct, options.null_pct, options.instance_var)
                return Compared(math.exp(median), source, median,
                                between=f"paired: {rounds.n} rounds{left_out} + instance floor "
                                f"diff.instance_floor_pct={options.instance_floor_pct:g}", starts=(starts, starts),
                                design="paired",
                                # the level, unless the rounds' own order statistics fall below it
                                # (rounds_warnings says so): the floor widens, it does not make up rounds
                                log_ci=log_ci, coverage=min(options.level, coverage),
                                p=tuple(float(x) for x in p), rounds=rounds.n, d_rounds=d_rounds,
                                between_var=options.instance_var)
            return Compared(math.exp(median), source, median, between=f"paired: {rounds.n} rounds{left_out}",
                            starts=(starts, starts), design="paired", log_ci=log_ci, coverage=coverage, p=p,
                            rounds=rounds.n, d_rounds=d_rounds)
    b, h = finite_value(base, quantity), finite_value(head, quantity)
    return Compared(h / b if b is not None and h is not None and b > 0 and h > 0 else math.nan, POINT,
                    design="paired", between=f"paired: {rounds.n} rounds{left_out}", starts=(starts, starts))


def widened(centre: float, log_ci: tuple[float, float], variance: float, level: float) -> tuple[float, float]:
    """A CI (log scale) around centre with a normal component of `variance` added to each of its
    halves in quadrature: the order-statistic CI's shape kept, the shared effect made room for."""
    z = float(stats.norm.ppf(0.5 + level / 2))
    extra = z * z * variance
    return (centre - math.sqrt((centre - log_ci[0]) ** 2 + extra),
            centre + math.sqrt((log_ci[1] - centre) ** 2 + extra))


def rounds_geometric_mean(rows: pd.DataFrame, level: float) -> Optional[tuple[float, float, float, float]]:
    """The geometric mean of cells paired by rounds, with its CI over the shared rounds: the
    pairs of every cell of a group in round r ran in the same minute, so a spell that outlasts
    a round's two pairs but not the round hits the cells of that round together, and their
    d_{c,r} are not independent across cells; the rounds are. Per shared round (replicate,
    period, round) the mean over the cells of d_{c,r}, then the median of those per-round means
    with its order-statistic CI: (ratio, low, high, the CI's exact coverage). Only rounds every
    cell has count, so each per-round mean is over the same cells (a cell that stopped early
    would change what a round averages). None unless every row is paired by rounds with its
    shared rounds recorded and at least MIN_ROUNDS of them common to all. Rows widened by an
    instance floor (between_var > 0) count too: the caller widens the mean once."""
    if rows.empty or not by_rounds(rows).all() or not rows["test"].eq("sign").all():
        return None
    per_cell: list[dict[str, float]] = []
    for text_ in rows["d_rounds"]:
        pairs = [item.rsplit("=", 1) for item in str(text_).split()]
        cell = {key: float(value) for key, value in pairs if key}
        if len(cell) != len(pairs):
            return None  # a round with no shared key (round columns missing): rounds not aligned
        per_cell.append(cell)
    common = sorted(set.intersection(*(set(c) for c in per_cell)))
    if len(common) < MIN_ROUNDS:
        return None
    per_round = np.array([[cell[key] for key in common] for cell in per_cell]).mean(axis=0)
    ci = median_ci(per_round, level)
    return float(np.exp(np.median(per_round))), math.exp(ci.low), math.exp(ci.high), ci.coverage


def rounds_warnings(pairs: Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]],
                     rounds: Mapping[str, Optional[MatchedRounds]], cells: pd.DataFrame, label_dims: Sequence[str],
                     level: float) -> list[str]:
    """What a reader of a paired-rounds diff must know: cells timed in paired rounds but judged
    otherwise (too few rounds matched their partner's), rounds left out, CIs below the level."""
    out = []
    short = [cell_label(b, label_dims) for b, h in pairs if paired_sides(b, h)
             and ((m := rounds.get(str(b.get("run_id")))) is not None or text(b.get("pair_design")) == "rounds")
             and (m is None or m.n < MIN_ROUNDS)]
    if short:
        out.append(f"{len(short)} cell(s) timed in paired rounds have fewer than {MIN_ROUNDS} rounds matched with "
                   f"their partner's ({', '.join(short)}): judged by start pairs where each side has 2 or more engine "
                   "starts, else sequentially")
    used = {r for r in cells.loc[by_rounds(cells), "base_run"].astype(str)}
    dropped = {run: m.dropped for run, m in rounds.items() if run in used and m is not None and m.dropped}
    if dropped:
        out.append(f"{sum(dropped.values())} round(s) of {len(dropped)} cell(s) paired by rounds left out: a step "
                   "not > 0 on a side")
    judged = cells[by_rounds(cells) & cells["test"].eq("sign")]
    below = judged[judged["ci_coverage"] < level - 1e-12]
    if len(below):
        out.append(f"{below['cell'].nunique()} cell(s) paired by rounds have too few rounds for a {level:.0%} CI: "
                   f"theirs cover {below['ci_coverage'].min():.1%} (order statistics, exact"
                   + ("; an instance floor widens them but does not add rounds)"
                      if "between_var" in below and (below["between_var"] > 0).any() else ")"))
    odd = judged[judged["quantity"] == GATED]
    odd = odd[pd.to_numeric(odd["rounds"], errors="coerce").fillna(0).astype(int) % ROUND_CYCLE != 0]
    if len(odd):
        out.append(f"{len(odd)} cell(s) paired by rounds have a number of rounds that is not a multiple of "
                   f"{ROUND_CYCLE} ({_counts(odd['rounds'])}): their side order x T order combinations are "
                   "unbalanced, so a cost of switching engines is not cancelled exactly")
    return out


def _counts(values: pd.Series) -> str:
    distinct = sorted({int(v) for v in values})
    return ", ".join(map(str, distinct[:6])) + (", ..." if len(distinct) > 6 else "")

