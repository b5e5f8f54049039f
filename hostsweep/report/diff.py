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
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
import pandas as pd

from hostsweep.measure.detectable import mde_from_se, se_from_ci
from hostsweep.measure.intervals import few_starts_warning
from hostsweep.report import diff_stats as S
from hostsweep.report.diff_canary import (
    CANARY_COLUMNS, NORMALIZE, machine_line, paired_canary_ratio, side_canary, with_canary_ratios,
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
DESIGNS = ("paired", "sequential")  # a cell's design: both sides in one sweep, starts alternated; or measured apart
SIDES = ("a", "b")  # a paired study's sides (param `side`): a the study as given, b with pair.against
# Reasons that do not touch the step's own number: a cell unstable only for these is judged
# as stable on step_ms (its host_ms stays unstable).
NOT_STEP_REASONS = frozenset({"split_impossible", "split_implausible"})
RawPairs = Union[np.ndarray, Sequence[np.ndarray]]  # one start's pairs, or one array per start


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
    if (text(base.get("side")), text(head.get("side"))) != SIDES:
        return 0
    parent = text(base.get("parent_run_id"))
    if not parent or parent != text(head.get("parent_run_id")) or groups[0] is None or groups[1] is None:
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


def compare_quantity(quantity: str, base: Mapping[str, Any], head: Mapping[str, Any],
                     raw_base: Optional[RawPairs], raw_head: Optional[RawPairs], options: DiffOptions,
                     between: tuple[Between, Between] = (Between(math.nan, 0.0, "none"),) * 2) -> Compared:
    """The ratio head/base of one quantity of a matched cell, with its log-scale test inputs."""
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
    """Whether either side is unstable for its step: a cell flagged only split_impossible is
    not (its step is fine; the split is what failed)."""
    for flag, why in zip(flags, reasons):
        named = {r.strip() for r in why.split(",") if r.strip()}
        if flag is False and (not named or named - NOT_STEP_REASONS):
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


def paired_noise_floor(pairs: Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]], raw: Mapping[str, RawPairs]
                       ) -> Optional[NoiseFloor]:
    """The machine's between-start spread from the paired cells, flagged ones included (what
    flagged them is the machine's noise too: leaving them out would state a floor lower than
    the machine's, and a low floor lets a sequential gate's false alarms through); None when
    none is paired."""
    variances, dfs, cells = [], [], 0
    for b, h in pairs:
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


def design_line(cells: pd.DataFrame, between: Mapping[str, str]) -> str:
    """How the compared cells were measured, in one line: paired (k start pairs, ABBA in one
    sweep), sequential (two studies measured apart, and what widens a one-start side), or
    how many of each."""
    rows = cells[cells["quantity"] == GATED] if len(cells) else cells
    if rows.empty:
        return "no matched cell"
    paired, sequential = rows[rows["design"] == "paired"], rows[rows["design"] != "paired"]
    ks = "/".join(str(k) for k in sorted({int(k) for k in paired["starts_base"]}))
    paired_text = f"{ks} start pairs per cell, sides alternated ABBA in one sweep"
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
    if sequential.empty:
        return f"paired: {paired_text}"
    if paired.empty:
        return f"sequential: {seq_text}"
    return f"mixed: {len(paired)} cell(s) paired ({paired_text}), {len(sequential)} sequential ({seq_text})"


def _unmatched_label(row: Mapping[str, Any], dims: Sequence[str]) -> str:
    return cell_label(row, [d for d in dims if d in row] or [d for d in ("batch", "ctx") if d in row])


def _side_flags(b: Mapping[str, Any], h: Mapping[str, Any]) -> tuple[tuple, tuple[str, str]]:
    flags = (stable_flag(b.get("stable")), stable_flag(h.get("stable")))
    return flags, (text(b.get("unstable_reasons")), text(h.get("unstable_reasons")))


def _cell_rows(pairs: list[tuple[dict, dict]], raw: Mapping[str, RawPairs], label_dims: Sequence[str],
               options: DiffOptions, between: tuple[Between, Between]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for b, h in pairs:
        flags, reasons = _side_flags(b, h)
        for quantity in options.quantities:
            if _finite(b, quantity) is None and _finite(h, quantity) is None:
                continue  # neither cell has it (no split, no phases)
            c = compare_quantity(quantity, b, h, raw.get(str(b.get("run_id"))), raw.get(str(h.get("run_id"))),
                                 options, between)
            # A paired step's CI comes from its start pairs, over whatever the machine did between
            # them: what makes one side's cell unstable (drift, machine speed, a wide CI) is inside
            # it, so the paired verdict stands on its CI; the reasons stay listed.
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
                         **{d: b.get(d) for d in label_dims}})
    return rows


def judge(cells: pd.DataFrame, options: DiffOptions) -> pd.DataFrame:
    """p-values, Holm over each quantity's tested cells, verdicts, CIs and the MDE per row."""
    out = cells.copy()
    for column in ("p_slower", "p_faster", "p_same", "p_slower_holm", "p_faster_holm", "ci_low", "ci_high",
                   "mde_pct"):
        out[column] = math.nan
    out["verdict"] = None
    for quantity in out["quantity"].unique() if len(out) else []:
        mine = (out["quantity"] == quantity) & out["se"].notna() & (out["se"] > 0)
        if not mine.any():
            continue
        d, se, df = (out.loc[mine, c].to_numpy(float) for c in ("d", "se", "df"))
        slower, faster, same = S.pvalues(d, se, df, options.threshold_pct)
        low, high = S.ci(d, se, df, options.level)
        m = int(mine.sum())
        out.loc[mine, ["p_slower", "p_faster", "p_same", "p_slower_holm", "p_faster_holm", "ci_low", "ci_high"]] = \
            np.column_stack([slower, faster, same, S.holm(slower), S.holm(faster), low, high])
        out.loc[mine, "verdict"] = S.verdicts(d, out.loc[mine, "p_slower_holm"].to_numpy(float),
                                              out.loc[mine, "p_faster_holm"].to_numpy(float), same,
                                              options.alpha, options.threshold_pct)
        out.loc[mine, "mde_pct"] = [mde_from_se(e, f, options.alpha, m, threshold_pct=options.threshold_pct)
                                    for e, f in zip(se, df)]
    return out


def _paired_canary_ratios(cells: pd.DataFrame, raw_canary: Mapping[str, list[np.ndarray]], level: float
                          ) -> pd.DataFrame:
    """The paired step rows' canary columns from their pairs' step / canary, start pair by
    start pair (report/diff_canary.paired_canary_ratio), where both runs have them."""
    cells = cells.copy()
    for i in cells.index[(cells["quantity"] == GATED) & (cells["design"] == "paired")]:
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


def _summary(rows: pd.DataFrame, options: DiffOptions) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for quantity in options.quantities:
        mine = rows[rows["quantity"] == quantity] if len(rows) else rows
        if mine.empty:
            continue
        stable = mine[~mine["unstable"]]
        tested = stable[stable["verdict"].notna()]
        gm, low, high = paired_geometric_mean(tested, options.level) or \
            geometric_mean(*(tested[c].to_numpy(float) for c in ("d", "se", "df")), options.level)
        everything = mine["ratio"][mine["ratio"] > 0].dropna()
        out[quantity] = {"geomean_ratio": gm, "ci_low": low, "ci_high": high, "cells": int(len(mine)),
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
           "starts_head", "unstable", "unstable_reasons", "stable_flag", "base_run", "head_run", "d_starts"]


def diff(base: pd.DataFrame, head: pd.DataFrame, raw: Mapping[str, RawPairs], options: DiffOptions,
         head_failed: Optional[pd.DataFrame] = None,
         raw_canary: Optional[Mapping[str, list[np.ndarray]]] = None) -> DiffResult:
    """Compare two sides' cells (one row per cell: its params, metrics, provenance tags,
    run_id, an optional `stable` and `unstable_reasons`); `raw` holds each run's timed step_ms
    pairs (one array, or one per engine start); head_failed the head's FAILED cell runs;
    raw_canary each run's step / canary per pair by start (diff.normalize=canary on paired cells)."""
    base, head = with_replicates(base, head)
    matched_on, differs, shared = dimensions(base, head)
    pairs, unmatched, warnings = match_cells(base, head, matched_on)
    unmatched = _failed_reasons(unmatched, head_failed, matched_on)
    label_dims = [d for d in matched_on if len({text(b.get(d)) for b, _ in pairs}) > 1] or \
        [d for d in ("batch", "ctx") if d in matched_on]  # one cell: still named b1-ctx128
    between = (between_component(base, options), between_component(head, options))
    rows = _cell_rows(pairs, raw, label_dims, options, between)
    cells = judge(pd.DataFrame(rows, columns=[c for c in COLUMNS if c not in ("ci_low", "ci_high", "verdict")
                                              and not c.startswith(("p_", "mde"))] + list(label_dims)), options)
    cells = cells[COLUMNS + list(label_dims)]
    if not pairs:
        warnings.append("no cell of one side matches a cell of the other on " + (", ".join(matched_on) or "anything"))
    two = cells[(cells["quantity"] == GATED) & ((cells["starts_base"] == 2) | (cells["starts_head"] == 2))]
    if len(two):
        warnings.append(f"{len(two)} cell(s): {few_starts_warning(2)}")
    canaries = side_canary(base), side_canary(head)
    if options.normalize == "canary":
        cells = with_canary_ratios(cells, GATED, options.level, *canaries)
        cells = _paired_canary_ratios(cells, raw_canary or {}, options.level)
    sources = {"base": between[0].source, "head": between[1].source}
    floor = paired_noise_floor(pairs, raw)
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

