"""The cross-SKU comparison report (pure): fit.json and the selected cells in, a Document
(report/document.py) and the figures (report/figures.py) out, every number beside the
MLflow run it comes from. A SKU or mode the study does not have is reported absent.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pandas as pd

from hostsweep.config.redact import redact
from hostsweep.measure.unstable import exclude_unstable
from hostsweep.report import figures as F
from hostsweep.report import fit_tables
from hostsweep.report.document import Bullets, Document, Figure, Heading, Table, Text
from hostsweep.report.study_modes import mode_sections
from hostsweep.report.tables import host_phase_table
from hostsweep.report.term_tables import decomposition_section, terms_section

# the reported numbers of the tensor-parallel study [2] (README.md#references), quoted beside
# a study of its design
TP_STUDY_SHRINK = ("the tensor-parallel study *Why Adding GPUs Should — But Doesn't — Halve Decode* (70B, H100 "
                   "TP-2→4): 1.11× in-regime (1.18× with its outlier), ideal 2×, baseline 1.36–1.53×")


@dataclass(frozen=True)
class Context:
    """Where the report's inputs came from, for the provenance section."""

    study: str
    experiment: str
    experiment_id: str
    tracking_uri: str
    compare_run_id: str
    fit_run_id: str
    models_experiment: str
    created: str
    command: str
    expected_skus: tuple[str, ...] = ()
    sources: list[dict[str, Any]] = field(default_factory=list)  # fixed terms: term, sku, value, source, run_id
    warnings: list[str] = field(default_factory=list)  # about the fixed terms
    exclude_unstable: bool = True  # fit.exclude_unstable: the study-wide parts leave unstable cells out too


def _provenance(ctx: Context, cells: pd.DataFrame) -> list:
    parents = sorted(cells["parent_run_id"].dropna().unique()) if "parent_run_id" in cells else []
    rows = [{"what": "this report", "experiment": ctx.experiment, "run_id": ctx.compare_run_id},
            {"what": "the fit (fit.json, model)", "experiment": ctx.models_experiment, "run_id": ctx.fit_run_id}]
    rows += [{"what": f"sweep ({(cells['parent_run_id'] == p).sum()} cells)", "experiment": ctx.experiment,
              "run_id": p} for p in parents]
    rows += [{"what": f"calibration: {s['term']} {s['sku']}", "experiment": "calibration", "run_id": s["run_id"]}
             for s in ctx.sources if s["run_id"]]
    return [Heading("Where every number comes from"),
            # the report is a file and an MLflow artifact: a password in the URI stays out
            Text(f"Store `{redact(ctx.tracking_uri)}`, experiment `{ctx.experiment}` (id {ctx.experiment_id}); "
                 f"{len(cells)} FINISHED cell runs, each listed by run id in the last section. "
                 f"Generated {ctx.created} by `{redact(ctx.command)}`."),
            Table(pd.DataFrame(rows))]


def host_speed_table(cells: pd.DataFrame) -> Optional[pd.DataFrame]:
    """Per SKU, its nodes' speed canary over its cells (run/canary.py: a fixed host workload
    timed beside every pair): median, range, and how far it moved within a group at most;
    where a SKU's workers had a CUDA device, the median of the canary's GPU kernel beside it
    (recorded apart: a GPU running slow is not a slow host). None when no cell carries a
    canary (measured before the canary existed)."""
    if "canary_ms" not in cells or cells["canary_ms"].isna().all():
        return None
    shift = cells["canary_shift_pct"] if "canary_shift_pct" in cells else pd.Series(float("nan"), index=cells.index)
    frame = pd.DataFrame({"sku": cells["sku"], "canary": pd.to_numeric(cells["canary_ms"], errors="coerce"),
                          "shift": pd.to_numeric(shift, errors="coerce")}).dropna(subset=["canary"])
    table = frame.groupby("sku").agg(cells=("canary", "size"), canary_ms_median=("canary", "median"),
                                     canary_ms_min=("canary", "min"), canary_ms_max=("canary", "max"),
                                     moved_within_a_group_pct_max=("shift", "max")).reset_index()
    if "gpu_canary_ms" in cells and cells["gpu_canary_ms"].notna().any():
        gpu = pd.to_numeric(cells["gpu_canary_ms"], errors="coerce").groupby(cells["sku"]).median()
        table["gpu_kernel_ms_median"] = table["sku"].map(gpu)
    return table


def _host_speed(cells: pd.DataFrame) -> list:
    table = host_speed_table(cells)
    if table is None:
        return []
    return [Heading("Host speed per SKU (speed canary)"),
            Text("The same fixed host workload timed beside every timed pair, on each SKU's nodes: a held-out SKU "
                 "whose host term is falsified while its canary is slower than the training SKU's may have a slower "
                 "host CPU rather than a different framework overhead; one whose canary moved within a group was "
                 "measured while the node changed speed."),
            Table(table)]


def _verdicts(fit: dict[str, Any], groups: pd.DataFrame) -> list:
    lines = [f"**Host term across held-out groups: {fit['verdict']['verdict']}** ({fit['verdict']['reason']})"]
    if fit["verdict"].get("noise"):  # inconclusive: could these cells have told at all?
        lines.append(f"Noise: {fit['verdict']['noise']['summary']}")
    lines += [f"held-out {r.sku} TP-{r.tp}: **{r.verdict}** — {r.reason}" for r in groups.itertuples()]
    return [Heading("Verdict"), Bullets(tuple(lines))]


def _unstable(fit: dict[str, Any], cells: pd.DataFrame, enabled: bool) -> list:
    """The cells the sweep flagged unstable: how many, why, and whether they were left out
    of the fit (fit.json's record) and of the study-wide tables and figures."""
    recorded = fit.get("unstable")
    fitted = f"The fit: {recorded['summary']}." if recorded else "The fit records no stability selection."
    if "stable" not in cells or not cells["stable"].fillna("").astype(str).str.strip().any():
        return [Heading("Unstable cells"), Text("The selected cells carry no stability verdict (measured before "
                                                f"it): every one is treated as stable. {fitted}")]
    flagged = exclude_unstable(cells, True)[1]
    kept = (f" {flagged.machine_only} more are flagged only for the machine (`machine_speed`, `replicate`) and "
            "kept: the machine's speed moved over their group's rounds while their own pairs agreed with their "
            "companions' (the host speed table shows each group's canary)." if flagged.machine_only else "")
    if not flagged.count:
        return [Heading("Unstable cells"), Text(f"No selected cell is left out as unstable.{kept} {fitted}")]
    why = ", ".join(f"{reason}: {n}" for reason, n in flagged.reasons().items())
    where = ("left out of the study-wide tables and figures below" if enabled
             else "kept in the study-wide tables and figures below (fit.exclude_unstable=false)")
    return [Heading("Unstable cells"),
            Text(f"{flagged.count} of {flagged.total} selected cells are flagged unstable ({why}), {where}.{kept} "
                 f"{fitted}"),
            Table(flagged.left_out, "the unstable cells, with the sweep's reasons")]


def _terms(fit: dict[str, Any], ctx: Context) -> list:
    scale, options = fit["scale"], fit["options"]
    text = (f"g = {scale['g']:.3f} fitted on {scale['cells']} in-regime cells of sku {options['train_sku']} "
            f"TP {options['train_tp']} ({scale['method']}); with the out-of-regime cells of that selection "
            f"g = {scale['g_with_out_of_regime']:.3f}. Model form `{options['form']}`, bound `{options['bound']}`.")
    blocks = [Heading("Fixed terms and the fitted scale"), Text(text),
              Table(pd.DataFrame(ctx.sources), "where each fixed term came from")]
    paths = fit_tables.allreduce_paths_table(fit.get("calibration", {}))
    if not paths.empty:  # T_ar's path: the engine's communicator, or the TP study's standalone method
        blocks += [Text(fit_tables.allreduce_paths_text(paths) or "T_ar per SKU, on the path each was measured on:"),
                   Table(paths, "T_ar in use (path_used, what ran) beside the standalone all-reduce, the TP "
                         "study's method")]
    return blocks


def _heldout(fit: dict[str, Any], pred: pd.DataFrame, groups: pd.DataFrame, forms: pd.DataFrame,
             figures: dict[str, Path]) -> list:
    blocks: list = [Heading("Held-out (SKU, TP) groups"),
                    Text(f"Model = form `{fit['options']['form']}`; baseline = g·T_cmp/k + T_ar (Eq. 1 of the tensor-parallel study). "
                         "MAPE in percent over each group's in-regime cells; *_in_ci counts predictions inside the "
                         "measured 95% CI.")]
    shown = groups.drop(columns=["reason"]) if len(groups) else groups  # the reasons are in the verdict list
    blocks.append(Table(shown, digits=2) if len(groups) else Text("No held-out group: nothing to compare."))
    if len(forms):
        wide = forms.pivot_table(index="form", columns=["sku", "tp"], values="mape").reset_index()
        wide.columns = ["form"] + [f"{s} TP-{k} MAPE" for s, k in wide.columns[1:]]
        blocks.append(Table(wide, "every host form's held-out MAPE (%); CIs in the figure", 2))
    blocks += [Figure(figures["predicted_vs_measured"], "Predicted vs measured, every cell: stars out of regime, "
                      "red circles falsifying (CI below H + T_ar)."),
               Figure(figures["heldout_mape"], "Held-out MAPE per host form with bootstrap 95% CIs.")]
    return blocks


def _falsification(fit: dict[str, Any], pred: pd.DataFrame) -> list:
    info, below = fit["falsification"], fit_tables.below_bound_cells(pred)
    blocks: list = [Heading("Falsification: cells below the lower bound H + T_ar"),
                    Text(f"Bound: {info['bound']}. Rule: {info['rule']}.")]
    blocks.append(Table(below, "margin = step − bound (ms); ci_excludes_bound: the whole 95% CI lies below "
                        "(these are the evidence cells)") if len(below)
                  else Text("No held-out in-regime cell measures below the bound."))
    for group in (g for g in fit["groups"] if g["role"] == "held-out"):
        if group["falsifying_cells"]:
            blocks.append(Text(f"{group['sku']} TP-{group['tp']}: {group['falsifying_cells']} cell(s) with the CI "
                               f"below the bound, {group['falsifying_needed']} needed to falsify the group → "
                               f"{'falsified' if group['falsified'] else 'not falsified'}."))
    return blocks


def _shrink(fit: dict[str, Any], pred: pd.DataFrame, figures: dict[str, Path], resamples: int) -> list:
    table = fit_tables.shrink(fit)
    per_tp, ratios = fit_tables.residuals(pred, resamples)
    return [Heading("TP step shrink k → next k"),
            Table(table, "mean step(k)/step(next k) over matched (batch, ctx) cells; ideal = next k / k", 3)
            if len(table) else Text("Only one TP degree per (SKU, model): no shrink to report."),
            Text(f"For reference, {TP_STUDY_SHRINK}."),
            Heading("Residual after compute and all-reduce, per TP degree"),
            Text("residual = measured step − g·T_cmp/k − T_ar (in-regime cells): the part the additive host term "
                 "must explain. A TP-invariant term keeps it constant (ratio 1), C·k multiplies it by k'/k, "
                 "C/k divides it. model_H_mean_ms is the pinned H(N) for comparison."),
            Table(per_tp, digits=3), Table(ratios, "ratio of mean residuals over matched cells, bootstrap 95% CI", 3)
            if len(ratios) else Text("No matched cells at two TP degrees: the residual cannot be compared across TP."),
            *decomposition_section(fit),
            Figure(figures["step_composition"], "Decode-step composition per TP degree.")]


def _study_wide(cells: pd.DataFrame, regime: pd.DataFrame, figures: dict[str, Path], ctx: Context) -> list:
    present = set(cells["sku"])
    absent = [s for s in ctx.expected_skus if s not in present]
    blocks: list = [Heading("Study-wide"),
                    Text("SKUs with cells: " + ", ".join(sorted(present))
                         + (f"; absent (no cells selected): {', '.join(absent)}" if absent else "")),
                    Heading("Regime map", 3), Figure(figures["regime_map"], "Host fraction by model size, TP and batch "
                                                     "(mean over contexts): bold host-bound, `?` undetermined (a "
                                                     "host_frac CI across the threshold, or too few profiled "
                                                     "pairs for one), `~` contexts disagree (mixed); the table "
                                                     "gives the envelope of the contexts' CIs. Implausible splits "
                                                     "are left out."),
                    Table(regime, digits=3) if len(regime) else Text("absent: no split cells"),
                    Figure(figures["step_times"], "Step time per cell with 95% CI, one panel per SKU.")]
    phases = host_phase_table(cells)
    if len(phases):
        blocks += [Heading("Host phases", 3),
                   Text("Milliseconds per decode step: device, each host phase on the step's critical path "
                        "(measure/phases.py), and the front-end's output processing, which overlaps the next "
                        "step (its exposed part is the phase frontend_exposed)."),
                   Table(phases, digits=3)]
    for section in mode_sections(cells):
        blocks.append(Heading(section.title, 3))
        if section.status != "present":
            blocks.append(Text(section.status))
            continue
        blocks += [Table(frame, name, 3) for name, frame in section.tables.items()]
        blocks.append(Table(pd.DataFrame([section.summary]), "summary", 3))
    return blocks


def _cells(pred: pd.DataFrame) -> list:
    columns = [c for c in ("sku", "model", "mode", "tp", "batch", "ctx", "role", "in_regime", "step_ms",
                           "step_ci_low_ms", "step_ci_high_ms", "predicted_ms", "baseline_ms", "ape_pct",
                           "bound_ms", "run_id") if c in pred]
    return [Heading("Every cell, with its MLflow run"), Table(pred[columns], digits=3)]


def write_figures(pred: pd.DataFrame, cells: pd.DataFrame, forms: pd.DataFrame, regime: pd.DataFrame,
                  families: dict[str, str], folder: Path) -> dict[str, Path]:
    """The five comparison figures as PNGs under `folder`."""
    made = {"step_composition": F.step_composition(pred), "predicted_vs_measured": F.predicted_vs_measured(pred),
            "heldout_mape": F.heldout_mape(forms, families), "regime_map": F.regime_map(regime),
            "step_times": F.step_times(cells)}
    return {name: F.save(fig, folder / f"{name}.png") for name, fig in made.items()}


def build(ctx: Context, cells: pd.DataFrame, fit: dict[str, Any], folder: Path) -> tuple[Document, pd.DataFrame]:
    """The report and its figures (written under folder/figures); also the group table."""
    pred = fit_tables.predictions(fit)
    resamples = int(fit["options"]["resamples"])
    groups = fit_tables.heldout_groups(fit, pred)
    forms = fit_tables.form_mape(pred, [f["form"] for f in fit["forms"]], resamples)
    stable = exclude_unstable(cells, ctx.exclude_unstable)[0]
    regime = fit_tables.regime_table(stable)
    families = {f["form"]: f["family"] for f in fit["forms"]}
    figures = write_figures(pred, stable, forms, regime, families, folder / "figures")
    doc = Document(f"Cross-SKU comparison: {ctx.study}")
    for part in (_verdicts(fit, groups), terms_section(fit, pred), _unstable(fit, cells, ctx.exclude_unstable), _host_speed(cells),
                 _provenance(ctx, cells),
                 _terms(fit, ctx),
                 _heldout(fit, pred, groups, forms, figures), _falsification(fit, pred),
                 _shrink(fit, pred, figures, resamples), _study_wide(stable, regime, figures, ctx), _cells(pred)):
        doc.add(*part)
    if fit["warnings"] or ctx.warnings:
        doc.add(Heading("Warnings"), Bullets(tuple(ctx.warnings + fit["warnings"])))
    return doc, groups
