"""The fit report for a terminal: titled tables with named columns, rendered from the
same FitReport.to_dict() that is written as fit.json (pure; nothing here is computed
that the JSON does not hold)."""
from __future__ import annotations

from typing import Any

import pandas as pd

PARAM_COLUMNS = ("C_ms", "C0_ms", "C1_ms", "s0_ms", "s1_ms")


def _table(rows: list[dict[str, Any]] | pd.DataFrame, digits: int = 3) -> str:
    frame = pd.DataFrame(rows)
    if frame.empty:
        return "  (none)"
    return frame.to_string(index=False, na_rep="-", float_format=lambda v: f"{v:.{digits}f}")


def _title(text: str) -> str:
    return f"\n== {text} =="


def _scale(data: dict[str, Any]) -> list[str]:
    scale, options, host = data["scale"], data["options"], data["calibration"]["host"]
    lines = [_title("Compute scale g"),
             f"g = {scale['g']:.3f}: {scale['method']} "
             f"(s0_ms = {host['s0_ms']:.3f}, s1_ms = {host['s1_ms']:.4f}); {scale['cells']} training cells, "
             f"sku {options['train_sku']} tp {options['train_tp']} in-regime"
             + ("; at its lower bound 0" if scale["at_bound"] else ""),
             f"g with the {scale['cells_with_out_of_regime'] - scale['cells']} out-of-regime cell(s) of the training "
             f"selection: {scale['g_with_out_of_regime']:.3f} ({scale['cells_with_out_of_regime']} cells)"]
    if host.get("fitted"):
        lines.append(f"H(N) from the TP-1 cells: {host['fitted']}")
    if scale["g_mode"] == "joint":
        lines.append("g_mode=joint: each form below fits its own g (see the condition numbers)")
        lines.append(_table([{"form": f, **v} for f, v in scale["joint"].items()]))
    return lines


def _forms(data: dict[str, Any]) -> list[str]:
    host = data["calibration"]["host"]
    train = {s["form"]: s for s in data["scores"] if s["role"] == "train"}
    rows = []
    for form in data["forms"]:
        params = dict(form["params_ms"])
        if form["form"] == "fixed_microbench":
            params = {"s0_ms": host["s0_ms"], "s1_ms": host["s1_ms"]}
        rows.append({"form": form["form"], "family": form["family"], "host_term": form["formula"],
                     "g": form["g"], **{c: params.get(c) for c in PARAM_COLUMNS},
                     "at_bound": ",".join(form["at_bound"]) or "-",
                     "train_mape_mean": train.get(form["form"], {}).get("mape_mean")})
    g_note = "g held at the global value" if data["scale"]["g_mode"] == "pinned" else "g fitted per form"
    return [_title(f"Host forms, fitted on the training cells ({g_note}; fixed_microbench's s0/s1 are pinned)"),
            _table(rows)]


def _evidence_line(group: dict[str, Any]) -> str:
    spread, versus = group["scaling_minus_invariant"], group["baseline_minus_winner"]
    beats = "beats" if group["beats_baseline"] else "does not beat"
    return (f"verdict: {group['verdict']} ({group['reason']}); MAPE(k-scaling) − MAPE(k-invariant) = "
            f"{spread['diff']:.2f} [{spread['ci_low']:.2f}, {spread['ci_high']:.2f}]\n"
            f"winner {group['winner']} {beats} the baseline: MAPE(baseline) − MAPE(winner) = "
            f"{versus['diff']:.2f} [{versus['ci_low']:.2f}, {versus['ci_high']:.2f}]"
            + (f"\nnoise: {group['noise']['sentence']}" if group.get("noise") else ""))


def _heldout(data: dict[str, Any]) -> list[str]:
    lines = []
    for group in (g for g in data["groups"] if g["role"] == "held-out"):
        state = "FALSIFIED, kept out of the comparison" if group["falsified"] else \
            "ALL-REDUCE MISMATCH, kept out of the comparison" if group.get("verdict") == "allreduce_mismatch" else "compared"
        if group["falsifying_cells"]:
            state += (f"; {group['falsifying_cells']} cell(s) below the bound, "
                      f"{group['falsifying_needed']} needed to falsify")
        lines.append(_title(f"Held-out {group['sku']} TP-{group['tp']}: heldout_n = {group['n']} in-regime cells "
                            f"({group['out_of_regime']} out of regime), {state}"))
        scores = [{k: s[k] for k in ("form", "mape_mean", "mape_p95", "mape_max", "n")} for s in data["scores"]
                  if (s["sku"], s["tp"], s["role"]) == (group["sku"], group["tp"], "held-out")]
        lines.append(_table(scores, 2))
        if group.get("verdict") in ("falsified", "allreduce_mismatch"):  # the family evidence is kept apart
            lines.append(f"verdict: {group['verdict']} ({group['reason']}); on these cells alone the evidence says "
                         f"{group['evidence_apart']['verdict']}")
        elif "verdict" in group:
            lines.append(_evidence_line(group))
    return lines


def _falsification(data: dict[str, Any]) -> list[str]:
    info = data["falsification"]
    lines = [_title(f"Falsification: bound {info['bound']}"), f"rule: {info['rule']}"]
    if info["judged_on_point"]:
        lines.append(f"{info['judged_on_point']} held-out cells have no CI columns and were judged on point values")
    columns = ("sku", "model", "tp", "batch", "ctx", "step_ms", "step_ci_low_ms", "step_ci_high_ms",
               "bound_ms", "margin_ms", "judged_on")
    cells = [{k: c.get(k) for k in columns} for c in info["cells"]]
    lines.append(_table(cells) if cells else "no held-out in-regime cell lies below the bound")
    return lines


def _shrink(data: dict[str, Any]) -> list[str]:
    rows = [{"sku": r["sku"], "model": r["model"], "tp": f"{r['from_tp']}->{r['to_tp']}", "pairs": r["pairs"],
             "measured_in_regime": r["measured_in_regime"], "measured_all": r["measured_all"],
             "model_in_regime": r["model_in_regime"], "baseline_min": r["baseline_in_regime_min"],
             "baseline_max": r["baseline_in_regime_max"]} for r in data["shrink"]]
    return [_title("TP shrink: mean step(k) / step(next k) over matched (batch, ctx) cells"), _table(rows)]


def render(data: dict[str, Any]) -> str:
    """The whole report as text, from FitReport.to_dict()."""
    verdict = data["verdict"]
    lines = [f"cells: {data['unstable']['summary']}"] if data.get("unstable") else []
    lines += _scale(data) + _forms(data) + _heldout(data)
    lines += [_title("Verdict on the host term"), f"{verdict['verdict']}: {verdict['reason']}"]
    if verdict.get("noise"):
        lines.append(f"noise: {verdict['noise']['summary']}")
    lines += _falsification(data) + _shrink(data)
    if data["warnings"]:
        lines += [_title("Warnings")] + [f"- {w}" for w in data["warnings"]]
    return "\n".join(lines).lstrip("\n")
