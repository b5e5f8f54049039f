"""`stage=compare`: from the study's measured runs to a cross-SKU report with figures,
logged to MLflow beside the runs.

    python -m hostsweep +experiment=generalize-cpu stage=compare
    python -m hostsweep +experiment=tp70b stage=compare calibration=seed002-h100

Selects the cells (record/read/selection.py), fits them (stages/fit.py, logged to the models
experiment) or reads a logged fit (compare.fit_run), builds the report and its figures
(report/fit_report.py) under <run dir>/compare/, and logs all of it as artifacts of a
run named compare-<study> in the study's own experiment, so the report sits in the runs
table beside the sweeps it reads. Prints the verdicts, the files and the UI links.
"""
from __future__ import annotations

import json
import logging
import sys
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Optional

import pandas as pd
from omegaconf import DictConfig

from hostsweep.config.redact import redact
from hostsweep.config.resolve import Study
from hostsweep.config.schema import ConfigError
from hostsweep.config.stages import StageInfo
from hostsweep.measure.unstable import Exclusion, exclude_unstable
from hostsweep.model.term_checks import decomposition_table, term_paths
from hostsweep.record.reports import ReportRun, load_fit_json
from hostsweep.record.views import absolute_store_uri, open_ui_line, runs_table_url, store_label, ui_base
from hostsweep.record.read.selection import Selection, select_cells
from hostsweep.report.document import to_html, to_markdown
from hostsweep.report.fit_report import Context, build
from hostsweep.report.inconclusive import inconclusive_document
from hostsweep.stages.fit import fit_selection
from hostsweep.stages import resolve_for_reading

STAGE = StageInfo(name="compare", help="fit (or reuse a fit run), then the cross-SKU report with figures",
                  sections=("select", "fit", "compare"),
                  docs="tp-model.md")

log = logging.getLogger(__name__)


def command_line() -> str:
    """The command as the user typed it (Hydra's task overrides when Hydra runs us), with
    the credentials of any URI in it hidden: it is printed in the report."""
    try:
        from hydra.core.hydra_config import HydraConfig

        overrides = list(HydraConfig.get().overrides.task)
    except ValueError:  # not under Hydra (a test calling the stage directly)
        overrides = sys.argv[1:]
    return redact(" ".join(["python -m hostsweep", *overrides]))


def _fit(study: Study, selection: Selection, run_dir: Path
         ) -> tuple[dict[str, Any], str, list[dict], list[str], str]:
    """(fit.json content, fit run id, where the fixed terms came from, warnings about them, the
    floors line): fitted now, or compare.fit_run's (its terms are in its fit.json and the run's params)."""
    run_id = study.config.compare.fit_run
    if run_id:
        return with_report_parts(json.loads(load_fit_json(study.config.tracking.uri, run_id))), run_id, [], [], ""
    result = fit_selection(study, selection, run_dir)
    return result.data, result.outcome.run_id, result.fixed.sources, result.fixed.warnings, result.floors


def with_report_parts(fit: dict[str, Any]) -> dict[str, Any]:
    """A fit.json logged before it carried what the report draws (the additive term's
    decomposition, each held-out group's term paths), with them added: the report computes
    nothing of the model's."""
    if "decomposition" not in fit:
        table = decomposition_table(pd.DataFrame(fit["cells"]), fit["options"]["form"]).astype(object)
        fit["decomposition"] = table.where(table.notna(), None).to_dict(orient="records")
    for group in fit["groups"]:
        if "allreduce_check" in group and "term_paths" not in group:
            group["term_paths"] = term_paths(fit["calibration"], group["sku"])
    return fit


def _params_and_metrics(fit: dict[str, Any], groups: pd.DataFrame, fit_run: str,
                        cells: int) -> tuple[dict[str, object], dict[str, float]]:
    params: dict[str, object] = {"verdict": fit["verdict"]["verdict"], "fit_run": fit_run, "cells": cells,
                                 "form": fit["options"]["form"], "train_sku": fit["options"]["train_sku"],
                                 "train_tp": fit["options"]["train_tp"]}
    metrics: dict[str, float] = {"g": fit["scale"]["g"]}
    for row in groups.itertuples():
        group = f"{row.sku}_tp{row.tp}"
        params[f"verdict.{group}"] = row.verdict
        metrics |= {f"model_mape_mean.{group}": row.model_mape_mean, f"baseline_mape_mean.{group}":
                    row.baseline_mape_mean, f"below_bound_ci.{group}": float(row.below_bound_ci)}
    for r in fit["shrink"]:
        metrics[f"shrink_measured.{r['sku']}.{r['model']}.tp{r['from_tp']}_{r['to_tp']}"] = r["measured_in_regime"]
    return params, {k: v for k, v in metrics.items() if v is not None}


def _note(fit: dict[str, Any], groups: pd.DataFrame) -> str:
    """The run's description: the verdicts, readable on the run page."""
    lines = [f"**{fit['verdict']['verdict']}**: {fit['verdict']['reason']}", ""]
    lines += [f"- {r.sku} TP-{r.tp}: **{r.verdict}** (model MAPE {r.model_mape_mean:.2f}%, baseline "
              f"{r.baseline_mape_mean:.2f}%, in CI {r.model_in_ci}) — {r.reason}" for r in groups.itertuples()
              if r.model_mape_mean is not None]
    return "\n".join(lines + ["", "Full report: artifact report.html (or report.md)."])


def compare_study(study: Study, run_dir: Path, keys: Optional[Iterable[str]] = None) -> int:
    """Select, fit, report, log; returns the exit code. A fit that cannot be made because
    unstable cells were left out still gets its report (inconclusive), exit code 1."""
    cfg = study.config
    selection = select_cells(study, keys)
    unstable = exclude_unstable(selection.cells, cfg.fit.exclude_unstable)[1]  # the report leaves them out too
    try:
        fit, fit_run, sources, warnings, floors = _fit(study, selection, run_dir)
    except ConfigError as exc:
        if not unstable.count:
            raise  # nothing measured was left out: the study itself cannot be fitted, bad input
        return _inconclusive(study, selection, run_dir, str(exc), unstable)
    folder = run_dir / "compare"
    report_run = ReportRun(cfg.tracking.uri, selection.experiment, f"compare-{study.name}",
                           {"study": study.name, "fit_run": fit_run, "run_dir": str(run_dir)})
    try:
        ctx = Context(study.name, selection.experiment, selection.experiment_id, absolute_store_uri(cfg.tracking.uri),
                      report_run.run_id, fit_run, cfg.fit.models_experiment,
                      datetime.now().strftime("%Y-%m-%d %H:%M:%S"), command_line(),
                      tuple(s.name for s in study.skus), sources, warnings, cfg.fit.exclude_unstable)
        doc, groups = build(ctx, selection.cells, fit, folder)
        (folder / "report.md").write_text(to_markdown(doc, folder))
        (folder / "report.html").write_text(to_html(doc))
        (folder / "fit.json").write_text(json.dumps(fit, indent=1))
        selection.cells.to_csv(folder / "cells.csv", index=False)
        params, metrics = _params_and_metrics(fit, groups, fit_run, len(selection.cells))
        params |= {"unstable_cells": unstable.flagged, "unstable_left_out": unstable.count,
                   **({"floors": floors} if floors else {})}
        report_run.log(folder, params, metrics, _note(fit, groups))
        report_run.finish()
    except BaseException:
        report_run.finish("FAILED")
        raise
    print(_summary(fit, groups, folder, report_run, cfg.tracking.uri, cfg.compare.ui_port, warnings, unstable))
    if floors:
        print(floors)
    return 0


def _summary(fit: dict[str, Any], groups: pd.DataFrame, folder: Path, report_run: ReportRun, uri: str,
             port: int, warnings: list[str], unstable: Exclusion) -> str:
    lines = [f"warning: {w}" for w in warnings + fit["warnings"]]
    lines += [f"cells: {unstable.describe()}"]
    lines += [f"host term across held-out groups: {fit['verdict']['verdict']} ({fit['verdict']['reason']})"]
    if fit["verdict"].get("noise"):
        lines += [f"noise: {fit['verdict']['noise']['summary']}"]
    lines += [f"held-out {r.sku} TP-{r.tp}: {r.verdict} — {r.reason}" for r in groups.itertuples()]
    lines += [f"report: {folder / 'report.html'} and {folder / 'report.md'} (figures in {folder / 'figures'})",
              f"MLflow: run {report_run.run_name} ({report_run.run_id}) in experiment {report_run.experiment_id} "
              f"of {store_label(uri)}",
              open_ui_line(uri, port),
              f"  then browse {runs_table_url(report_run.experiment_id, port, base=ui_base(uri, port))}",
              f"  the report: {runs_table_url(report_run.experiment_id, port, report_run.run_id, ui_base(uri, port))} "
              "(Artifacts)"]
    return "\n".join(lines)


def run(raw_cfg: DictConfig, run_dir: Path) -> int:
    study = resolve_for_reading(raw_cfg)
    return compare_study(study, run_dir)


def _inconclusive(study: Study, selection: Selection, run_dir: Path, reason: str, unstable: Exclusion) -> int:
    """The report of a study the fit could not be made for once its unstable cells were left
    out: why, the cells, what to run (report/inconclusive.py), logged like any report."""
    cfg = study.config
    folder = run_dir / "compare"
    folder.mkdir(parents=True, exist_ok=True)
    report_run = ReportRun(cfg.tracking.uri, selection.experiment, f"compare-{study.name}",
                           {"study": study.name, "run_dir": str(run_dir)})
    try:
        doc = inconclusive_document(study.name, reason, selection.cells, unstable, command_line(),
                                    cfg.measure.max_ci_pct)
        (folder / "report.md").write_text(to_markdown(doc, folder))
        (folder / "report.html").write_text(to_html(doc))
        selection.cells.to_csv(folder / "cells.csv", index=False)
        params = {"verdict": "inconclusive", "cells": len(selection.cells), "unstable_cells": unstable.flagged,
                  "unstable_left_out": unstable.count, "reason": reason}
        report_run.log(folder, params, {}, f"**inconclusive**: {reason}\n\n{unstable.describe()}")
        report_run.finish()
    except BaseException:
        report_run.finish("FAILED")
        raise
    uri, port = cfg.tracking.uri, cfg.compare.ui_port
    print("\n".join([f"verdict: inconclusive: the model could not be fitted: {reason}",
                      f"cells: {unstable.describe()}",
                      f"report: {folder / 'report.html'} and {folder / 'report.md'} (what to run next)",
                      open_ui_line(uri, port),
                      f"  the report: {runs_table_url(report_run.experiment_id, port, report_run.run_id, ui_base(uri, port))}"
                      " (Artifacts)"]))
    return 1
