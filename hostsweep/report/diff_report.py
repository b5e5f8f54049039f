"""What `stage=diff` writes of a DiffResult (pure): the document (diff.md, diff.html), the
figure of per-cell ratios with CIs, diff.json for tools, and the console's short table.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

import numpy as np
import pandas as pd

from hostsweep.compare import (
    GATED, HOST_FIXED, MIN_ROUNDS, NO_BETWEEN, PAIRED, PAIRED_ROUNDS, POINT, RAW, SUMMARY, VERDICTS, DiffResult,
)
from hostsweep.compare.rules import slower_means
from hostsweep.report import figures as F
from hostsweep.report.document import Bullets, Document, Figure, Heading, Table, Text
from hostsweep.report.tables import ci_percent

VERDICT_COLORS = {"slower": "#d62728", "faster": "#2ca02c", "same": "#7f7f7f", "inconclusive": "#ff7f0e"}
LABELLED_CELLS = 80  # more cells than this in the figure: unnamed (the tables name them)
CONSOLE_ROWS = 12  # cells the console shows: the slowest and the fastest when there are more


@dataclass(frozen=True)
class SideInfo:
    """One side as the user named it and where its cells came from."""

    given: str  # diff.base / diff.head as typed
    label: str  # the study, or the sweep run id's first 8 characters
    kind: str  # "study" or "sweep"
    experiment: str
    experiment_id: str
    parent_runs: tuple[str, ...]
    cells: int
    raw_missing: int  # cells without raw_timings.csv
    side: str = ""  # a paired study's side ("a" the base, "b" the head), "" otherwise


@dataclass(frozen=True)
class DiffContext:
    base: SideInfo
    head: SideInfo
    tracking_uri: str
    run_id: str
    experiment: str
    created: str
    command: str


def fmt_bound(value: float, marks: Iterable[float] = ()) -> str:
    """A ratio or bound to 3 decimals, more where 3 would print it equal to a mark it lies on one
    side of (1, 1 ± threshold): 1.0504 and 1.0496 must not both read 1.050 beside a 5 % threshold."""
    if not math.isfinite(value):
        return "–" if value != value else ("∞" if value > 0 else "0")
    for digits in range(3, 7):
        text = f"{value:.{digits}f}"
        if all(text != f"{m:.{digits}f}" or value == m for m in marks):
            return text
    return f"{value:.7f}"


def marks(result: DiffResult) -> tuple[float, float, float]:
    """The values a verdict compares a ratio or bound with: 1 and 1 ± the threshold."""
    t = result.options.threshold_pct / 100
    return 1 - t, 1.0, 1 + t


def fmt_ratio(ratio: float, low: float, high: float, at: Iterable[float] = ()) -> str:
    if not math.isfinite(ratio):
        return "–"
    at = tuple(at)
    ci = f" [{fmt_bound(low, at)}, {fmt_bound(high, at)}]" if math.isfinite(low) and math.isfinite(high) \
        else " (no CI)"
    return f"{fmt_bound(ratio, at)}×{ci}"


def _interval(low: float, high: float, at: Iterable[float]) -> str:
    """A verdict interval: a bound no test could set prints as ∞ (0 below)."""
    if low != low or high != high:
        return "–"
    at = tuple(at)
    return f"[{fmt_bound(low, at)}, {fmt_bound(high, at)}]"


def differs_lines(result: DiffResult) -> list[str]:
    lines = [f"**{d.name}**: {d.text()}" for d in result.differs]
    if result.against:  # a paired A/B: what the overrides change need not be a cell param (a debug delay)
        lines.append(f"side b's overrides: {result.against}")
    elif lines and {d.name for d in result.differs} == {"side"}:  # a paired A/A (pair.enabled=true)
        lines.append("nothing else: a paired A/A, the sides are repeats of one measurement (this machine's noise)")
    return lines or ["nothing detected: the cell params and the provenance (versions, git SHA, device, host) "
                     "are the same on both sides, so the sides are repeats of one measurement"]


def headline(result: DiffResult) -> str:
    s = result.summary.get(GATED)
    if s is None:
        return f"no matched cell has {GATED}"
    c, at = s["counts"], marks(result)
    text = (f"{GATED} head/base geometric mean {fmt_ratio(s['geomean_ratio'], s['ci_low'], s['ci_high'], at)} over "
            f"{s['cells_in_geomean']} stable cells, overall {s['overall']} (verdict interval "
            f"{_interval(s['verdict_low'], s['verdict_high'], at)}); " + ", ".join(f"{c[v]} {v}" for v in VERDICTS)
            + f" ({s['judged']} cells judged at family-wise alpha {s['alpha']:g}, Holm, rule {s['rule']}; median MDE "
            f"{s['mde_pct_median']:.1f}%)"
            + "".join(f"; {n} inconclusive for {note}" for note, n in s.get("notes", {}).items()))
    if not s["unstable"]:
        return text
    slower = s["unstable_counts"]["slower"]
    return text + (f"; {s['unstable']} unstable (counted apart: {slower} slower; geometric mean with them "
                   f"{fmt_bound(s['geomean_ratio_all'], at)}×)")


def counts_table(result: DiffResult) -> pd.DataFrame:
    rows = []
    for quantity, s in result.summary.items():
        rows.append({"quantity": quantity,
                     "geomean ratio": fmt_ratio(s["geomean_ratio"], s["ci_low"], s["ci_high"], marks(result)),
                     "overall": f"{s['overall']} {_interval(s['verdict_low'], s['verdict_high'], marks(result))}",
                     "cells": s["cells"], **s["counts"], "no verdict": s["no_verdict"],
                     "unstable": s["unstable"] and ", ".join(f"{n} {v}" for v, n in s["unstable_counts"].items()
                                                              if n) or 0,
                     "CI from": s["ci_source"]})
    return pd.DataFrame(rows)


def _ci_text(lows: Iterable[float], highs: Iterable[float], at: Iterable[float] = ()) -> list[str]:
    at = tuple(at)
    return [_interval(lo, hi, at) if math.isfinite(lo) else "–" for lo, hi in zip(lows, highs)]


def verdict_text(rows: pd.DataFrame) -> pd.Series:
    """Each row's verdict as the table prints it: with its note when one decided it
    ('inconclusive (no between-start estimate)'), 'no CI' for a point-only row."""
    notes = rows["note"].fillna("").astype(str) if "note" in rows else pd.Series("", index=rows.index)
    return pd.Series([("no CI" if verdict is None or verdict != verdict else verdict) + (f" ({note})" if note else "")
                      for verdict, note in zip(rows["verdict"], notes)], index=rows.index)


def cell_table(result: DiffResult, quantity: str) -> pd.DataFrame:
    rows = result.cells[result.cells["quantity"] == quantity].sort_values("ratio", ascending=False)
    at = marks(result)
    table = pd.DataFrame({"cell": rows["cell"] + np.where(rows["unstable"], " (unstable)", ""),
                          "base ms": rows["base"], "head ms": rows["head"],
                          "ratio": [fmt_bound(r, at) for r in rows["ratio"]],
                          f"{ci_percent(result.options.level)} CI": _ci_text(rows["ci_low"], rows["ci_high"], at),
                          # the interval the verdict is read from (compare/rules.py): what a reader checks
                          "verdict interval": [_interval(lo, hi, at) for lo, hi in
                                               zip(rows["verdict_low"], rows["verdict_high"])],
                          "verdict": verdict_text(rows), "p slower (Holm)": rows["p_slower_holm"],
                          "MDE %": rows["mde_pct"], "base run": rows["base_run"],
                          "head run": rows["head_run"]})
    if "ratio_canary" in rows and quantity == GATED:  # diff.normalize=canary: beside the raw ratio
        table.insert(5, "ratio / canary", rows["ratio_canary"])
        table.insert(6, "its CI", _ci_text(rows["ci_low_canary"], rows["ci_high_canary"], at))
    return table


def ratio_figure(result: DiffResult, path: Path) -> Optional[Path]:
    """Per-cell ratio head/base with CIs, sorted by ratio, coloured by the first dimension
    that varies (or by verdict), one panel per quantity; the ±threshold band shaded."""
    quantities = [q for q in result.summary if (result.cells["quantity"] == q).any()]
    if not quantities:
        return None
    rows = max((result.cells["quantity"] == q).sum() for q in quantities)
    fig, axes = F.panels(len(quantities), width=5.5, height=min(max(2.5, 0.28 * rows + 1.2), 24), columns=3)
    group = result.label_dims[0] if result.label_dims and result.label_dims[0] not in ("batch", "ctx") else None
    t = result.options.threshold_pct / 100
    for ax, quantity in zip(axes, quantities):
        mine = result.cells[result.cells["quantity"] == quantity].sort_values("ratio", na_position="first")
        y = np.arange(len(mine))
        keys = mine[group].astype(str) if group else mine["verdict"].fillna("no CI")
        palette = F.colors(sorted(set(keys))) if group else {**VERDICT_COLORS, "no CI": "#1f77b4"}
        ax.axvspan(1 - t, 1 + t, color="#dddddd", alpha=0.6, lw=0)
        ax.axvline(1.0, color="black", lw=0.8)
        for key in dict.fromkeys(keys):
            sel = (keys == key).to_numpy()
            part = mine[sel]
            err = np.vstack([(part["ratio"] - part["ci_low"]).clip(lower=0), (part["ci_high"] - part["ratio"]).clip(lower=0)])
            ax.errorbar(part["ratio"], y[sel], xerr=np.nan_to_num(err), fmt="none", ecolor=palette[key], lw=1.2)
            ax.scatter(part["ratio"], y[sel], color=palette[key], label=f"{group}={key}" if group else key, zorder=3,
                       facecolors=np.where(part["unstable"], "white", palette[key]))
        if len(mine) <= LABELLED_CELLS:
            ax.set_yticks(y, mine["cell"] + np.where(mine["unstable"], " *", ""), fontsize=7)
        else:  # too many to name: diff.md lists them in the same order
            ax.set_yticks([])
            ax.set_ylabel(f"{len(mine)} cells, sorted by ratio")
        ax.set_xlabel(f"{quantity}: head / base")
        ax.set_title(f"{quantity}: {mine['ci_source'].iloc[0] if len(mine) else ''}", fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"head/base per cell, {ci_percent(result.options.level)} CI; grey band ±{result.options.threshold_pct:g}%; hollow *: unstable",
                 fontsize=10)
    return F.save(fig, path)


def _method(result: DiffResult) -> Bullets:
    o = result.options
    return Bullets((
        f"Cells are matched on {', '.join(result.matched_on) or 'nothing'}: every cell param except what differs "
        "(a param with one value on each side, different values). Provenance is reported, never matched on.",
        f"{RAW}: on log scale, a side measured in several engine starts is the mean of its starts' medians with a "
        "t-interval (k − 1 df, each start weighted equally); a one-start side is the median of its pairs "
        "(Maritz–Jarrett standard error) widened by a between-start component "
        f"(base: {result.between.get('base', '?')}; head: {result.between.get('head', '?')}). "
        f"The sides' variances add; Welch–Satterthwaite df; {o.level:.0%} t CI of the ratio.",
        f"{PAIRED} (a paired study's cells: side a and side b in one sweep, their engine starts alternated "
        "A B, B A, A B, ...): d_i = log of start i's median of side b over start i's of side a, adjacent in time, "
        "so what the machine did to both cancels; the mean of the k d_i with a t on sd(d_i)/√k, k − 1 df; "
        "host_ms likewise with each side's device_ms held fixed. No between-start component is needed.",
        f"{PAIRED_ROUNDS} (pair.design=rounds: both sides' engines in one worker, a cell's side-a pair and side-b "
        "pair timed back to back in every round, matched by pair_round): d_r = log(b_r / a_r); the ratio is "
        "exp(median d_r), its CI the order statistics of the d_r (exact coverage for any continuous noise; "
        "`ci_coverage`), its p-values the exact sign tests that CI inverts (no se, no df). Drift slower than a "
        "round cancels; an effect of one side's single engine start does not. Cells with fewer than "
        f"{MIN_ROUNDS} matched rounds are judged as above. The geometric mean over such cells: per round the "
        "mean over the cells of d_r, then the median of those with its order-statistic CI.",
        f"{HOST_FIXED}: host_ms = step − device_ms, by the delta method with device_ms's own error (its t-interval "
        "over the split's profiled pairs) added to the step's; the paired designs likewise, device_ms's error "
        "added once (one number per side); a cell paired by rounds holds device_ms fixed (the sign test has no "
        "variance to add it to), and says so.",
        f"{POINT}: the ratio of the logged metrics, no CI and no verdict. {SUMMARY}: each cell's logged CI read as "
        "log-normal.",
        f"Verdicts (t = {o.threshold_pct:g}%, alpha = {o.alpha:g}), {slower_means(o.rule, o.threshold_pct, o.alpha)}. "
        "The verdict interval is each cell's one-sided bounds at the level Holm tested it at (alpha / m for the "
        "smallest p-value of m, alpha / (m − 1) for the next while the first was rejected, ...; Student t, or "
        "the order statistics the sign test inverts for cells paired by rounds), so slower ⇔ what is printed "
        "says slower; faster the mirror; same = the equivalence test (TOST) at ±t rejects at alpha and the "
        f"printed {o.level:.0%} CI lies inside [1−t, 1+t]; else inconclusive. The geometric mean is judged the "
        "same way as one cell (its verdict interval: one-sided bounds at alpha).",
        f"inconclusive ({NO_BETWEEN}): a sequential cell with a side measured in one engine start and no "
        "diff.noise_floor_pct: its pairs' CI holds one start's noise, which the drift between studies exceeds, so "
        "no CI is printed and no verdict given; the study's own periods and re-measures are named as a lower "
        "bound only. A rounds cell with fewer rounds than Holm over its cells needs for slower or faster says so.",
        f"mde_pct: the smallest true slowdown this cell's gate calls slower 80% of the time under rule {o.rule} "
        "(at alpha / (cells judged), Holm's first step; ∞ where no verdict can be reached): the changes you must "
        "catch should lie above it.",
        f"fail_on={o.fail_on or 'null'} judges {GATED}: slower fails on every cell judged slower, on unstable cells "
        "slower on their own test without Holm (split_impossible alone does not make step_ms unstable), and on "
        "base cells the head lacks or FAILED; slower_overall on the geometric mean judged slower. A gate refuses "
        "(exit 2) when a gated cell has no test or an MDE above diff.max_mde_factor × the threshold "
        f"({'none' if o.max_mde_factor is None else f'{o.max_mde_pct:g} %'})."))


def _sources(ctx: DiffContext) -> Table:
    rows = [{"what": "this diff", "experiment": ctx.experiment, "run_id": ctx.run_id}]
    for name, side in (("base", ctx.base), ("head", ctx.head)):
        rows += [{"what": f"{name} sweep ({side.given})", "experiment": side.experiment, "run_id": p}
                 for p in side.parent_runs]
    return Table(pd.DataFrame(rows))


def diff_document(result: DiffResult, ctx: DiffContext, folder: Path) -> Document:
    """The diff document; its figure is written under folder/figures."""
    figure = ratio_figure(result, folder / "figures" / "ratios.png")
    doc = Document(f"Diff {ctx.base.label} → {ctx.head.label}")
    doc.add(Heading("What differs"), Bullets(tuple(differs_lines(result))),
            Text(f"Base `{ctx.base.given}` ({ctx.base.kind}, {ctx.base.cells} cells), head `{ctx.head.given}` "
                 f"({ctx.head.kind}, {ctx.head.cells} cells). Matched on: {', '.join(result.matched_on) or 'nothing'}."
                 + (f" Same on both sides: {', '.join(f'{k} {v}' for k, v in result.shared.items())}."
                    if result.shared else "")),
            Heading("Verdict"), Text(f"**{headline(result)}**"), Text(f"Design: {result.design}."),
            *([Text(result.options.floors_line[0].upper() + result.options.floors_line[1:] + ".")]
              if result.options.floors_line else []),
            Table(counts_table(result)))
    if result.noise_floor_line():
        doc.add(Text(f"The {result.noise_floor_line()}."))
    if result.instance_line():
        doc.add(Text(f"The {result.instance_line()}."))
    if result.machine:
        doc.add(Text(f"Machines: {result.machine}. The verdicts are on the raw ratios; "
                     + ("`ratio_canary` divides each by the canary ratio (docs/diff.md)."
                        if result.options.normalize == "canary" else
                        "`diff.normalize=canary` shows each also divided by the canary ratio (docs/diff.md).")))
    if result.options.fail_on:
        doc.add(Text(f"**{result.gate_line()}**."))
    if figure is not None:
        doc.add(Figure(figure, f"head/base per cell with its {ci_percent(result.options.level)} CI, sorted by ratio; "
                               "grey: the ±threshold band."))
    for quantity in result.summary:
        doc.add(Heading(f"Every matched cell: {quantity}", 3), Table(cell_table(result, quantity), digits=3))
    doc.add(Heading("Unmatched cells"), Table(result.unmatched) if len(result.unmatched) else Text("none"),
            Heading("How the numbers are made"), _method(result),
            Heading("Where every number comes from"),
            Text(f"Store `{ctx.tracking_uri}`. Generated {ctx.created} by `{ctx.command}`."), _sources(ctx))
    warnings = result.warnings + [f"{s.label}: {s.raw_missing} cell(s) have no raw_timings.csv: their {GATED} CI is "
                                  "approximate (from the logged CI)" for s in (ctx.base, ctx.head) if s.raw_missing]
    if warnings:
        doc.add(Heading("Warnings"), Bullets(tuple(warnings)))
    return doc


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (np.floating, np.integer, np.bool_)):
        return _clean(value.item())
    return value


def to_json(result: DiffResult, ctx: DiffContext) -> dict[str, Any]:
    """diff.json: everything the document says, as data."""
    side = lambda s: {k: (list(v) if isinstance(v, tuple) else v) for k, v in s.__dict__.items()}  # noqa: E731
    return {
        "base": side(ctx.base), "head": side(ctx.head), "run_id": ctx.run_id, "tracking_uri": ctx.tracking_uri,
        "created": ctx.created, "command": ctx.command,
        "differs": [{"name": d.name, "base": list(d.base), "head": list(d.head)} for d in result.differs],
        "matched_on": result.matched_on, "shared": result.shared,
        "options": {**result.options.__dict__, "quantities": list(result.options.quantities)},
        "summary": {q: {k: _clean(v) for k, v in s.items()} for q, s in result.summary.items()},
        "failing": result.failing()["cell"].tolist(),
        "gate": {**dict(zip(("failed", "why"), result.gate())), "refused": result.refusal(),
                 "missing": len(result.missing())},
        "between": result.between, "machine": result.machine, "canary_ms": result.canary_ms,
        "design": result.design, "noise_floor_pct": _clean(result.noise_floor_pct),
        "floors": result.options.floors_line,
        "noise_floor_df": _clean(result.noise_floor_df),
        "instance_line": result.instance_line(),
        "cells": [{k: _clean(v) for k, v in row.items()} for row in result.cells.to_dict("records")],
        "unmatched": [{k: _clean(v) for k, v in row.items()} for row in result.unmatched.to_dict("records")],
        "warnings": result.warnings,
    }


def console(result: DiffResult) -> str:
    """The short table: the gated quantity's cells (the slowest and fastest when many), then the counts."""
    table = cell_table(result, GATED).drop(columns=["base run", "head run"])
    if len(table) > CONSOLE_ROWS:
        half = CONSOLE_ROWS // 2
        table = pd.concat([table.head(half), table.tail(half)])
    lines = [f"what differs: {'; '.join(l.replace('**', '') for l in differs_lines(result))}",
             f"matched on: {', '.join(result.matched_on) or 'nothing'}", f"design: {result.design}"]
    lines += [result.options.floors_line] if result.options.floors_line else []
    if len(table):
        lines.append(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    lines.append(headline(result))
    lines += [result.noise_floor_line()] if result.noise_floor_line() else []
    lines += [result.instance_line()] if result.instance_line() else []
    lines += [f"machines: {result.machine}"] if result.machine else []
    lines += [f"unmatched: {len(result.unmatched)} cell(s) ({(result.unmatched['side'] == 'base').sum()} base only, "
              f"{(result.unmatched['side'] == 'head').sum()} head only)"] if len(result.unmatched) else []
    return "\n".join(lines + [f"warning: {w}" for w in result.warnings])
