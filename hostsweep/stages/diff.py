"""`stage=diff`: two studies (or two sweeps) side by side, cell by cell, with tested verdicts and a
release gate: did it get slower with the new vLLM, torch, driver, SKU, mode or engine argument?

    python -m hostsweep stage=diff diff.base=nightly-0.31 diff.head=nightly-0.32
    python -m hostsweep stage=diff diff.base=<parent run id> diff.head=<parent run id> diff.fail_on=slower

Both sides are named and read back from MLflow first (record/read/sides.py; an unknown study or
run is a one-line error, exit 2), compared by report/diff.py, written under
<run dir>/diff/ (diff.md, diff.html, diff.json, diff.csv, figures/ratios.png) and logged as a run
`diff-<base>-<head>` in the head's experiment. With diff.fail_on=slower the exit code is 1
when any cell's step_ms is judged slower (Holm over the cells at diff.alpha, beyond
diff.threshold_pct), an unstable cell's ratio lies beyond the threshold, or the head lacks
or FAILED cells the base has (a release gate); 2 when the gate cannot state its error rate
(a one-start side with no between-start estimate: the line says what to run).
"""
from __future__ import annotations

import json
import logging
import sys
from datetime import datetime
from pathlib import Path

from omegaconf import DictConfig

from hostsweep.config.redact import redact
from hostsweep.config.schema import ConfigError, DiffConfig
from hostsweep.config.stages import StageInfo
from hostsweep.record.read.readback import FilterRefused
from hostsweep.record.reports import ReportRun
from hostsweep.record.read.sides import Side, check_store, locate, read_side_cells, with_pairs
from hostsweep.record.views import open_ui_line, runs_table_url, ui_base
from hostsweep.report.diff import DiffOptions, DiffResult, diff
from hostsweep.report.diff_report import DiffContext, SideInfo, build, console, headline, to_json
from hostsweep.report.document import to_html, to_markdown
from hostsweep.stages.compare import command_line
from hostsweep.stages import resolve_for_reading

STAGE = StageInfo(name="diff", help="two studies (or sweeps) cell by cell: ratios with CIs, verdicts, a release gate",
                  sections=("diff",),
                  docs="diff.md")

log = logging.getLogger(__name__)
GATE_FAILED = 1  # fail_on tripped (2 is bad input, as everywhere)
GATE_REFUSED = 2  # fail_on cannot state a false-alarm rate: the studies lack a between-start estimate


def diff_options(cfg: DiffConfig) -> DiffOptions:
    """The diff section as DiffOptions, checked (a bad value is a one-line ConfigError)."""
    options = DiffOptions(float(cfg.threshold_pct), tuple(cfg.quantities), float(cfg.ci_level), float(cfg.alpha),
                          None if cfg.noise_floor_pct is None else float(cfg.noise_floor_pct), cfg.fail_on,
                          cfg.normalize)
    try:
        options.check()
    except ValueError as exc:
        raise ConfigError(f"diff.{exc}") from None
    return options


def read_sides(uri: str, cfg: DiffConfig) -> tuple[Side, Side]:
    """Both sides named (both checked before either is read), then read."""
    check_store(uri)
    where = [locate(uri, cfg.base, "diff.base"), locate(uri, cfg.head, "diff.head")]
    keys = ("diff.base", "diff.head")
    try:
        cells = [read_side_cells(uri, w, cfg.filter, key) for w, key in zip(where, keys)]
    except FilterRefused as exc:
        raise ConfigError(f"diff.filter={cfg.filter!r} was refused by MLflow: {exc}") from None
    if set(cells[0]["run_id"]) == set(cells[1]["run_id"]):
        raise ConfigError(f"diff.base={cfg.base} and diff.head={cfg.head} are the same {len(cells[0])} cell runs; "
                          "name two studies or two sweeps")
    base, head = (with_pairs(w, c, key) for w, c, key in zip(where, cells, keys))
    return base, head


def side_info(side: Side) -> SideInfo:
    w = side.located
    return SideInfo(w.given, w.label, w.kind, w.experiment, w.experiment_id, side.parent_runs, len(side.cells),
                    side.raw_missing)


def _params(result: DiffResult, ctx: DiffContext) -> dict[str, object]:
    params: dict[str, object] = {"base": ctx.base.given, "head": ctx.head.given,
                                 "base_experiment": ctx.base.experiment, "head_experiment": ctx.head.experiment,
                                 "base_sweeps": ",".join(ctx.base.parent_runs), "head_sweeps": ",".join(ctx.head.parent_runs),
                                 "matched_on": ",".join(result.matched_on), "differs": ",".join(d.name for d in result.differs)
                                 or "nothing", "threshold_pct": result.options.threshold_pct,
                                 "fail_on": result.options.fail_on, "matched": result.cells["cell"].nunique(),
                                 "unmatched": len(result.unmatched)}
    return params | {f"differs.{d.name}": d.text() for d in result.differs}


def _metrics(result: DiffResult) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for quantity, s in result.summary.items():
        prefix = "" if quantity == "step_ms" else f"{quantity}."
        metrics |= {f"{prefix}geomean_ratio": s["geomean_ratio"], f"{prefix}geomean_ci_low": s["ci_low"],
                    f"{prefix}geomean_ci_high": s["ci_high"], f"{prefix}unstable": s["unstable"],
                    **{f"{prefix}{verdict}": n for verdict, n in s["counts"].items()}}
    s = result.summary.get("step_ms", {})
    return metrics | {"failing": float(len(result.failing())), "gate_failed": float(result.gate()[0]),
                      "unmatched": float(len(result.unmatched)), "missing": float(len(result.missing())),
                      "judged": float(s.get("judged", 0)), "alpha": result.options.alpha,
                      "mde_pct_median": s.get("mde_pct_median", float("nan"))}


def write(result: DiffResult, ctx: DiffContext, folder: Path) -> None:
    doc = build(result, ctx, folder)
    (folder / "diff.md").write_text(to_markdown(doc, folder))
    (folder / "diff.html").write_text(to_html(doc))
    (folder / "diff.json").write_text(json.dumps(to_json(result, ctx), indent=1))
    result.cells.to_csv(folder / "diff.csv", index=False)  # one row per cell and quantity, for spreadsheets


def diff_sides(base: Side, head: Side, options: DiffOptions, uri: str, experiment: str, run_dir: Path
               ) -> tuple[DiffResult, DiffContext, ReportRun, Path]:
    """Compare, write the files, log the diff run."""
    result = diff(base.cells, head.cells, {**base.raw, **head.raw}, options, head.failed)
    name = f"diff-{base.located.label}-{head.located.label}"
    run = ReportRun(uri, experiment, name, {"hostsweep.kind": "diff", "diff.base": base.located.given,
                                            "diff.head": head.located.given})
    folder = run_dir / "diff"
    try:
        ctx = DiffContext(side_info(base), side_info(head), redact(uri), run.run_id, experiment,
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
             f"MLflow: run {run.run_name} ({run.run_id}) in experiment {run.experiment_id} of {redact(uri)}",
             open_ui_line(uri, port),
             f"  the diff: {runs_table_url(run.experiment_id, port, run.run_id, ui_base(uri, port))} (Artifacts)"]
    failed, why = result.gate()
    if result.options.fail_on:
        lines.append(f"diff.fail_on={result.options.fail_on}: {'FAIL' if failed else 'pass'}: {why}")
    return "\n".join(lines)


def run(raw_cfg: DictConfig, run_dir: Path) -> int:
    study = resolve_for_reading(raw_cfg)
    cfg, uri = study.config.diff, study.config.tracking.uri
    options = diff_options(cfg)
    base, head = read_sides(uri, cfg)
    experiment = cfg.experiment or head.located.experiment
    result, _, report_run, folder = diff_sides(base, head, options, uri, experiment, run_dir)
    print(console(result))
    print(_closing(result, report_run, folder, uri, cfg.ui_port))
    refused = result.refusal()
    if refused:
        print(f"hostsweep: error: {refused}", file=sys.stderr)
        return GATE_REFUSED
    return GATE_FAILED if result.gate()[0] else 0
