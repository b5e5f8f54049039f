"""Two sides of measured cells compared cell by cell (pure): what differs between them,
which cells match, and per matched cell and quantity the ratio head/base with a CI, the
p-values behind its verdict, its minimum detectable effect, and the release gate.

The rules, in one place (the statistics in report/diff_stats.py):
- A cell dimension (a cell param: sku, mode, engine_args, batch, replicates...) that holds
  one value on each side, a different one on each, is *what differs*: it is left out of the
  matching. Every other cell dimension is matched on, so cells the other side lacks stay
  unmatched. Provenance (versions, git SHA, device, host) is never matched on, only reported.
- step_ms: log(head/base) of the two sides' estimates. A side measured in several engine
  starts is a t-interval over its starts' medians (k - 1 df); a one-start side is the median
  of its pairs (Maritz–Jarrett variance) widened by a between-start component: the stated
  noise floor (diff.noise_floor_pct) or, else, the side's replicate-first re-measures. With
  neither, the diff still reports, but a gate refuses (exit 2) and says what to run.
  host_ms: the same with each cell's device_ms held fixed. Other quantities: point only.
- Paired cells (a paired study, pair.against: base row side a, head row side b, one sweep,
  both with raw pairs in the same k >= 2 engine starts): start i of side a and start i of
  side b were adjacent in time (ABBA), so step_ms is the mean over start pairs of
  d_i = log(head start i's median / base start i's median), se = sd(d_i) / sqrt(k), k - 1 df:
  drift common to a start pair cancels, and no between-start component is needed (so the
  gate never refuses them). host_ms likewise with each side's device_ms held fixed. Every row
  says its `design` (paired or sequential), the result says it in one line, and a paired
  diff also states the machine's between-start noise floor: the spread of each side's start
  medians, pooled over the paired cells, which a sequential diff of two studies measured
  apart can pass as diff.noise_floor_pct.
- Paired rounds (pair.design=rounds: both sides' engines in one worker, a cell's side-a pair
  and its side-b pair timed back to back in every round; raw_timings.csv's pair_round names
  the round, the same id on both): a paired cell whose runs share >= MIN_ROUNDS round ids is
  judged over its rounds instead: d_r = log(head_r / base_r), ratio exp(median d_r), CI the
  order statistics of the d_r (exact coverage, stated when below the level), p-values the
  exact sign tests that CI inverts (no se, no df). Speed spells longer than a round cancel in
  d_r; a round has no between-start spread, so it adds nothing to the noise floor. Fewer
  matched rounds: judged as before (start pairs, else sequential), with a warning. The
  geometric mean of rounds cells: per shared round (replicate, period, round) the mean of the
  cells' d_r, then the median of those and its order-statistic CI.
- Verdicts, with t = threshold_pct/100, at alpha: `slower` when the one-sided p-value of
  head > base, Holm-adjusted over the cells judged, is <= alpha and the ratio lies above
  1 + t; `faster` the mirror; `same` when the equivalence test (TOST) at ±t rejects at
  alpha; else `inconclusive`. No resampling: no seed decides a verdict.
- The gate (fail_on): fails on every step_ms cell judged slower, stable or not; on an
  unstable cell whose ratio lies above 1 + t (its CI vouches for nothing); on base cells the
  head lacks or whose head run FAILED. `split_impossible` alone never makes step_ms unstable.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Collection, Mapping, Optional, Sequence, Union
from hostsweep.config.schema import ConfigError, DiffConfig

import numpy as np
import pandas as pd
from scipy import stats

from hostsweep.measure.detectable import mde_from_se, se_from_ci
from hostsweep.measure.intervals import few_starts_warning, median_ci
from hostsweep.measure.stability import ANNOTATIONS
from hostsweep.report import diff_stats as S
from hostsweep.report.diff_canary import (
    CANARY_COLUMNS, NORMALIZE, machine_line, paired_canary_ratio, rounds_canary_ratio, side_canary,
    with_canary_ratios,
)
from hostsweep.report.diff_match import (  # noqa: F401 - re-exported: the rules live in one place for readers
    CELL_DIMS, PROVENANCE_DIMS, Difference, cell_label, dimensions, match_cells, text,
)

VERDICTS = ("faster", "slower", "same", "inconclusive")
FAIL_ON = ("slower", "inconclusive")
GATED = "step_ms"  # the quantity fail_on judges: the one with raw pairs on both sides
RAW, SUMMARY, HOST_FIXED, POINT = ("raw pairs", "summary CIs (approximate: no raw_timings.csv)",
                                   "step pairs, device_ms held fixed", "point only (no raw pairs)")
PAIRED, PAIRED_HOST = "paired engine starts", "paired engine starts, device_ms held fixed"
PAIRED_ROUNDS, PAIRED_ROUNDS_HOST = "paired rounds", "paired rounds, device_ms held fixed"
# A cell is judged by paired rounds from this many matched rounds: the fewest whose order
# statistics reach a 95 % CI of the median ([min, max] of 6 covers 96.9 %), and a sign test
# that can reject at all (p >= 1/64 below it even when every round agrees).
MIN_ROUNDS = 6
# How a row's CI and p-values were made: a Student t on d, se, df; the exact sign test and
# order-statistic CI of a paired-rounds cell; none (point only).
TESTS = ("t", "sign", "")
DESIGNS = ("paired", "sequential")  # a cell's design: both sides in one sweep, starts alternated; or measured apart
SIDES = ("a", "b")  # a paired study's sides (param `side`): a the study as given, b with pair.against
# Reasons that do not touch the step's own number: a cell unstable only for these is judged
# as stable on step_ms (its host_ms stays unstable).
NOT_STEP_REASONS = frozenset({"split_impossible", "split_implausible"})
RawPairs = Union[np.ndarray, Sequence[np.ndarray]]  # one start's pairs, or one array per start
# A run's pairs timed in paired rounds: one row per pair, the columns of
# record/read/sides.ROUND_COLUMNS (pair_round, step_ms, canary_ms, replicate, period, round).
RawRounds = pd.DataFrame


@dataclass(frozen=True)
class DiffOptions:
    threshold_pct: float = 5.0
    quantities: tuple[str, ...] = ("step_ms", "device_ms", "host_ms")
    level: float = 0.95
    alpha: float = 0.05
    noise_floor_pct: Optional[float] = None  # between-start spread (SD, %) for one-start sides
    fail_on: Optional[str] = None
    normalize: Optional[str] = None  # "canary": each step ratio also divided by the sides' canary ratio

    def check(self) -> None:
        """ValueError naming the field (the stage makes it a one-line ConfigError)."""
        if not 0 < self.threshold_pct < 100:
            raise ValueError(f"threshold_pct must be in (0, 100), got {self.threshold_pct}")
        if not 0.5 <= self.level < 1:
            raise ValueError(f"ci_level must be in [0.5, 1), got {self.level}")
        if not 0 < self.alpha <= 0.5:
            raise ValueError(f"alpha must be in (0, 0.5], got {self.alpha}")
        if self.noise_floor_pct is not None and not 0 <= self.noise_floor_pct < 100:
            raise ValueError(f"noise_floor_pct must be in [0, 100) or null, got {self.noise_floor_pct}")
        if not self.quantities:
            raise ValueError("quantities must name at least one metric, e.g. [step_ms]")
        if self.fail_on is not None and self.fail_on not in FAIL_ON:
            raise ValueError(f"fail_on={self.fail_on!r} is not allowed; allowed: null, {', '.join(FAIL_ON)}")
        if self.normalize is not None and self.normalize not in NORMALIZE:
            raise ValueError(f"normalize={self.normalize!r} is not allowed; allowed: null, {', '.join(NORMALIZE)}")


def diff_options(cfg: DiffConfig) -> DiffOptions:
    """The diff section (config/schema.DiffConfig) as DiffOptions, checked: a bad value is a
    one-line ConfigError naming the key. A sweep checks it before anything starts (its paired
    diff and its gate read it), the diff stage before it reads a run."""
    options = DiffOptions(float(cfg.threshold_pct), tuple(cfg.quantities), float(cfg.ci_level), float(cfg.alpha),
                          None if cfg.noise_floor_pct is None else float(cfg.noise_floor_pct), cfg.fail_on,
                          cfg.normalize)
    try:
        options.check()
    except ValueError as exc:
        raise ConfigError(f"diff.{exc}") from None
    return options


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
    """A side's between-start component: the noise floor when stated; else what the study
    shows of itself, pooled over its cells: the spread between the periods of re-measured
    groups (columns period_var, period_df, from the raw pairs) and replicate-first re-measures
    of one-cell groups; else none (nan). The study's own estimates see drift over time within
    an engine start, not what a new engine start changes: the docs say so."""
    if options.noise_floor_pct is not None:
        return Between(math.log1p(options.noise_floor_pct / 100) ** 2, math.inf,
                       f"noise floor diff.noise_floor_pct={options.noise_floor_pct:g}")
    variances, dfs, named = [], [], []
    if "period_var" in cells and "period_df" in cells:
        v, d = S.pooled(cells["period_var"].tolist(), cells["period_df"].tolist())
        variances, dfs = variances + [v], dfs + [d]
        named += [f"{int(d)} between-period df"] if d else []
    if "replicate_step_ms" in cells and GATED in cells:
        v, d = S.replicate_component(cells[GATED].tolist(), cells["replicate_step_ms"].tolist())
        variances, dfs = variances + [v], dfs + [d]
        named += [f"{int(d)} replicate-first re-measure(s)"] if d else []
    var, df = S.pooled(variances, dfs)
    if not df:
        return Between(math.nan, 0.0, "none")
    return Between(var, df, f"the study's own re-measures ({', '.join(named)}: spread "
                            f"{math.expm1(math.sqrt(var)) * 100:.1f}%)")


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
    """One quantity of one matched cell: the ratio, and on log scale its difference d,
    standard error se and df (nan: no test, point only)."""

    ratio: float
    source: str
    d: float = math.nan
    se: float = math.nan
    df: float = math.nan
    between: str = ""  # the between-start component each one-start side was widened by
    starts: tuple[int, int] = (0, 0)
    design: str = "sequential"  # or "paired" (DESIGNS)
    d_starts: tuple[float, ...] = ()  # a paired cell's log ratio in each start pair
    # Paired rounds: the CI and p-values come from the rounds' order statistics and sign tests,
    # not from d, se, df (se and df stay nan): carried as they are, never turned into a t.
    log_ci: tuple[float, float] = (math.nan, math.nan)  # the CI of d (log scale)
    coverage: float = math.nan  # the CI's exact coverage (order statistics)
    p: tuple[float, float, float] = (math.nan, math.nan, math.nan)  # p_slower, p_faster, p_same
    rounds: int = 0  # matched rounds the cell is judged over
    d_rounds: tuple[tuple[str, float], ...] = ()  # (shared round, d_r) per matched round

    @property
    def test(self) -> str:
        """How the verdict is made (TESTS)."""
        if self.rounds:
            return "sign"
        return "t" if math.isfinite(self.se) and self.se > 0 else ""


def _step_side(row: Mapping[str, Any], groups: Optional[list[np.ndarray]], between: Between,
               level: float) -> Optional[tuple[S.LogEstimate, str]]:
    """One side's log step (raw pairs, else its logged CI), a one-start side widened."""
    if groups is not None:
        e = S.side_estimate(groups, level)
    elif all(_finite(row, n) and _finite(row, n) > 0 for n in ("step_ms", "step_ci_low_ms", "step_ci_high_ms")):
        k = int(_finite(row, "replicates") or 1)
        coverage = _finite(row, "ci_coverage") or level
        se = se_from_ci(float(row["step_ms"]), float(row["step_ci_low_ms"]), float(row["step_ci_high_ms"]),
                        coverage, k - 1 if k > 1 else math.inf)
        e = S.LogEstimate(math.log(float(row["step_ms"])), se ** 2, k - 1.0 if k > 1 else math.inf, k, 0)
    else:
        return None
    if e.starts > 1:
        return e, f"{e.starts} starts"
    if not between.known:
        return e, "one start, no between-start estimate"
    var, df = S.widen(np.array(e.var), np.array(e.df), between.var, between.df)
    return S.LogEstimate(e.est, float(var), float(df), 1, e.pairs), f"one start + {between.source}"


def _host_side(e: S.LogEstimate, device_ms: Optional[float]) -> Optional[S.LogEstimate]:
    """host = step - device_ms (device fixed): its log and variance by the delta method."""
    step = math.exp(e.est)
    if device_ms is None or step - device_ms <= 0:
        return None
    factor = step / (step - device_ms)
    return S.LogEstimate(math.log(step - device_ms), e.var * factor ** 2, e.df, e.starts, e.pairs)


def paired_starts(base: Mapping[str, Any], head: Mapping[str, Any],
                  groups: tuple[Optional[list[np.ndarray]], Optional[list[np.ndarray]]]) -> int:
    """k when the matched cell is paired: the base row is side a and the head row side b of one
    sweep (equal parent_run_id), both with raw pairs in the same k >= 2 engine starts; else 0."""
    if not paired_sides(base, head) or groups[0] is None or groups[1] is None:
        return 0
    k = len(groups[0])
    return k if k >= 2 and len(groups[1]) == k else 0


def _paired(quantity: str, base: Mapping[str, Any], head: Mapping[str, Any], groups: tuple[list[np.ndarray], ...],
            k: int) -> Compared:
    """One quantity of a paired cell: step_ms and host_ms from the start pairs' medians (host
    with each side's device_ms held fixed), anything else point only."""
    if quantity in (GATED, "host_ms"):
        medians = [np.array([np.median(g) for g in side]) for side in groups]
        source = PAIRED
        if quantity == "host_ms":
            device = _finite(base, "device_ms"), _finite(head, "device_ms")
            medians = [m - dev if dev is not None else m * math.nan for m, dev in zip(medians, device)]
            source = PAIRED_HOST
        if all(np.isfinite(m).all() and (m > 0).all() for m in medians):
            d, se, df = S.paired_log_ratio(medians[0], medians[1])
            return Compared(math.exp(float(d)), source, float(d), float(se), float(df), f"paired: {k} start pairs",
                            (k, k), "paired", tuple(float(x) for x in np.log(medians[1]) - np.log(medians[0])))
    b, h = _finite(base, quantity), _finite(head, quantity)
    return Compared(h / b if b is not None and h is not None and b > 0 and h > 0 else math.nan, POINT,
                    design="paired")


@dataclass(frozen=True)
class Rounds:
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


def match_rounds(base: Optional[RawRounds], head: Optional[RawRounds]) -> Optional[Rounds]:
    """Side a's pairs and side b's matched by pair_round id; None when neither run was timed in
    paired rounds, else the matched rounds (maybe none). An id held by two pairs of one run
    names no one round: those pairs are left out."""
    if base is None and head is None:
        return None
    empty = np.array([], dtype=float)
    if base is None or head is None or base.empty or head.empty:
        return Rounds(empty, empty, empty, empty, (), 0)
    columns = ["pair_round", "step_ms", "canary_ms", "replicate", "period", "round"]
    a, b = ((t.reindex(columns=columns).drop_duplicates("pair_round", keep=False)) for t in (base, head))
    a = a.assign(order=np.arange(len(a)))
    m = a.merge(b, on="pair_round", suffixes=("_a", "_b")).sort_values("order")
    step_a, step_b = (pd.to_numeric(m[f"step_ms_{x}"], errors="coerce").to_numpy(dtype=float) for x in "ab")
    with np.errstate(invalid="ignore"):
        good = np.isfinite(step_a) & np.isfinite(step_b) & (step_a > 0) & (step_b > 0)
    canary = [pd.to_numeric(m[f"canary_ms_{x}"], errors="coerce").to_numpy(dtype=float)[good] for x in "ab"]
    keys = _shared_round(m.rename(columns={f"{c}_a": c for c in ("replicate", "period", "round")}))
    return Rounds(step_a[good], step_b[good], canary[0], canary[1], tuple(k for k, g in zip(keys, good) if g),
                  int((~good).sum()))


def paired_sides(base: Mapping[str, Any], head: Mapping[str, Any]) -> bool:
    """Whether the base row is side a and the head row side b of one sweep (equal parent_run_id)."""
    parent = text(base.get("parent_run_id"))
    return (text(base.get("side")), text(head.get("side"))) == SIDES and bool(parent) \
        and parent == text(head.get("parent_run_id"))


def rounds_statistic(base: np.ndarray, head: np.ndarray, level: float, threshold_pct: float
                     ) -> tuple[float, tuple[float, float], float, tuple[float, float, float], np.ndarray]:
    """(median d_r, its CI on log scale, the CI's exact coverage, (p_slower, p_faster, p_same),
    the d_r) of one cell's rounds (diff_stats.rounds_log_ratio, sign_pvalues)."""
    d = np.log(head) - np.log(base)
    median, low, high, coverage = S.rounds_log_ratio(base, head, level)
    p = S.sign_pvalues(d, threshold_pct)
    return float(median), (float(low), float(high)), float(coverage), tuple(float(x) for x in p), d


def _paired_rounds(quantity: str, base: Mapping[str, Any], head: Mapping[str, Any], rounds: Rounds,
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
            device = _finite(base, "device_ms"), _finite(head, "device_ms")
            sides = tuple(s - dev if dev is not None else s * math.nan for s, dev in zip(sides, device))
            source = PAIRED_ROUNDS_HOST
        if all(np.isfinite(s).all() and (s > 0).all() for s in sides):
            median, log_ci, coverage, p, d = rounds_statistic(*sides, options.level, options.threshold_pct)
            return Compared(math.exp(median), source, median, between=f"paired: {rounds.n} rounds{left_out}",
                            starts=(starts, starts), design="paired", log_ci=log_ci, coverage=coverage, p=p,
                            rounds=rounds.n, d_rounds=tuple(zip(rounds.keys, (float(x) for x in d))))
    b, h = _finite(base, quantity), _finite(head, quantity)
    return Compared(h / b if b is not None and h is not None and b > 0 and h > 0 else math.nan, POINT,
                    design="paired", between=f"paired: {rounds.n} rounds{left_out}", starts=(starts, starts))


def compare_quantity(quantity: str, base: Mapping[str, Any], head: Mapping[str, Any],
                     raw_base: Optional[RawPairs], raw_head: Optional[RawPairs], options: DiffOptions,
                     between: tuple[Between, Between] = (Between(math.nan, 0.0, "none"),) * 2,
                     rounds: Optional[Rounds] = None) -> Compared:
    """The ratio head/base of one quantity of a matched cell, with its log-scale test inputs.
    rounds: the cell's pairs matched by paired round (match_rounds); a paired cell with at least
    MIN_ROUNDS of them is judged over its rounds, else as before."""
    if rounds is not None and rounds.n >= MIN_ROUNDS and paired_sides(base, head):
        return _paired_rounds(quantity, base, head, rounds, options)
    groups = starts_of(raw_base), starts_of(raw_head)
    k = paired_starts(base, head, groups)
    if k:
        return _paired(quantity, base, head, groups, k)  # type: ignore[arg-type]
    both_raw = groups[0] is not None and groups[1] is not None
    if quantity in (GATED, "host_ms") and (both_raw or quantity == GATED):
        sides = [_step_side(r, g if both_raw else None, w, options.level)
                 for r, g, w in zip((base, head), groups, between)]
        if all(sides):
            (b, why_b), (h, why_h) = sides  # type: ignore[misc]
            source = RAW if both_raw else SUMMARY
            if quantity == "host_ms":
                b, h, source = _host_side(b, _finite(base, "device_ms")), _host_side(h, _finite(head, "device_ms")), \
                    HOST_FIXED
            if b is not None and h is not None:
                d = h.est - b.est
                df = float(S.satterthwaite([np.array(b.var), np.array(h.var)], [np.array(b.df), np.array(h.df)]))
                return Compared(math.exp(d), source, d, math.sqrt(b.var + h.var), df,
                                f"base: {why_b}; head: {why_h}", (b.starts, h.starts))
    b, h = _finite(base, quantity), _finite(head, quantity)
    return Compared(h / b if b is not None and h is not None and b > 0 and h > 0 else math.nan, POINT)


def step_unstable(flags: tuple[Optional[bool], Optional[bool]], reasons: tuple[str, str]) -> bool:
    """Whether either side is unstable for its own step: a cell flagged only split_impossible is
    not (its step is fine; the split is what failed), nor one flagged only for what its whole
    group met (measure/stability.ANNOTATIONS, as older runs recorded them among the reasons):
    the fit keeps such cells, and the gate does not fail on them either."""
    for flag, why in zip(flags, reasons):
        named = {r.strip() for r in why.split(",") if r.strip()}
        if flag is False and (not named or named - NOT_STEP_REASONS - set(ANNOTATIONS)):
            return True
    return False


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
    between: dict[str, str] = field(default_factory=dict)  # per side, the between-start component's source
    machine: Optional[str] = None  # the sides' speed canaries compared (report/diff_canary.py)
    canary_ms: dict[str, Optional[float]] = field(default_factory=dict)  # per side
    design: str = ""  # one line: paired, sequential, or how many of each (design_line)
    noise_floor_pct: Optional[float] = None  # a paired diff's between-start spread (SD, %): NoiseFloor
    noise_floor_df: float = 0.0
    against: str = ""  # a paired study's side b overrides (pair_against), "" for an A/A or two studies

    def noise_floor_line(self) -> Optional[str]:
        """What a paired diff says of the machine's between-start spread, or None."""
        if self.noise_floor_pct is None or not math.isfinite(self.noise_floor_pct):
            return None
        x = floor_text(self.noise_floor_pct)
        return (f"between-start spread on this machine: {x} % (SD, {int(self.noise_floor_df)} df): a sequential diff "
                f"of two studies measured apart can pass diff.noise_floor_pct={x} (a lower bound: studies measured "
                "further apart drift more)")

    def _gated(self) -> pd.DataFrame:
        return self.cells[self.cells["quantity"] == GATED] if len(self.cells) else self.cells

    def missing(self) -> pd.DataFrame:
        """Base cells the head lacks, or whose head run FAILED: a gate fails on them."""
        u = self.unmatched
        return u[u["side"] == "base"] if len(u) else u

    def failing(self) -> pd.DataFrame:
        """The GATED rows fail_on fails on. slower: every cell judged slower, and every
        unstable cell whose ratio lies above 1 + t. inconclusive: every cell not shown
        stable and same or faster."""
        rows = self._gated()
        if self.options.fail_on is None or rows.empty:
            return rows.iloc[0:0]
        if self.options.fail_on == "slower":
            beyond = rows["ratio"] > 1 + self.options.threshold_pct / 100
            return rows[(rows["verdict"] == "slower") | (rows["unstable"] & beyond)]
        return rows[rows["unstable"] | ~rows["verdict"].isin(("same", "faster"))]

    def refusal(self) -> Optional[str]:
        """Why the gate cannot judge at all (one line, what to run), or None."""
        rows = self._gated()
        if self.options.fail_on is None or rows.empty:
            return None
        blind = rows[rows["between"].str.contains("no between-start estimate", regex=False)]
        if blind.empty:
            return None
        return (f"diff.fail_on={self.options.fail_on}: {len(blind)} cell(s) have a side measured in one engine start "
                "with no between-start estimate, so no false-alarm rate can be stated; measure both studies with "
                "measure.replicates=3, or give diff.noise_floor_pct (the step's spread between engine starts, from "
                "an A/A diff of this machine)")

    def gate(self) -> tuple[bool, str]:
        """(failed, why) under fail_on. Fails on failing() cells, on base cells the head lacks
        or FAILED, when the gate refuses, and when there is no cell to judge."""
        if self.options.fail_on is None:
            return False, ""
        refused = self.refusal()
        if refused:
            return True, refused
        rows, failing, missing, t = self._gated(), self.failing(), self.missing(), self.options.threshold_pct
        s = self.summary.get(GATED, {})
        level = f"{s.get('judged', 0)} cell(s) judged at family-wise alpha {self.options.alpha:g} (Holm)"
        why = []
        if len(failing):
            named = [c + (f" (unstable: {r or 'reason not recorded'})" if u else "")
                     for c, u, r in zip(failing["cell"], failing["unstable"], failing["unstable_reasons"])]
            why.append(f"{len(failing)} cell(s) {self.options.fail_on} (±{t:g}%): {', '.join(named)}")
        if len(missing):
            why.append(f"{len(missing)} base cell(s) missing from head: "
                       + ", ".join(f"{_unmatched_label(r, self.label_dims)} ({r['reason'].split(' with ')[0]})"
                                   for r in missing.to_dict("records")))
        if why:
            return True, "; ".join(why) + f"; {level}"
        if rows.empty:
            return True, "no matched cell to judge"
        return False, f"{level}, none {self.options.fail_on} (±{t:g}%)"


def floor_text(pct: float) -> str:
    """A noise floor as typed back into diff.noise_floor_pct: two significant digits, rounded up."""
    if pct <= 0:
        return "0"
    step = 10.0 ** (math.floor(math.log10(pct)) - 1)
    return f"{math.ceil(round(pct / step, 6)) * step:.{max(0, 1 - math.floor(math.log10(pct)))}f}"


@dataclass(frozen=True)
class NoiseFloor:
    """The between-start spread of a paired diff: the log start medians' variance of each side
    of each paired cell, pooled over cells and sides (df = the sum of k - 1)."""

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
    have each side started once: no spread between starts to state."""
    variances, dfs, cells = [], [], 0
    for b, h in pairs:
        if str(b.get("run_id")) in by_rounds:
            continue
        groups = starts_of(raw.get(str(b.get("run_id")))), starts_of(raw.get(str(h.get("run_id"))))
        if not paired_starts(b, h, groups):
            continue
        cells += 1
        for side in groups:
            var, df = S.start_spread(np.array([np.median(g) for g in side]))  # type: ignore[union-attr]
            variances.append(float(var))
            dfs.append(float(df))
    var, df = S.pooled(variances, dfs)
    return NoiseFloor(var, df, cells) if df else None


def _counts_text(values: Sequence[int]) -> str:
    """Per-cell counts as 3, 3/5, or 22–24 when more than three differ."""
    distinct = sorted({int(v) for v in values})
    return "/".join(map(str, distinct)) if len(distinct) <= 3 else f"{distinct[0]}–{distinct[-1]}"


def design_line(cells: pd.DataFrame, between: Mapping[str, str]) -> str:
    """How the compared cells were measured, in one line: paired (k start pairs, ABBA in one
    sweep; or N rounds, the sides timed back to back in each), sequential (two studies measured
    apart, and what widens a one-start side), or how many of each."""
    rows = cells[cells["quantity"] == GATED] if len(cells) else cells
    if rows.empty:
        return "no matched cell"
    by_rounds = (rows["test"] == "sign") if "test" in rows else pd.Series(False, index=rows.index)
    rounds, paired = rows[by_rounds], rows[(rows["design"] == "paired") & ~by_rounds]
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
        seq_text = "two studies measured apart; one-start sides widened by " + " / ".join(
            "nothing (no between-start estimate)" if w == "none" else w for w in sources)
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


def _unmatched_label(row: Mapping[str, Any], dims: Sequence[str]) -> str:
    return cell_label(row, [d for d in dims if d in row] or [d for d in ("batch", "ctx") if d in row])


def _side_flags(b: Mapping[str, Any], h: Mapping[str, Any]) -> tuple[tuple, tuple[str, str]]:
    flags = (stable_flag(b.get("stable")), stable_flag(h.get("stable")))
    return flags, (text(b.get("unstable_reasons")), text(h.get("unstable_reasons")))


def _cell_rows(pairs: list[tuple[dict, dict]], raw: Mapping[str, RawPairs], label_dims: Sequence[str],
               options: DiffOptions, between: tuple[Between, Between],
               rounds: Mapping[str, Optional[Rounds]]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for b, h in pairs:
        flags, reasons = _side_flags(b, h)
        for quantity in options.quantities:
            if _finite(b, quantity) is None and _finite(h, quantity) is None:
                continue  # neither cell has it (no split, no phases)
            c = compare_quantity(quantity, b, h, raw.get(str(b.get("run_id"))), raw.get(str(h.get("run_id"))),
                                 options, between, rounds.get(str(b.get("run_id"))))
            # A paired step's CI comes from its start pairs (or rounds), over whatever the machine
            # did between them: what makes one side's cell unstable (drift, machine speed, a wide
            # CI) is inside it, so the paired verdict stands on its CI; the reasons stay listed.
            unstable = (c.design != "paired" and step_unstable(flags, reasons)) if quantity == GATED \
                else False in flags
            rows.append({"cell": cell_label(b, label_dims), "quantity": quantity, "base": _finite(b, quantity),
                         "head": _finite(h, quantity), "ratio": c.ratio, "d": c.d, "se": c.se, "df": c.df,
                         "ci_source": c.source, "design": c.design, "between": c.between,
                         "starts_base": c.starts[0],
                         "starts_head": c.starts[1], "unstable": unstable,
                         "unstable_reasons": ",".join(sorted({r.strip() for why in reasons for r in why.split(",")
                                                              if r.strip()})),
                         "stable_flag": "unknown" if flags == (None, None) else "present",
                         "base_run": b.get("run_id"), "head_run": h.get("run_id"),
                         "d_starts": " ".join(f"{x:.5f}" for x in c.d_starts),
                         # a rounds cell's CI and p-values as its order statistics and sign tests
                         # made them (judge keeps them); nan for the rest, which judge computes
                         "test": c.test, "ci_low": math.exp(c.log_ci[0]), "ci_high": math.exp(c.log_ci[1]),
                         "ci_coverage": c.coverage, "p_slower": c.p[0], "p_faster": c.p[1], "p_same": c.p[2],
                         "rounds": c.rounds, "d_rounds": " ".join(f"{k}={x:.6f}" for k, x in c.d_rounds),
                         **{d: b.get(d) for d in label_dims}})
    return rows


def _rounds_se(low: float, high: float, coverage: float) -> float:
    """The standard error of a normal estimate whose CI at `coverage` spans [low, high] (log):
    only for a rounds cell's MDE, a planning figure (the sign test has no se of its own); its
    verdict stays on the sign test."""
    if not (math.isfinite(low) and math.isfinite(high) and 0 < coverage < 1):
        return math.nan
    return (high - low) / (2 * float(stats.norm.ppf(0.5 + coverage / 2)))


def judge(cells: pd.DataFrame, options: DiffOptions) -> pd.DataFrame:
    """p-values, Holm over each quantity's tested cells, verdicts, CIs and the MDE per row. A
    t row (d, se, df) gets its p-values and CI from the t; a paired-rounds row (test "sign")
    keeps the exact sign tests and order-statistic CI it came with, and joins Holm with them."""
    out = cells.copy()
    for column in ("p_slower", "p_faster", "p_same", "ci_low", "ci_high", "ci_coverage"):
        if column not in out:
            out[column] = math.nan
    if "test" not in out:
        out["test"] = ""
    for column in ("p_slower_holm", "p_faster_holm", "mde_pct"):
        out[column] = math.nan
    out["verdict"] = None
    for quantity in out["quantity"].unique() if len(out) else []:
        sign = (out["quantity"] == quantity) & (out["test"] == "sign")
        t = (out["quantity"] == quantity) & ~sign & out["se"].notna() & (out["se"] > 0)
        mine = t | sign
        if not mine.any():
            continue
        if t.any():
            d, se, df = (out.loc[t, c].to_numpy(float) for c in ("d", "se", "df"))
            low, high = S.ci(d, se, df, options.level)
            out.loc[t, ["p_slower", "p_faster", "p_same", "ci_low", "ci_high"]] = \
                np.column_stack([*S.pvalues(d, se, df, options.threshold_pct), low, high])
        slower, faster, same = (out.loc[mine, c].to_numpy(float) for c in ("p_slower", "p_faster", "p_same"))
        out.loc[mine, "p_slower_holm"], out.loc[mine, "p_faster_holm"] = S.holm(slower), S.holm(faster)
        out.loc[mine, "verdict"] = S.verdicts(out.loc[mine, "d"].to_numpy(float),
                                              out.loc[mine, "p_slower_holm"].to_numpy(float),
                                              out.loc[mine, "p_faster_holm"].to_numpy(float), same,
                                              options.alpha, options.threshold_pct)
        m = int(mine.sum())
        se = [e if kind == "t" else _rounds_se(math.log(lo), math.log(hi), cov)
              for kind, e, lo, hi, cov in zip(out.loc[mine, "test"], out.loc[mine, "se"], out.loc[mine, "ci_low"],
                                              out.loc[mine, "ci_high"], out.loc[mine, "ci_coverage"])]
        df = [f if kind == "t" else math.inf for kind, f in zip(out.loc[mine, "test"], out.loc[mine, "df"])]
        out.loc[mine, "mde_pct"] = [mde_from_se(e, f, options.alpha, m, threshold_pct=options.threshold_pct)
                                    for e, f in zip(se, df)]
    return out


def _paired_canary_ratios(cells: pd.DataFrame, raw_canary: Mapping[str, list[np.ndarray]], level: float,
                          rounds: Mapping[str, Optional[Rounds]]) -> pd.DataFrame:
    """The paired step rows' canary columns from their pairs' step / canary: start pair by start
    pair (report/diff_canary.paired_canary_ratio) where both runs have them, round by round
    (rounds_canary_ratio) for a cell judged by paired rounds."""
    cells = cells.copy()
    for i in cells.index[(cells["quantity"] == GATED) & (cells["design"] == "paired")]:
        matched = rounds.get(str(cells.at[i, "base_run"]))
        if cells.at[i, "test"] == "sign" and matched is not None:
            cells.loc[i, list(CANARY_COLUMNS)] = rounds_canary_ratio(
                matched.base, matched.base_canary, matched.head, matched.head_canary, level, MIN_ROUNDS)
            continue
        base, head = raw_canary.get(str(cells.at[i, "base_run"])), raw_canary.get(str(cells.at[i, "head_run"]))
        if base is not None and head is not None:
            cells.loc[i, list(CANARY_COLUMNS)] = paired_canary_ratio(base, head, level)
    return cells


def geometric_mean(d: np.ndarray, se: np.ndarray, df: np.ndarray, level: float) -> tuple[float, float, float]:
    """The geometric mean of the cells' ratios and its CI: the mean log-ratio, its standard
    error from the cells' (independent) ones, Welch–Satterthwaite df."""
    keep = np.isfinite(d)
    if not keep.any():
        return math.nan, math.nan, math.nan
    d, se, df = d[keep], se[keep], df[keep]
    point = float(np.exp(d.mean()))
    if not np.isfinite(se).all():
        return point, math.nan, math.nan
    m = d.size
    low, high = S.ci(np.array(d.mean()), np.array(math.sqrt((se ** 2).sum()) / m),
                     S.satterthwaite(list((se / m) ** 2), list(df)), level)
    return point, float(low), float(high)


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


def rounds_geometric_mean(rows: pd.DataFrame, level: float) -> Optional[tuple[float, float, float, float]]:
    """The geometric mean of cells paired by rounds, with its CI over the shared rounds: the
    pairs of every cell of a group in round r ran in the same minute, so a spell that outlasts
    a round's two pairs but not the round hits the cells of that round together, and their
    d_{c,r} are not independent across cells; the rounds are. Per shared round (replicate,
    period, round) the mean over the cells of d_{c,r}, then the median of those per-round means
    with its order-statistic CI: (ratio, low, high, the CI's exact coverage). Only rounds every
    cell has count, so each per-round mean is over the same cells (a cell that stopped early
    would change what a round averages). None unless every row is paired by rounds with its
    shared rounds recorded and at least MIN_ROUNDS of them common to all."""
    if rows.empty or not (rows["test"] == "sign").all():
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


def _summary(rows: pd.DataFrame, options: DiffOptions) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for quantity in options.quantities:
        mine = rows[rows["quantity"] == quantity] if len(rows) else rows
        if mine.empty:
            continue
        stable = mine[~mine["unstable"]]
        tested = stable[stable["verdict"].notna()]
        by_rounds = rounds_geometric_mean(tested, options.level)
        gm, low, high = by_rounds[:3] if by_rounds else paired_geometric_mean(tested, options.level) or \
            geometric_mean(*(tested[c].to_numpy(float) for c in ("d", "se", "df")), options.level)
        everything = mine["ratio"][mine["ratio"] > 0].dropna()
        out[quantity] = {"geomean_ratio": gm, "ci_low": low, "ci_high": high,
                         # exact (order statistics) for cells paired by rounds; else the nominal level
                         "ci_coverage": by_rounds[3] if by_rounds else options.level, "cells": int(len(mine)),
                         "geomean_ratio_all": float(np.exp(np.log(everything).mean())) if len(everything) else math.nan,
                         "cells_in_geomean": int(len(tested)),
                         "judged": int(mine["verdict"].notna().sum()), "alpha": options.alpha,
                         "ci_source": ", ".join(sorted(set(mine["ci_source"]))),
                         "counts": {v: int((stable["verdict"] == v).sum()) for v in VERDICTS},
                         "no_verdict": int(stable["verdict"].isna().sum()),
                         "unstable": int(mine["unstable"].sum()),
                         "unstable_counts": {v: int((mine[mine["unstable"]]["verdict"] == v).sum()) for v in VERDICTS},
                         "mde_pct_median": float(mine["mde_pct"].median()) if mine["mde_pct"].notna().any()
                         else math.nan}
    return out


def with_replicates(base: pd.DataFrame, head: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Both sides with a `replicates` param (engine starts; absent means 1) when either has it,
    so a one-start side is never matched silently against a several-start one."""
    if "replicates" not in base and "replicates" not in head:
        return base, head
    fill = lambda f: f.assign(replicates=[text(v) or "1" for v in f.get("replicates", pd.Series([None] * len(f),  # noqa: E731
                                                                                               index=f.index))])
    return fill(base), fill(head)


def _failed_reasons(unmatched: pd.DataFrame, failed: Optional[pd.DataFrame], on: Sequence[str]) -> pd.DataFrame:
    """Base cells the head lacks: say so when the head has a FAILED run of the cell."""
    if failed is None or failed.empty or unmatched.empty:
        return unmatched
    on = [d for d in on if d in failed]  # the params a failed run logged (all, from a sweep)
    runs = {tuple(text(r.get(d)) for d in on): r.get("run_id") for r in failed.to_dict("records")}
    keys = [tuple(text(r.get(d)) for d in on) for r in unmatched.to_dict("records")]
    reasons = [f"head run {runs[k]} FAILED" if side == "base" and k in runs else why
               for k, side, why in zip(keys, unmatched["side"], unmatched["reason"])]
    return unmatched.assign(reason=reasons)


COLUMNS = ["cell", "quantity", "base", "head", "ratio", "ci_low", "ci_high", "verdict", "p_slower", "p_slower_holm",
           "p_faster", "p_faster_holm", "p_same", "mde_pct", "d", "se", "df", "ci_source", "design", "between",
           "starts_base",
           "starts_head", "unstable", "unstable_reasons", "stable_flag", "base_run", "head_run", "d_starts",
           "test", "ci_coverage", "rounds", "d_rounds"]


def _rounds_warnings(pairs: Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]],
                     rounds: Mapping[str, Optional[Rounds]], cells: pd.DataFrame, label_dims: Sequence[str],
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
    used = {r for r in cells.loc[cells["test"] == "sign", "base_run"].astype(str)}
    dropped = {run: m.dropped for run, m in rounds.items() if run in used and m is not None and m.dropped}
    if dropped:
        out.append(f"{sum(dropped.values())} round(s) of {len(dropped)} cell(s) paired by rounds left out: a step "
                   "not > 0 on a side")
    below = cells[(cells["test"] == "sign") & (cells["ci_coverage"] < level - 1e-12)]
    if len(below):
        out.append(f"{below['cell'].nunique()} cell(s) paired by rounds have too few rounds for a {level:.0%} CI: "
                   f"theirs cover {below['ci_coverage'].min():.1%} (order statistics, exact)")
    return out


def diff(base: pd.DataFrame, head: pd.DataFrame, raw: Mapping[str, RawPairs], options: DiffOptions,
         head_failed: Optional[pd.DataFrame] = None,
         raw_canary: Optional[Mapping[str, list[np.ndarray]]] = None,
         raw_rounds: Optional[Mapping[str, RawRounds]] = None) -> DiffResult:
    """Compare two sides' cells (one row per cell: its params, metrics, provenance tags,
    run_id, an optional `stable` and `unstable_reasons`); `raw` holds each run's timed step_ms
    pairs (one array, or one per engine start); head_failed the head's FAILED cell runs;
    raw_canary each run's step / canary per pair by start (diff.normalize=canary on paired cells);
    raw_rounds each run's pairs timed in paired rounds (record/read/sides.pairs_by_round)."""
    base, head = with_replicates(base, head)
    matched_on, differs, shared = dimensions(base, head)
    pairs, unmatched, warnings = match_cells(base, head, matched_on)
    unmatched = _failed_reasons(unmatched, head_failed, matched_on)
    label_dims = [d for d in matched_on if len({text(b.get(d)) for b, _ in pairs}) > 1] or \
        [d for d in ("batch", "ctx") if d in matched_on]  # one cell: still named b1-ctx128
    between = (between_component(base, options), between_component(head, options))
    raw_rounds = raw_rounds or {}
    rounds = {str(b.get("run_id")): match_rounds(raw_rounds.get(str(b.get("run_id"))),
                                                 raw_rounds.get(str(h.get("run_id")))) for b, h in pairs}
    rows = _cell_rows(pairs, raw, label_dims, options, between, rounds)
    cells = judge(pd.DataFrame(rows, columns=[c for c in COLUMNS if c not in ("verdict", "p_slower_holm",
                                                                              "p_faster_holm", "mde_pct")]
                               + list(label_dims)), options)
    cells = cells[COLUMNS + list(label_dims)]
    if not pairs:
        warnings.append("no cell of one side matches a cell of the other on " + (", ".join(matched_on) or "anything"))
    warnings += _rounds_warnings(pairs, rounds, cells, label_dims, options.level)
    two = cells[(cells["quantity"] == GATED) & (cells["test"] != "sign")
                & ((cells["starts_base"] == 2) | (cells["starts_head"] == 2))]
    if len(two):
        warnings.append(f"{len(two)} cell(s): {few_starts_warning(2)}")
    canaries = side_canary(base), side_canary(head)
    if options.normalize == "canary":
        cells = with_canary_ratios(cells, GATED, options.level, *canaries)
        cells = _paired_canary_ratios(cells, raw_canary or {}, options.level, rounds)
    sources = {"base": between[0].source, "head": between[1].source}
    floor = paired_noise_floor(pairs, raw, set(cells.loc[cells["test"] == "sign", "base_run"].astype(str)))
    result = DiffResult(options, matched_on, differs, shared, label_dims, cells, unmatched, warnings=warnings,
                        between=sources, machine=machine_line(*canaries),
                        canary_ms={name: c.ms if c else None for name, c in zip(("base", "head"), canaries)},
                        design=design_line(cells, sources), noise_floor_pct=floor.pct if floor else None,
                        noise_floor_df=floor.df if floor else 0.0,
                        against=text(pairs[0][0].get("pair_against")) if pairs and "pair_against" in matched_on else "")
    if options.normalize == "canary" and None in canaries:
        result.warnings.append("diff.normalize=canary: a side has fewer than 3 cells with a speed canary "
                               "(measured before the canary existed?): no normalized ratios")
    result.summary = _summary(cells, options)
    return result

