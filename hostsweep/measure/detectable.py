"""The minimum detectable effect of a cell (pure): the smallest slowdown a diff gate at level
alpha calls `slower` with the stated power (80 % by default), given the noise of the cell.

A diff (compare/stats.py) judges the log of head/base against a Student t reference:
under its default rule (`significant`) it calls `slower` when log(ratio) / se > q and the
ratio lies above 1 + threshold, q the one-sided quantile at alpha (alpha / cells, Bonferroni's
worst case of Holm's first step, when the gate judges `cells` cells); under `margin` when
(log(ratio) - log(1 + threshold)) / se > q. A true slowdown e is then found with probability
`power` when

    log(1 + e) = max(q * se, log(1 + threshold)) + z_power * se      (significant)
    log(1 + e) = log(1 + threshold) + (q + z_power) * se              (margin)

which is what minimum_detectable_effect_pct returns. Release owners read it to choose
diff.threshold_pct: a threshold below a cell's MDE asks for a change the study cannot see.
"""
from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING, Optional, Sequence

from scipy import stats

if TYPE_CHECKING:  # a cell is only read here
    from hostsweep.config.grid import Cell


def mde_from_se(se: float, df: float = math.inf, alpha: float = 0.05, cells: int = 1, power: float = 0.8,
                threshold_pct: float = 0.0, ci_level: float = 0.0, rule: str = "significant") -> float:
    """The MDE in % for a log-ratio with standard error se and df degrees of freedom; nan
    when se is not a finite non-negative number. q is the one-sided quantile at alpha / cells
    (Holm's first step; ci_level: the printed CI's two-sided quantile when that is larger).
    Under the `margin` rule the gate tests against the threshold (a shifted null), so the log
    ratio must clear log(1 + threshold) by q se: log(1 + mde) = log(1 + t) + (q + z) se. Under
    `significant` (compare/rules.py) it must clear q se (a real change) and its point
    log(1 + t): log(1 + mde) = max(q se, log(1 + t)) + z se."""
    if not (math.isfinite(se) and se >= 0) or not 0 < alpha < 1 or not 0 < power < 1 or cells < 1:
        return math.nan
    q = stats.t.isf(alpha / cells, df)
    if 0 < ci_level < 1:
        q = max(q, stats.t.ppf(0.5 + ci_level / 2, df))
    z = stats.t.ppf(power, df)
    bar = math.log1p(threshold_pct / 100) + q * se if rule == "margin" else max(q * se, math.log1p(threshold_pct / 100))
    return math.expm1(bar + z * se) * 100


def ci_target_for_mde(mde_pct: float, level: float, alpha: float = 0.05, power: float = 0.8) -> float:
    """The CI half-width (% of the median, at `level`, normal reference) at which a one-start
    cell's MDE is mde_pct (minimum_detectable_effect_pct with no between-start spread and no
    threshold, inverted): the target that measure.target_mde_pct hands the stop rule."""
    if not mde_pct > 0:
        raise ValueError(f"target_mde_pct must be > 0, got {mde_pct}")
    se = math.log1p(mde_pct / 100) / ((stats.norm.isf(alpha) + stats.norm.ppf(power)) * math.sqrt(2))
    # a CI of ±t around the median spans log((1 + t) / (1 - t)) = 2 atanh(t) on log scale
    return math.tanh(stats.norm.ppf(0.5 + level / 2) * se) * 100


def se_from_ci(step_ms: float, low_ms: float, high_ms: float, coverage: float, df: float = math.inf) -> float:
    """The standard error of log(step) implied by a two-sided CI of that coverage (a t
    reference with df degrees of freedom; infinite: normal)."""
    if not all(math.isfinite(v) and v > 0 for v in (step_ms, low_ms, high_ms)) or not 0 < coverage < 1:
        return math.nan
    return (math.log(high_ms) - math.log(low_ms)) / (2 * stats.t.ppf(0.5 + coverage / 2, df))


def minimum_detectable_effect_pct(step_ms: float, low_ms: float, high_ms: float, coverage: float = 0.95,
                                  ci_df: float = math.inf, between_start_pct: float = 0.0, alpha: float = 0.05,
                                  cells: int = 1, power: float = 0.8, threshold_pct: float = 0.0) -> float:
    """The smallest slowdown (%) of this cell a diff against a study of equal noise calls
    `slower` with probability `power` at level alpha: the cell's log-scale standard error
    from its CI (coverage, ci_df) plus a between-start spread (%, the standard deviation
    of the step from one engine start to the next, 0 when the CI already spans starts),
    doubled in variance for the two sides."""
    se = se_from_ci(step_ms, low_ms, high_ms, coverage, ci_df)
    between = math.log1p(max(between_start_pct, 0.0) / 100)
    # two sides of equal variance and ci_df each: Welch–Satterthwaite gives 2 * ci_df
    return mde_from_se(math.sqrt(2 * (se ** 2 + between ** 2)), 2 * ci_df, alpha, cells, power, threshold_pct)


def cell_mde_pct(step_ms: float, low_ms: float, high_ms: float, coverage: float, starts: int = 1,
                 period_medians_ms: Sequence[float] = (), replicate_step_ms: Optional[float] = None) -> float:
    """A measured cell's MDE (what cells.csv and summary.json report as mde_pct), at the gate's
    default level (alpha 0.05, one cell, 80 % power, no threshold). A CI over several engine
    starts is a t-interval with one df fewer than them, and already spans what changes between
    them. A one-start cell's CI holds within-start noise only (over several periods, plus their
    disagreement: measure/group.pooled_periods); it adds the spread the study
    shows of itself: the standard deviation of its period medians when it was timed in several
    periods, else what its replicate-first re-measure shows (|log(replicate / step)| / sqrt(2)),
    else nothing, and a diff widens it by the study's between-start component (docs/diff.md)."""
    df = starts - 1.0 if starts > 1 else math.inf
    between = 0.0
    logs = [math.log(m) for m in period_medians_ms if m > 0]
    if starts == 1 and len(logs) > 1:
        between = math.expm1(statistics.stdev(logs)) * 100
    elif starts == 1 and replicate_step_ms is not None and replicate_step_ms > 0 and step_ms > 0:
        between = math.expm1(abs(math.log(replicate_step_ms / step_ms)) / math.sqrt(2)) * 100
    return minimum_detectable_effect_pct(step_ms, low_ms, high_ms, coverage, df, between)


def stop_target(cell: Cell, level: float) -> float:
    """An adaptive cell's CI target: measure.target_ci_pct, or the CI that gives
    measure.target_mde_pct (measure/detectable.ci_target_for_mde)."""
    if cell.target_ci_pct is not None:
        return cell.target_ci_pct
    return ci_target_for_mde(cell.target_mde_pct, level)  # type: ignore[arg-type]
