"""Two sides of measured cells compared cell by cell (pure): what differs between them,
which cells match, and per matched cell and quantity the ratio head/base with a CI, the
p-values behind its verdict, its minimum detectable effect, and the release gate.

The rules, in one place (the statistics in compare/stats.py):
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
- Verdicts, with t = threshold_pct/100, at alpha, under diff.rule (compare/rules.py): with
  `significant` (the default) `slower` when the one-sided test of head > base against no change,
  Holm over the cells judged, rejects at alpha and the ratio lies above 1 + t; with `margin`
  when the test of ratio <= 1 + t does. Each verdict is read from the row's verdict interval
  (verdict_low, verdict_high: one-sided bounds at the level Holm tested the cell at), so what is
  printed says the verdict. `faster` the mirror; `same` when the equivalence test (TOST) at ±t
  rejects at alpha and the printed CI lies inside the band; else `inconclusive`. No resampling:
  no seed decides a verdict.
- The gate (fail_on): fails on every step_ms cell judged slower, stable or not; on an
  unstable cell slower on its own one-sided test at alpha, without Holm; on base cells the
  head lacks or whose head run FAILED. `split_impossible` alone never makes step_ms unstable.
  slower_overall fails when the geometric mean is slower under the rule. Either refuses (exit
  2) when a gated cell has no test or an MDE above diff.max_mde_factor x t (result.refusal).

The package, one module per job: match (which cells pair up), sequential (two studies measured
apart), start_pairs (paired engine starts), rounds (paired rounds), verdicts (p-values, Holm,
verdicts, MDE), rules (what slower means, the verdict interval), result (the gate), summary (the design line and geometric means), canary (the
machines compared); stats holds the vectorized statistics the calibration replays.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import pandas as pd

from hostsweep.compare.canary import (machine_line, paired_canary_ratios, side_canary, side_tracking, tracking_line,
                                      with_canary_ratios)
from hostsweep.compare.match import (cell_label, dimensions, match_cells, text, with_failed_reasons,
                                     with_replicates)
from hostsweep.compare.options import (GATED, MIN_ROUNDS, DiffOptions, RawPairs, RawRounds, by_rounds, finite_value,
                                       stable_flag, step_unstable)
from hostsweep.compare.quantity import Compared, paired_sides
from hostsweep.compare.result import DiffResult
from hostsweep.compare.rounds import MatchedRounds, match_rounds, rounds_compared, rounds_warnings
from hostsweep.compare.sequential import Between, between_component, sequential_compared, starts_of
from hostsweep.compare.start_pairs import paired_noise_floor, paired_starts, start_pairs_compared
from hostsweep.compare.summary import comparison_design, summarize_quantities
from hostsweep.compare.verdicts import judge_cells
from hostsweep.config.grid import engine_label
from hostsweep.measure.canary_tracking import TRACKS_EXPLAINED_PCT
from hostsweep.measure.intervals import few_starts_warning


def compare_quantity(quantity: str, base: Mapping[str, Any], head: Mapping[str, Any],
                     raw_base: Optional[RawPairs], raw_head: Optional[RawPairs], options: DiffOptions,
                     between: tuple[Between, Between] = (Between(math.nan, 0.0, "none"),) * 2,
                     rounds: Optional[MatchedRounds] = None) -> Compared:
    """The ratio head/base of one quantity of a matched cell, with its log-scale test inputs.
    rounds: the cell's pairs matched by paired round (match_rounds); a paired cell with at least
    MIN_ROUNDS of them is judged over its rounds, else as before."""
    if rounds is not None and rounds.n >= MIN_ROUNDS and paired_sides(base, head):
        return rounds_compared(quantity, base, head, rounds, options)
    groups = starts_of(raw_base), starts_of(raw_head)
    k = paired_starts(base, head, groups)
    if k:
        return start_pairs_compared(quantity, base, head, groups, k)  # type: ignore[arg-type]
    return sequential_compared(quantity, base, head, groups, between, options.level)


def _side_flags(b: Mapping[str, Any], h: Mapping[str, Any]) -> tuple[tuple, tuple[str, str]]:
    flags = (stable_flag(b.get("stable")), stable_flag(h.get("stable")))
    return flags, (text(b.get("unstable_reasons")), text(h.get("unstable_reasons")))


def _cell_rows(pairs: list[tuple[dict, dict]], raw: Mapping[str, RawPairs], label_dims: Sequence[str],
               options: DiffOptions, between: tuple[Between, Between],
               rounds: Mapping[str, Optional[MatchedRounds]]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for b, h in pairs:
        flags, reasons = _side_flags(b, h)
        for quantity in options.quantities:
            if finite_value(b, quantity) is None and finite_value(h, quantity) is None:
                continue  # neither cell has it (no split, no phases)
            c = compare_quantity(quantity, b, h, raw.get(str(b.get("run_id"))), raw.get(str(h.get("run_id"))),
                                 options, between, rounds.get(str(b.get("run_id"))))
            # A paired step's CI comes from its start pairs (or rounds), over whatever the machine
            # did between them: what makes one side's cell unstable (drift, machine speed, a wide
            # CI) is inside it, so the paired verdict stands on its CI; the reasons stay listed.
            unstable = (c.design != "paired" and step_unstable(flags, reasons)) if quantity == GATED \
                else False in flags
            rows.append({"cell": cell_label(b, label_dims), "quantity": quantity, "base": finite_value(b, quantity),
                         "head": finite_value(h, quantity), "ratio": c.ratio, "d": c.d, "se": c.se, "df": c.df,
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
                         "note": c.note, "between_var": c.between_var, "engine": engine_label(b),
                         **{d: b.get(d) for d in label_dims}})
    return rows


COLUMNS = ["cell", "quantity", "base", "head", "ratio", "ci_low", "ci_high", "verdict_low", "verdict_high", "verdict",
           "verdict_alpha", "p_slower", "p_slower_holm",
           "p_faster", "p_faster_holm", "p_same", "mde_pct", "d", "se", "df", "ci_source", "design", "between",
           "starts_base",
           "starts_head", "unstable", "unstable_reasons", "stable_flag", "base_run", "head_run", "d_starts",
           "test", "ci_coverage", "rounds", "d_rounds", "note", "between_var", "engine"]

# what judge_cells adds to a row
JUDGED_COLUMNS = ("verdict", "p_slower_holm", "p_faster_holm", "mde_pct", "verdict_low", "verdict_high", "verdict_alpha")


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
    unmatched = with_failed_reasons(unmatched, head_failed, matched_on)
    label_dims = [d for d in matched_on if len({text(b.get(d)) for b, _ in pairs}) > 1] or \
        [d for d in ("batch", "ctx") if d in matched_on]  # one cell: still named b1-ctx128
    between = (between_component(base, options), between_component(head, options))
    raw_rounds = raw_rounds or {}
    rounds = {str(b.get("run_id")): match_rounds(raw_rounds.get(str(b.get("run_id"))),
                                                 raw_rounds.get(str(h.get("run_id")))) for b, h in pairs}
    rows = _cell_rows(pairs, raw, label_dims, options, between, rounds)
    cells = judge_cells(pd.DataFrame(rows, columns=[c for c in COLUMNS if c not in JUDGED_COLUMNS]
                               + list(label_dims)), options)
    cells = cells[COLUMNS + list(label_dims)]
    if not pairs:
        warnings.append("no cell of one side matches a cell of the other on " + (", ".join(matched_on) or "anything"))
    warnings += rounds_warnings(pairs, rounds, cells, label_dims, options.level)
    two = cells[(cells["quantity"] == GATED) & ~by_rounds(cells)
                & ((cells["starts_base"] == 2) | (cells["starts_head"] == 2))]
    if len(two):
        warnings.append(f"{len(two)} cell(s): {few_starts_warning(2)}")
    canaries = side_canary(base), side_canary(head)
    tracked = side_tracking(base), side_tracking(head)
    # normalized ratios only where the canary tracks what moved the engine (or was not measured)
    untracked = [f"{name} {t:.0f} %" for name, t in zip(("base", "head"), tracked)
                 if t is not None and t < TRACKS_EXPLAINED_PCT]
    if options.normalize == "canary" and untracked:
        warnings.append(f"diff.normalize=canary: the canary explains only {', '.join(untracked)} of the steps' "
                        f"round-to-round moves (under {TRACKS_EXPLAINED_PCT:.0f} %): it does not track what moved "
                        "the engine, so no normalized ratios (the raw ratios and their verdicts stand)")
    elif options.normalize == "canary":
        cells = with_canary_ratios(cells, GATED, options.level, *canaries)
        cells = paired_canary_ratios(cells, raw_canary or {}, options.level, rounds)
    sources = {"base": between[0].source, "head": between[1].source}
    floor = paired_noise_floor(pairs, raw, set(cells.loc[by_rounds(cells), "base_run"].astype(str)))
    result = DiffResult(options, matched_on, differs, shared, label_dims, cells, unmatched, warnings=warnings,
                        between=sources, machine="; ".join(filter(None, (machine_line(*canaries),
                                                                         tracking_line(*tracked)))) or None,
                        canary_ms={name: c.ms if c else None for name, c in zip(("base", "head"), canaries)},
                        design=comparison_design(cells, sources), noise_floor_pct=floor.pct if floor else None,
                        noise_floor_df=floor.df if floor else 0.0,
                        against=text(pairs[0][0].get("pair_against")) if pairs and "pair_against" in matched_on else "")
    if options.normalize == "canary" and None in canaries:
        result.warnings.append("diff.normalize=canary: a side has fewer than 3 cells with a speed canary "
                               "(measured before the canary existed?): no normalized ratios")
    result.summary = summarize_quantities(cells, options)
    return result

