"""One engine group's timed measurement as the worker builds it (pure): each cell's pairs
over the group's periods, its estimate on the common clean rounds, its stability verdict,
and which of the engine's speculation counts belong to the reported pairs. The worker
(run/worker.py) times the pairs; this is what it makes of them (measure/periods.py says
what periods, clean rounds and the canary are).

A re-measure times the whole group again, in a period of its own: a cell re-timed alone
would be compared with companions timed in another period, on what may be another
machine. Every pair is kept; a cell's number is the mean of its periods' medians (each
holds the same rounds of every cell, so each weighs the same: pooled_periods), and how far
the periods lay apart is reported and flagged beside it (measure/periods.py). A CI wider
than measure.max_ci_pct is flagged, not chased, unless measure.remeasure_ci_width asks for
a period when one is forecast to cure it: where the machine's speed wanders over a period's
rounds, a second period doubled the group's pairs and its CIs came out no narrower (the log
line names the cells and about how many pairs would narrow them if the noise were the
pairs' own).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
from scipy import stats


from hostsweep.config.grid import Cell
from hostsweep.measure.periods import (
    DesignRecord, ProfiledPair, by_period, canary_shift_pct, clean_pairs, common_period_ratios, common_shift_pct,
    common_trend, contended_rounds, median_canary_ms, period_disagrees, period_medians_ms, relative_to_companions,
)
from hostsweep.measure.canary_tracking import group_tracking
from hostsweep.measure.protocol import CellMeasurement, RepTiming, adaptive_looks, summarize
from hostsweep.measure.results import MeasureOptions, stability_rules_of
from hostsweep.measure.speculative import SpecResult, spec_summary
from hostsweep.measure.stability import Stability, contention_summary, drifted, replicate_disagrees, timing_reasons
from hostsweep.measure.trend import stepped

# What a new period can cure: noise and a neighbour. A split (split_*) is not re-timed
# away, and what the whole group met (the annotations) is no cell's flag to cure.
REMEASURE_REASONS = ("foreign_cpu", "ci_width", "drift")


@dataclass(frozen=True)
class TimedCell:
    """A cell's timed pairs, summarized and judged: measured with its group's other cells in
    interleaved rounds, kept until the dispatcher asks for the cell."""

    prompts: list[list[int]]
    measurement: CellMeasurement
    spec: Optional[SpecResult]
    stability: Stability
    earlier: tuple[tuple[RepTiming, ...], ...]  # pairs of attempts replaced (none: periods are pooled)
    started_at: float  # epoch seconds: when the group's measurement began
    profiled: tuple[ProfiledPair, ...] = ()  # the split's pairs, taken in the group's rounds
    traces: Optional[dict[str, bytes]] = None  # their trace files, when split.keep_traces
    profile_error: Optional[str] = None  # why profiling the cell failed (the cell fails with it)


class GroupMeasurement:
    """A group's timed measurement as it is built: each cell's pairs over the periods, its
    estimate, verdict and design record, and which of its speculation counts are reported."""

    def __init__(self, cells: Sequence[Cell], prompts: list[list[list[int]]], options: MeasureOptions) -> None:
        self.cells, self.prompts, self.options = cells, prompts, options
        self.started_at = time.time()
        self.spec_logs: list[list[list[dict]]] = [[] for _ in cells]
        self.generates: list = []
        self.final_from = [0] * len(cells)
        self.timings: list[tuple[RepTiming, ...]] = [()] * len(cells)  # every period's pairs
        self.summaries: list[Optional[CellMeasurement]] = [None] * len(cells)
        self.verdicts: list[Stability] = [Stability()] * len(cells)
        self.annotations: set[str] = set()  # what the whole group met (stability.ANNOTATIONS)
        # why each period after the first was taken: the rules it was to cure, '+'-joined
        self.remeasured_for: list[str] = []
        self.warmup_rounds = 0  # the untimed rounds the group warmed up in (measure/warmup.py)
        self.profiled: list[list[ProfiledPair]] = [[] for _ in cells]
        self.traces: list[Optional[dict[str, bytes]]] = [{} if options.split.keep_traces else None for _ in cells]
        self.profile_errors: list[Optional[str]] = [None] * len(cells)
        self.replicate_step_ms: Optional[float] = None
        # cells whose drift holds at the group's family-wise level: what a new period is for
        self.drift_across_group: frozenset[int] = frozenset()

    @property
    def periods(self) -> int:
        return 1 + max((p.period for pairs in self.timings for p in pairs), default=-1)

    def _summary(self, i: int, pairs: Sequence[RepTiming]) -> CellMeasurement:
        """The cell's step from these pairs: in one period, their median with its
        order-statistic CI (at the adaptive looks' level for an adaptive cell); over several,
        the periods pooled (pooled_periods)."""
        c, level = self.cells[i], self.options.measure.ci_level
        parts = by_period(pairs)
        target = c.target_ci_pct if c.target_ci_pct is not None else c.target_mde_pct  # only set-or-not counts
        looks = adaptive_looks(target, c.min_reps, c.reps)
        if len(parts) < 2:
            return summarize(pairs, level, looks)
        return pooled_periods(parts, level, looks)

    def take_period(self, timings: Sequence[Sequence[RepTiming]]) -> None:
        """One period's pairs of every cell of the group (in cell order): tagged with the
        period, added to the cell's earlier periods, and every cell estimated and judged anew."""
        period = self.periods
        for i, pairs in enumerate(timings):
            self.timings[i] += tuple(dataclasses.replace(p, period=period) for p in pairs)
        self._estimate()

    def _estimate(self) -> None:
        m = self.options.measure
        rules = stability_rules_of(self.options)
        contended = contended_rounds(self.timings, m.max_foreign_cpu_frac)
        shift = canary_shift_pct(p for pairs in self.timings for p in pairs)
        common = common_period_ratios(self.timings)
        cleans = [clean_pairs(pairs, contended) for pairs in self.timings]
        useds = [clean if clean is not None else pairs for clean, pairs in zip(cleans, self.timings)]
        # Drift is judged against the companions timed in the same rounds: every cell moving
        # together is the group's (an annotation), one cell moving against the others is the
        # cell's (drift). A group of one has no companions.
        moved_alone = frozenset(i for i, judged in enumerate(relative_to_companions(useds))
                                if judged is not None and any(drifted(part, rules) for part in by_period(judged)))
        # judged again without them: a cell that moved alone leaks into its companions' median
        relative = relative_to_companions(useds, moved_alone)
        trend = common_trend(useds)
        moved_together = common_shift_pct(trend)
        self._annotate(shift, trend, moved_together)
        # Each cell's drift is flagged at 1 - ci_level; timing the whole group again because
        # one of its cells drifted asks whether any did, which at that level alone would send
        # a steady group of six cells to a second period one time in four. Bonferroni over
        # the group's cells (for "any", the same decision as Holm's) holds that to 1 - ci_level.
        strict = dataclasses.replace(rules, level=1.0 - (1.0 - rules.level) / len(self.cells))
        self.drift_across_group = frozenset(
            i for i, (judged, used) in enumerate(zip(relative, useds))
            if any(drifted(part, strict) for part in by_period(judged if judged is not None else used)))
        tracked = group_tracking(self.timings)
        for i, (pairs, clean, used) in enumerate(zip(self.timings, cleans, useds)):
            summary = self._summary(i, used)
            reasons = {r for part in by_period(used) for r in timing_reasons(part, summary, rules, False)} - {"ci_width"}
            reasons |= set(timing_reasons(used, summary, rules, False)) & {"ci_width"}
            judged = relative[i] if relative[i] is not None else used
            if any(drifted(part, rules) for part in by_period(judged)):
                reasons.add("drift")
            if clean is None:
                reasons.add("foreign_cpu")
            if period_disagrees(used, common, m.min_shift_pct, m.ci_level):
                reasons.add("period")
            self.summaries[i] = dataclasses.replace(summary, reps=pairs)  # every pair kept, flagged or not
            design = DesignRecord(self.periods, period_medians_ms(used), len(used), len(contended),
                                  median_canary_ms(pairs), shift, moved_together, median_canary_ms(pairs, gpu=True),
                                  tuple(self.remeasured_for), self.warmup_rounds,
                                  tracked.r if tracked else None, tracked.explained_pct if tracked else None)
            self.verdicts[i] = self._verdict(reasons | self.annotations, used, design)

    def _annotate(self, canary_shift: Optional[float], trend: Optional[Sequence[RepTiming]],
                  moved_together: Optional[float]) -> None:
        """The group's annotations: the canary moved beyond measure.max_canary_shift_pct
        (machine_speed: the host), or, with the canary held, the cells' common speed stepped
        between the halves of a period (group_trend: measure/trend.py, at the drift rule's
        level, and by more than measure.min_shift_pct). A re-measure keeps what an earlier
        period found."""
        m = self.options.measure
        if canary_shift is not None and canary_shift > m.max_canary_shift_pct:
            self.annotations.add("machine_speed")
            return
        if trend is None or moved_together is None or moved_together <= m.min_shift_pct:
            return
        alpha = 1.0 - m.ci_level
        if any(stepped([p.step_s for p in sorted(part, key=lambda p: p.round)], alpha) for part in by_period(trend)):
            self.annotations.add("group_trend")

    def _verdict(self, reasons: set[str], used: Sequence[RepTiming], design: DesignRecord) -> Stability:
        verdict = Stability(attempts=self.periods, contention=contention_summary(used),
                            replicate_step_ms=self.replicate_step_ms, design=design)
        for reason in sorted(reasons):
            verdict = verdict.with_reason(reason)
        return verdict

    def replicate(self, pairs: Sequence[RepTiming]) -> None:
        """The first cell timed again after the rounds: if it disagrees with itself, the host
        changed during the group, which every cell of it met (`replicate`, kept by later periods)."""
        again = summarize(pairs, self.options.measure.ci_level)
        self.replicate_step_ms = again.step_ms
        m = self.options.measure
        first = summarize([p for p in self.timings[0] if p.period == 0], m.ci_level)
        if replicate_disagrees(first, again, m.min_shift_pct, m.ci_level):
            self.annotations.add("replicate")
        self._estimate()

    def needs_another_period(self) -> bool:
        """Whether a cell broke a rule a new period of the whole group could cure: a neighbour
        (foreign_cpu), a cell moving against its companions (drift, at the group's
        family-wise level: drift_across_group), or, with measure.remeasure_ci_width, a CI
        that the periods left would bring within measure.max_ci_pct (ci_width: wider than
        that, another period costs the group's pairs again and leaves the cell flagged;
        too_wide_to_cure)."""
        return bool(self.curable_reasons())

    def curable_reasons(self) -> list[str]:
        """The rules (REMEASURE_REASONS order) for which some cell would be timed again."""
        found = {r for i in range(len(self.cells)) for r in self._curable(i)}
        return [r for r in REMEASURE_REASONS if r in found]

    def note_remeasure(self) -> str:
        """Records why the next period is taken (what the design line and summary say) and
        returns it: the rules to cure, '+'-joined."""
        why = "+".join(self.curable_reasons())
        self.remeasured_for.append(why)
        return why

    def remeasure_detail(self, limit: int = 4) -> str:
        """The cells a new period is for, with what it is to cure: 'b1 ctx128 ci_width ±11.2 %, ...'."""
        named = []
        for i, cell in enumerate(self.cells):
            curable = self._curable(i)
            if not curable:
                continue
            summary = self.summaries[i]
            width = f" ±{summary.ci_half_width_pct:.1f} %" if "ci_width" in curable and summary is not None else ""
            named.append(f"b{cell.batch} ctx{cell.ctx} {'+'.join(sorted(curable))}{width}")
        return ", ".join(named[:limit]) + (", …" if len(named) > limit else "")

    def _curable(self, i: int) -> set[str]:
        """The rules cell i broke that a new period of the group could cure."""
        reasons = set(self.verdicts[i].reasons) & set(REMEASURE_REASONS)
        curable = reasons & {"foreign_cpu"}
        if "drift" in reasons and i in self.drift_across_group:
            curable.add("drift")
        if "ci_width" in reasons and self.options.measure.remeasure_ci_width and self._ci_within_reach(i):
            curable.add("ci_width")
        return curable

    def _ci_within_reach(self, i: int) -> bool:
        """Whether the periods measure.remeasure_unstable still allows (at least one: the
        forecast of what one more would do is reported even when none is left) are forecast
        to bring cell i's CI within measure.max_ci_pct (half_width_after)."""
        m, summary = self.options.measure, self.summaries[i]
        left = max(1, m.remeasure_unstable - (self.periods - 1))
        return summary is not None and half_width_after(summary.ci_half_width_pct, self.periods, left) <= m.max_ci_pct

    def too_wide_to_cure(self) -> list[tuple[Cell, float, int]]:
        """The cells left flagged ci_width (all of them unless measure.remeasure_ci_width;
        with it, those the periods measure.remeasure_unstable still allows, one when none is
        left, would not bring within measure.max_ci_pct), each with its half-width (%) and
        about how many pairs in one period would (pairs_for_half_width)."""
        target = self.options.measure.max_ci_pct
        return [(cell, summary.ci_half_width_pct, pairs_for_half_width(summary.ci_half_width_pct, len(summary.reps),
                                                                        target))
                for i, (cell, summary, verdict) in enumerate(zip(self.cells, self.summaries, self.verdicts))
                if summary is not None and "ci_width" in verdict.reasons
                and not (self.options.measure.remeasure_ci_width and self._ci_within_reach(i))]

    def mark_attempt(self, which: Sequence[int]) -> None:
        for i in which:  # the speculation counts from here on are the reported ones
            self.final_from[i] = len(self.spec_logs[i])

    def timed_cells(self) -> dict[str, "TimedCell"]:
        timed_s = time.time() - self.started_at
        cells = {}
        for i, cell in enumerate(self.cells):
            start = self.final_from[i]
            spec = spec_summary(self.spec_logs[i][start:start + len(self.timings[i])], cell.T)
            cells[cell.key] = TimedCell(self.prompts[i], dataclasses.replace(self.summaries[i], timed_s=timed_s),
                                        spec, self.verdicts[i], (), self.started_at, tuple(self.profiled[i]),
                                        self.traces[i], self.profile_errors[i])
        return cells


def half_width_after(half_width_pct: float, periods: int, more: int = 1) -> float:
    """What a cell's CI half-width is expected to be once `more` periods like the others are
    pooled with its `periods` (pooled_periods: the mean of the periods' medians, whose
    standard error falls as 1 / sqrt(periods) when each period is as noisy as the others)."""
    return half_width_pct * float(np.sqrt(periods / (periods + float(more))))


def pairs_for_half_width(half_width_pct: float, pairs: int, target_pct: float) -> int:
    """About how many pairs in one period would give a half-width of target_pct where
    `pairs` gave half_width_pct (a median's CI narrows as 1 / sqrt(pairs))."""
    return int(np.ceil(pairs * (half_width_pct / target_pct) ** 2))


# A period is pooled as its own estimate from this many pairs: the fewest whose order-statistic
# CI of the median reaches 95 % ([min, max] of 6 covers 96.9 %), so its standard error means
# something; a period with fewer is pooled into the order-statistic CI over all the pairs.
MIN_PERIOD_PAIRS = 6


def between_period_variance(medians: Sequence[float], ses: Sequence[float]) -> float:
    """The between-period variance tau^2 of the periods' medians (ms^2), by the
    DerSimonian–Laird moment estimator: what their spread holds beyond their own standard
    errors; 0 when the periods agree within them."""
    m, se = np.asarray(medians, float), np.asarray(ses, float)
    if m.size < 2 or not (np.isfinite(se).all() and (se > 0).all()):
        return 0.0
    w = 1.0 / se ** 2
    centre = float((w * m).sum() / w.sum())
    q = float((w * (m - centre) ** 2).sum())
    scale = float(w.sum() - (w ** 2).sum() / w.sum())
    return max(0.0, (q - (m.size - 1)) / scale) if scale > 0 else 0.0


def pooled_periods(parts: Sequence[Sequence[RepTiming]], level: float, looks: Sequence[int] = ()) -> CellMeasurement:
    """A cell measured in several periods of its group: the mean of the periods' medians,
    each period weighing the same (each holds the same rounds of every cell, so ratios
    between cells keep the periods' ratios), with a random-effects CI: each period's standard
    error from its own median CI (its half-width over z, at the adaptive looks' level for an
    adaptive cell, as its stop rule took it), plus the between-period variance when the
    periods disagree beyond those (between_period_variance). So the CI is for the cell's step,
    not only for the moments measured: with a between-period shift the fixed-effects CI
    (tau left out) covered the step 84 / 53 / 30 % of the time at tau 2 / 5 / 10 %
    (tests/unit/test_periods.py measures both).

    How far the periods lay apart is reported beside it (period_medians_ms, period_spread_pct),
    flagged when one cell moved alone (`period`), annotated when the canary moved
    (`machine_speed`). A period of fewer than MIN_PERIOD_PAIRS pairs has no standard error
    worth reading: then the order-statistic CI over all the pairs is what is said.
    (The median of all pairs pooled sits in the gap between two periods' clusters when the
    machine changed speed, and a t-interval over two period medians has one degree of
    freedom: 12.7 times their spread wide, true to no question a user asks of one study.)"""
    z = float(stats.norm.ppf(0.5 + level / 2.0))
    summaries = [summarize(part, level, looks) for part in parts]
    every = [p for part in parts for p in part]
    if any(len(part) < MIN_PERIOD_PAIRS or not 0.0 < m.ci_coverage < 1.0 for part, m in zip(parts, summaries)):
        return dataclasses.replace(summarize(every, level), reps=tuple(every))
    point = float(np.mean([m.step_ms for m in summaries]))
    # each period's CI read at the coverage it has (an order-statistic CI's is above the level)
    ses = [(m.step_ci_high_ms - m.step_ci_low_ms) / (2.0 * stats.norm.ppf(0.5 + m.ci_coverage / 2)) for m in summaries]
    tau2 = between_period_variance([m.step_ms for m in summaries], ses)
    se = float(np.sqrt(sum(s ** 2 + tau2 for s in ses))) / len(summaries)
    return CellMeasurement(step_ms=point, step_ci_low_ms=point - z * se, step_ci_high_ms=point + z * se,
                           wall_1_ms=float(np.median([p.wall_1_s for p in every]) * 1e3),
                           wall_T_ms=float(np.median([p.wall_T_s for p in every]) * 1e3),
                           reps=tuple(every), ci_coverage=level)
