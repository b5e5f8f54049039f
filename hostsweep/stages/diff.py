"""`stage=diff`: two studies (or two sweeps) side by side, cell by cell, with tested verdicts and a
release gate: did it get slower with the new vLLM, torch, driver, SKU, mode or engine argument?

    python -m hostsweep stage=diff diff.base=nightly-0.31 diff.head=nightly-0.32
    python -m hostsweep stage=diff diff.base=<parent run id> diff.head=<parent run id> diff.fail_on=slower

Both sides are named and read back from MLflow first (record/read/sides.py; an unknown study or
run is a one-line error, exit 2), compared by the compare package, written under
<run dir>/diff/ (diff.md, diff.html, diff.json, diff.csv, figures/ratios.png) and logged as a run
`diff-<base>-<head>` in the head's experiment. With diff.fail_on=slower the exit code is 1
when any cell's step_ms is judged slower under diff.rule (compare/rules.py; the default,
`significant`: a real change by its test against no change, Holm over the cells at diff.alpha,
with its ratio beyond diff.threshold_pct), an unstable cell is slower by the same rule on its
own test at alpha without Holm, or the head lacks or FAILED cells the base has (a release
gate); with diff.fail_on=slower_overall when the geometric mean is slower under the rule. The
exit code is 2 when the gate cannot say what a pass means: a one-start side with no
between-start estimate, a gated cell with no test, or an MDE above diff.max_mde_factor x the
threshold (the line says what to add).

A paired study (pair.enabled=true or +pair.against.KEY=V) holds both sides in one sweep:
`diff.base=<study or sweep>` with diff.head unset (or the same) diffs its side a (base)
against its side b (head), cell by cell over the start pairs (or, measured with
pair.design=rounds, over the rounds in which each cell's two sides were timed back to back). paired_diff_of_sweep is that
diff for the sweep that just measured it.
"""
from __future__ import annotations

import json
import logging
import sys
from datetime import datetime
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig

from hostsweep.config.schema import ConfigError, DiffConfig
from hostsweep.config.stages import StageInfo
from hostsweep.record.read.readback import FilterRefused, experiment_ids
from hostsweep.record.reports import ReportRun
from hostsweep.record.read.sides import (
    Located, Side, check_store, locate, paired_halves, read_side_cells, sides_held, with_pairs,
)
from hostsweep.record.views import open_ui_line, runs_table_url, store_label, ui_base
from hostsweep.compare.floors import AUTO, machine_engine
from hostsweep.compare.rules import slower_means
from hostsweep.stages.noise import newest_calibration
from hostsweep.compare import DiffOptions, DiffResult, diff, diff_options  # noqa: F401 - diff_options: the stage's checker
from hostsweep.report.diff_report import DiffContext, SideInfo, diff_document, console, headline, to_json
from hostsweep.report.document import to_html, to_markdown
from hostsweep.stages.compare import command_line
from hostsweep.stages import resolve_for_reading

STAGE = StageInfo(name="diff", help="two studies (or sweeps) cell by cell: ratios with CIs, verdicts, a release gate",
                  sections=("diff",),
                  docs="diff.md")

log = logging.getLogger(__name__)
GATE_FAILED = 1  # fail_on tripped (2 is bad input, as everywhere)
GATE_REFUSED = 2  # fail_on cannot say what a pass means: no between-start estimate, an untested cell, an MDE too big


HEAD_REQUIRED = "diff.head is required unless diff.base names a paired study (measured with pair.enabled=true or +pair.against.KEY=V)"


def _cells(uri: str, where: Located, cfg: DiffConfig, key: str):
    try:
        return read_side_cells(uri, where, cfg.filter, key)
    except FilterRefused as exc:
        raise ConfigError(f"diff.filter={cfg.filter!r} was refused by MLflow: {exc}") from None


def _paired_sides(where: Located, cells, key: str) -> Optional[tuple[Side, Side]]:
    """A paired study's (or sweep's) cells as base = side a, head = side b; None when unpaired."""
    halves = paired_halves(where, cells)
    if halves is None:
        return None
    base, head = (with_pairs(w, c, f"{key} (side {w.side})") for w, c in halves)
    return base, head


def read_sides(uri: str, cfg: DiffConfig) -> tuple[Side, Side]:
    """Both sides named (both checked before either is read), then read. diff.head unset or
    naming the same runs: diff.base must be a paired study, split into its sides a and b."""
    check_store(uri)
    base_at = locate(uri, cfg.base, "diff.base")
    one = cfg.head is None or str(cfg.head) == str(cfg.base)
    head_at = None if one else locate(uri, cfg.head, "diff.head")
    cells = _cells(uri, base_at, cfg, "diff.base")
    head_cells = None if head_at is None else _cells(uri, head_at, cfg, "diff.head")
    if head_at is not None and head_cells is not None and set(cells["run_id"]) != set(head_cells["run_id"]):
        return with_pairs(base_at, cells, "diff.base"), with_pairs(head_at, head_cells, "diff.head")
    paired = _paired_sides(base_at, cells, "diff.base")
    if paired is not None:
        return paired
    held = sides_held(cells)
    only = f" (its cells hold only side {held[0]} of a paired study{': check diff.filter' if cfg.filter else ''})" \
        if held else ""
    if cfg.head is None:
        raise ConfigError(HEAD_REQUIRED + only)
    raise ConfigError(f"diff.base={cfg.base} and diff.head={cfg.head} are the same {len(cells)} cell runs{only}; "
                      "name two studies or two sweeps, or a paired study (measured with pair.enabled=true or +pair.against.KEY=V) alone")


def side_info(side: Side) -> SideInfo:
    w = side.located
    return SideInfo(w.given, w.label, w.kind, w.experiment, w.experiment_id, side.parent_runs, len(side.cells),
                    side.raw_missing, w.side)


def _params(result: DiffResult, ctx: DiffContext) -> dict[str, object]:
    named = lambda s: f"{s.given}:{s.side}" if s.side else s.given  # noqa: E731 - a paired study's side
    params: dict[str, object] = {"base": named(ctx.base), "head": named(ctx.head),
                                 "design": result.design,
                                 "base_experiment": ctx.base.experiment, "head_experiment": ctx.head.experiment,
                                 "base_sweeps": ",".join(ctx.base.parent_runs), "head_sweeps": ",".join(ctx.head.parent_runs),
                                 "matched_on": ",".join(result.matched_on), "differs": ",".join(d.name for d in result.differs)
                                 or "nothing", "threshold_pct": result.options.threshold_pct,
                                 "rule": result.options.rule, "max_mde_factor": result.options.max_mde_factor,
                                 "floors": result.options.floors_line or "none",
                                 "instance_floor_pct": result.options.instance_floor_pct,
                                 "noise_floor_pct_in_force": result.options.noise_floor_pct,
                                 "slower_means": slower_means(result.options.rule, result.options.threshold_pct,
                                                              result.options.alpha),
                                 "fail_on": result.options.fail_on, "matched": result.cells["cell"].nunique(),
                                 "unmatched": len(result.unmatched)}
    params["geomean_verdict"] = result.summary.get("step_ms", {}).get("overall", "none")
    return params | {f"differs.{d.name}": d.text() for d in result.differs}


def note_key(note: str) -> str:
    """A cell note as an MLflow metric key: 'no between-start estimate' -> 'no_between_start_estimate'
    (a too-few-rounds note keeps its first words)."""
    words = "".join(c if c.isalnum() else " " for c in note.split("(")[0]).split()
    return "_".join(words) or "noted"


def _metrics(result: DiffResult) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for quantity, s in result.summary.items():
        prefix = "" if quantity == "step_ms" else f"{quantity}."
        metrics |= {f"{prefix}geomean_ratio": s["geomean_ratio"], f"{prefix}geomean_ci_low": s["ci_low"],
                    f"{prefix}geomean_ci_high": s["ci_high"], f"{prefix}unstable": s["unstable"],
                    **{f"{prefix}{verdict}": n for verdict, n in s["counts"].items()},
                    # inconclusive for a reason no data could change (NO_BETWEEN), counted apart
                    **{f"{prefix}inconclusive_{note_key(note)}": n for note, n in s.get("notes", {}).items()}}
    s = result.summary.get("step_ms", {})
    return metrics | {"failing": float(len(result.failing())), "gate_failed": float(result.gate()[0]),
                      "unmatched": float(len(result.unmatched)), "missing": float(len(result.missing())),
                      "judged": float(s.get("judged", 0)), "alpha": result.options.alpha,
                      "mde_pct_median": s.get("mde_pct_median", float("nan")),
                      "mde_pct_max": s.get("mde_pct_max", float("nan")),
                      "geomean_verdict_low": s.get("verdict_low", float("nan")),
                      "geomean_verdict_high": s.get("verdict_high", float("nan")),
                      "geomean_mde_pct": s.get("overall_mde_pct", float("nan")),
                      "gate_refused": float(result.refusal() is not None),
                      **({"noise_floor_pct": result.noise_floor_pct, "noise_floor_df": result.noise_floor_df}
                         if result.noise_floor_pct is not None else {})}


def write(result: DiffResult, ctx: DiffContext, folder: Path) -> None:
    doc = diff_document(result, ctx, folder)
    (folder / "diff.md").write_text(to_markdown(doc, folder))
    (folder / "diff.html").write_text(to_html(doc))
    (folder / "diff.json").write_text(json.dumps(to_json(result, ctx), indent=1))
    result.cells.to_csv(folder / "diff.csv", index=False)  # one row per cell and quantity, for spreadsheets


def diff_sides(base: Side, head: Side, options: DiffOptions, uri: str, experiment: str, run_dir: Path
               ) -> tuple[DiffResult, DiffContext, ReportRun, Path]:
    """Compare, write the files, log the diff run."""
    result = diff(base.cells, head.cells, {**base.raw, **head.raw}, options, head.failed,
                  {**base.raw_canary, **head.raw_canary}, {**base.rounds, **head.rounds})
    name = f"diff-{base.located.label}-{head.located.label}"
    run = ReportRun(uri, experiment, name, {"hostsweep.kind": "diff", "diff.base": base.located.given,
                                            "diff.head": head.located.given})
    folder = run_dir / "diff"
    try:
        ctx = DiffContext(side_info(base), side_info(head), store_label(uri), run.run_id, experiment,
                          datetime.now().strftime("%Y-%m-%d %H:%M:%S"), command_line())
        folder.mkdir(parents=True, exist_ok=True)
        write(result, ctx, folder)
        run.log(folder, _params(result, ctx), _metrics(result), headline(result))
        run.finish()
    except BaseException:
        run.finish("FAILED")
        raise
    return result, ctx, run, folder


def _closing(result: DiffResult, run: ReportRun, folder: Path, uri: str, port: int) -> str:
    lines = [f"diff: {folder / 'diff.html'} and {folder / 'diff.md'} (diff.json, diff.csv, figures/ratios.png)",
             f"MLflow: run {run.run_name} ({run.run_id}) in experiment {run.experiment_id} of {store_label(uri)}",
             open_ui_line(uri, port),
             f"  the diff: {runs_table_url(run.experiment_id, port, run.run_id, ui_base(uri, port))} (Artifacts)"]
    if result.options.fail_on:
        lines.append(result.gate_line())
    return "\n".join(lines)


def _report(base: Side, head: Side, cfg: DiffConfig, options: DiffOptions, uri: str, run_dir: Path
            ) -> tuple[DiffResult, int]:
    """Compare, write, log, print the console and the gate's line; the exit code."""
    experiment = cfg.experiment or head.located.experiment
    result, _, report_run, folder = diff_sides(base, head, options, uri, experiment, run_dir)
    print(console(result))
    print(_closing(result, report_run, folder, uri, cfg.ui_port))
    refused = result.refusal()
    if refused:
        print(f"hostsweep: error: {refused}", file=sys.stderr)
        return result, GATE_REFUSED
    return result, GATE_FAILED if result.gate()[0] else 0


def calibrated_options(cfg: DiffConfig, uri: str, noise_experiment: str, cells) -> DiffOptions:
    """The diff's options with its auto floors taken from the newest noise calibration of the
    machine and engine the base side's cells ran on (compare/floors.py), else the defaults."""
    where = machine_engine(cells)
    auto = AUTO in (cfg.noise_floor_pct, cfg.instance_floor_pct)
    return diff_options(cfg, newest_calibration(uri, noise_experiment, where) if auto else None, where)


def run(raw_cfg: DictConfig, run_dir: Path) -> int:
    study = resolve_for_reading(raw_cfg)
    cfg, uri = study.config.diff, study.config.tracking.uri
    diff_options(cfg)  # bad input refused before anything is read
    base, head = read_sides(uri, cfg)
    options = calibrated_options(cfg, uri, study.config.noise.experiment, base.cells)
    return _report(base, head, cfg, options, uri, run_dir)[1]


def paired_diff_of_sweep(uri: str, experiment: str, parent_run_id: str, cfg: DiffConfig, run_dir: Path,
                         noise_experiment: str = "noise") -> tuple[DiffResult, int]:
    """The diff a paired sweep runs at its end: that sweep's FINISHED cells (experiment: its
    name or id; parent_run_id: the sweep's parent run), side a against side b, written under
    run_dir/diff/, logged as a diff run (cfg.experiment, else the sweep's experiment), the
    console and the gate's line printed. Returns the result and the exit code: 0, GATE_FAILED
    (cfg.fail_on tripped) or GATE_REFUSED. ConfigError (one line) for a bad diff section, a
    sweep with no FINISHED cells or one that is not paired. The cells' raw_timings.csv must be
    in the store (uploads done) before the call. Auto floors: the newest noise calibration of
    the machine and engine its cells ran on (noise_experiment), else the defaults."""
    diff_options(cfg)
    known = experiment_ids(uri)
    experiment_id = known.get(experiment, str(experiment))
    name = {v: k for k, v in known.items()}.get(experiment_id, str(experiment))
    where = Located(parent_run_id, "sweep", name, experiment_id, parent_run_id)
    cells = _cells(uri, where, cfg, "the paired sweep")
    paired = _paired_sides(where, cells, "the paired sweep")
    if paired is None:
        raise ConfigError(f"sweep {parent_run_id} is not a paired sweep: its cells hold side(s) "
                          f"{', '.join(sides_held(cells)) or 'none'}, not both a and b")
    options = calibrated_options(cfg, uri, noise_experiment, paired[0].cells)
    return _report(*paired, cfg, options, uri, run_dir)
