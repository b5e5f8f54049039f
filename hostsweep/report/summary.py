"""What a finished sweep hands a person and a script (pure): summary.json, the machine-
readable record of every cell (the counterpart of `vllm bench latency --output-json` and
optimum-benchmark's benchmark_report.json), and the Markdown description of the sweep's
MLflow parent run.

Both are built from the cell table (cells.csv as a DataFrame), never from a list of
results held in memory, so they cost the same for 6 cells or 10,000.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import pandas as pd

from hostsweep.config.grid import CELL_AXES, INT_PARAMS, PROTOCOL_PARAMS, engine_label
from hostsweep.measure.protocol import prefill_bound_T
from hostsweep.report.tables import ci_percent, format_markdown

SUMMARY_FILE = "summary.json"
SUMMARY_FORMAT = 2  # 2: the step's CI is ci_low/ci_high at the study's ci_level (1 named it ci95 at any level)
PARAMS = (*CELL_AXES, *PROTOCOL_PARAMS)  # a cell's "params" in summary.json (config/grid.py)
STEP = {"median": "step_ms", "ci_low": "step_ci_low_ms", "ci_high": "step_ci_high_ms",
        "p10": "step_p10_ms", "p25": "step_p25_ms", "p75": "step_p75_ms", "p90": "step_p90_ms",
        "mde_pct": "mde_pct"}  # the minimum detectable effect (measure/detectable.py)
# The split and its CIs over the profiled pairs (none below 3 pairs: measure/split_stats.py).
SPLIT = ("device_ms", "device_ci_low_ms", "device_ci_high_ms", "host_ms", "host_ci_low_ms", "host_ci_high_ms",
         "host_frac", "host_frac_ci_low", "host_frac_ci_high", "regime", "split_pairs", "device_floor_ms",
         "kernel_source")
WHERE = ("hostname", "device_name", "vllm_version", "torch_version")
STABILITY = {"foreign_cpu_frac": "foreign_cpu_frac", "foreign_cpu_frac_max": "foreign_cpu_frac_max",
             "steal_frac": "steal_frac", "load1_max": "load1_max", "attempts": "stability_attempts",
             "replicate_step_ms": "replicate_step_ms", "periods": "periods", "period_spread_pct": "period_spread_pct",
             "clean_pairs": "clean_pairs", "contended_rounds": "contended_rounds", "canary_ms": "canary_ms",
             "canary_shift_pct": "canary_shift_pct", "common_shift_pct": "common_shift_pct",
             "gpu_canary_ms": "gpu_canary_ms", "warmup_rounds": "warmup_rounds", "canary_r": "canary_r",
             "canary_explains_pct": "canary_explains_pct"}
# MLflow's run tags cap at 8,000 characters and longer values are cut silently (server side):
# the parent's description stays under that, and says where the rest is.
NOTE_LIMIT = 7_900
# Columns of the printed table that summary.json rebuilds exactly (tests/unit/test_summary.py).
ROW_KEYS = (*PARAMS, "status", *STEP.values(), *SPLIT, "hostname", "stable", "unstable_reasons", "cell_key",
            "mlflow_run_id", "error")


def _is_unstable(row: dict[str, Any]) -> bool:
    return str(row.get("stable")).lower() == "false"


def _reasons(row: dict[str, Any]) -> list[str]:
    return _names(row.get("unstable_reasons"), ",")


def _names(value: Any, separator: str) -> list[str]:
    text = _plain(value)
    return [r for r in str(text).split(separator) if r] if text else []


def stability_counts(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """How many measured cells are unstable, of how many judged, and for which reasons."""
    judged = [r for r in rows if str(r.get("stable")).lower() in ("true", "false")]
    unstable = [r for r in judged if _is_unstable(r)]
    reasons = pd.Series([reason for r in unstable for reason in _reasons(r)], dtype=object).value_counts()
    return {"unstable": len(unstable), "judged": len(judged), "reasons": {str(k): int(v) for k, v in reasons.items()}}


def stability_line(rows: list[dict[str, Any]]) -> Optional[str]:
    """'2 of 6 cells unstable (foreign_cpu 2, drift 1)', or None when no cell was judged
    (cells measured before the verdict existed)."""
    counts = stability_counts(rows)
    if not counts["judged"]:
        return None
    if not counts["unstable"]:
        return f"all {counts['judged']} measured cells stable"
    why = ", ".join(f"{reason} {n}" for reason, n in counts["reasons"].items())
    return f"{counts['unstable']} of {counts['judged']} measured cells unstable ({why})"


def design_counts(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """What the measurement design did over the run (measure/periods.py): cells timed in
    more than one period (the re-measure rate), and the speed canary's median and its
    largest move within a group; None where the cells carry no such metric."""
    periods = [int(p) for p in (_plain(r.get("periods")) for r in rows) if p is not None]
    prefill_bound = prefill_bound_cells(rows)
    canary = [float(c) for c in (_plain(r.get("canary_ms")) for r in rows) if c is not None]
    shifts = [float(c) for c in (_plain(r.get("canary_shift_pct")) for r in rows) if c is not None]
    # what each group's later periods were for, a group counted once (its cells all carry it)
    per_group = {(engine_label(r), str(text)) for r in rows if (text := _plain(r.get("remeasured_for")))}
    why = pd.Series([w for _, text in sorted(per_group) for w in text.split(";") if w], dtype=object)
    warmups = [int(w) for w in (_plain(r.get("warmup_rounds")) for r in rows) if w is not None]
    explained = [float(e) for e in (_plain(r.get("canary_explains_pct")) for r in rows) if e is not None]
    return {"cells": len(periods), "remeasured": sum(p > 1 for p in periods),
            "warmup_rounds": (min(warmups), max(warmups)) if warmups else None,
            "remeasured_for": {str(k): int(v) for k, v in why.value_counts().items()},
            "groups_annotated": annotated_groups(rows),
            "max_periods": max(periods, default=None),
            "canary_ms": float(pd.Series(canary).median()) if canary else None,
            "canary_shift_pct_max": max(shifts, default=None),
            # how much of the steps' round-to-round moves the canary explained, over the groups (%)
            "canary_explains_pct": (min(explained), max(explained)) if explained else None,
            "prefill_bound": prefill_bound, "prefill_bound_T": max(prefill_bound.values(), default=None)}


def annotated_groups(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each engine group whose cells carry a group annotation (measure/stability.ANNOTATIONS),
    keyed 'cpu/tiny-llama/eager/tp1': the annotations and the largest common and canary
    shifts (%) its cells recorded. One entry a group: it is what the group met, not a cell."""
    groups: dict[str, dict[str, Any]] = {}
    for r in rows:
        names = [a for a in str(_plain(r.get("group_annotations")) or "").split(",") if a]
        if not names:
            continue
        entry = groups.setdefault(engine_label(r), {"annotations": [], "common_shift_pct": None, "canary_shift_pct": None})
        entry["annotations"] = sorted({*entry["annotations"], *names})
        for key in ("common_shift_pct", "canary_shift_pct"):
            value = _plain(r.get(key))
            if value is not None:
                entry[key] = max(float(value), entry[key] if entry[key] is not None else float("-inf"))
    return groups


def prefill_bound_cells(rows: list[dict[str, Any]]) -> dict[str, int]:
    """The measured cells whose T=1 generate (prefill and one step) outlasts their T − 1 steps,
    each with the T that would make its steps outlast it (protocol.prefill_bound_T): their
    pairs' noise is mostly the prefill's. Keyed 'b8 ctx1024' (the model first when the rows
    hold several)."""
    models = {str(r.get("model")) for r in rows}
    found = {}
    for r in rows:
        wall_1, step, T = (_plain(r.get(k)) for k in ("wall_1_ms", "step_ms", "T"))
        if None in (wall_1, step, T) or str(r.get("status")) != "FINISHED":
            continue
        wanted = prefill_bound_T(float(wall_1), float(step), int(T))
        if wanted is not None:
            found[(f"{r.get('model')} " if len(models) > 1 else "") + f"b{r.get('batch')} ctx{r.get('ctx')}"] = wanted
    return found


def design_line(rows: list[dict[str, Any]]) -> Optional[str]:
    """'re-measured 4 of 6 cells (2 periods); speed canary 1.712 ms, moved up to 12 % within
    a group', or None for cells measured before periods and the canary existed."""
    d = design_counts(rows)
    if not d["cells"]:
        return None
    why = ", ".join(f"{reason}" + (f" ×{n}" if n > 1 else "") for reason, n in d["remeasured_for"].items())
    parts = [f"re-measured {d['remeasured']} of {d['cells']} cells ({d['max_periods']} periods"
             + (f"; a period for {why}" if why else "") + ")" if d["remeasured"]
             else f"no cell re-measured ({d['cells']} cells, one period each)"]
    if d["warmup_rounds"] is not None:
        low, high = d["warmup_rounds"]
        parts.append(f"warm-up {low} round(s)" if low == high else f"warm-up {low}-{high} rounds a group")
    if d["canary_ms"] is not None:
        moved = f", moved up to {d['canary_shift_pct_max']:.0f} % within a group" \
            if d["canary_shift_pct_max"] is not None else ""
        explains = d["canary_explains_pct"]
        tracked = "" if explains is None else (
            f", explains {explains[0]:.0f} % of the steps' round-to-round moves" if round(explains[0]) == round(explains[1])
            else f", explains {explains[0]:.0f}–{explains[1]:.0f} % of the steps' round-to-round moves")
        parts.append(f"speed canary {d['canary_ms']:.3f} ms{moved}{tracked}")
    for group, note in d["groups_annotated"].items():
        moved = ", ".join(f"{what} {note[key]:.0f} %" for what, key in
                          (("cells together moved", "common_shift_pct"), ("canary", "canary_shift_pct"))
                          if note[key] is not None)
        parts.append(f"group note {group}: {', '.join(note['annotations'])}" + (f" ({moved})" if moved else "")
                     + ", no cell's flag")
    if d["prefill_bound"]:
        named = ", ".join(list(d["prefill_bound"])[:3]) + (", …" if len(d["prefill_bound"]) > 3 else "")
        parts.append(f"{len(d['prefill_bound'])} cell(s) prefill for longer than their T−1 steps ({named}): their "
                     f"pairs are mostly prefill noise; measure.T={d['prefill_bound_T']} for them narrows their CIs "
                     "(docs/measurement.md#choosing-t)")
    return "; ".join(parts)


def machine_entry(rows: list[dict[str, Any]], dtype_why: str = "", preload_why: str = "") -> dict[str, Any]:
    """What the cells ran on (their device_name: the CPU's model, or the GPU's name), the
    vLLM release and the engine's dtype with why (`Study.dtype_why`; the cells' dtype alone
    for a table read back without its study), the CPU build's LD_PRELOAD (`Study.preload_why`),
    and the line the console prints of it."""
    devices, vllm, dtypes = (sorted({str(v) for r in rows if (v := _plain(r.get(k))) is not None})
                             for k in ("device_name", "vllm_version", "dtype"))
    dtype_text = dtype_why or "/".join(dtypes) or "unknown"
    line = f"{', '.join(devices) or 'device unknown'}" + (f", vLLM {', '.join(vllm)}" if vllm else "") \
        + f"; engine dtype {dtype_text}" + (f"; preload {preload_why}" if preload_why else "")
    return {"devices": devices, "vllm": vllm, "dtypes": dtypes, "dtype_why": dtype_why, "preload": preload_why,
            "line": line}


def _plain(value: Any) -> Any:
    """A JSON value: None for NaN/empty, Python ints and floats for numpy's."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if hasattr(value, "item"):
        value = value.item()
        if isinstance(value, float) and math.isnan(value):
            return None
    return None if value == "" else value


def phase_entry(row: dict[str, Any]) -> Optional[dict[str, Any]]:
    """A cell's host phases (ms per step, measure/phases.py), the front-end work beside the
    step (overlapped_*), and the share of host_ms the phases name; None for a cell without them."""
    phases = {k: _plain(row[k]) for k in row
              if k.startswith(("phase_", "overlapped_")) and _plain(row[k]) is not None}
    if not phases:
        return None
    return {**phases, **{k: _plain(row.get(k)) for k in ("forward_compute_ms", "attributed_frac")}}


def cell_entry(row: dict[str, Any], run_url: Optional[Callable[[str], str]] = None) -> dict[str, Any]:
    """One cell of summary.json from its cells.csv row."""
    params = {k: _plain(row.get(k)) for k in PARAMS if k in row}
    for key in INT_PARAMS:
        if params.get(key) is not None:
            params[key] = int(params[key])
    run_id = _plain(row.get("mlflow_run_id"))
    return {
        "cell_key": row.get("cell_key"),
        "status": row.get("status"),
        "params": params,
        "step_ms": {name: _plain(row.get(column)) for name, column in STEP.items()},
        "split": {k: _plain(row.get(k)) for k in SPLIT},
        "phases": phase_entry(row),
        "where": {k: _plain(row.get(k)) for k in WHERE},
        "stability": None if _plain(row.get("stable")) is None else {
            "stable": not _is_unstable(row), "reasons": _reasons(row),
            "group_annotations": _names(row.get("group_annotations"), ","),
            "remeasured_for": _names(row.get("remeasured_for"), ";"),
            **{name: _plain(row.get(column)) for name, column in STABILITY.items()}},
        "resumed": bool(_plain(row.get("resumed")) or False),
        "mlflow_run_id": run_id,
        "mlflow_url": run_url(run_id) if run_url and run_id else None,
        "error": _plain(row.get("error")),
    }


def build_summary(cells: pd.DataFrame, meta: dict[str, Any],
                  run_url: Optional[Callable[[str], str]] = None) -> dict[str, Any]:
    """summary.json: the sweep's meta (study, status, versions, git SHA, where its runs are)
    and one entry per cell, in the table's order."""
    rows = cells.to_dict("records") if len(cells) else []
    level = ci_percent(meta["ci_level"])
    return {
        "format": SUMMARY_FORMAT,
        **meta,
        "units": {"*_ms": "milliseconds per decode step (per output token), to the microsecond",
                  "host_frac": "host_ms / step_ms, a fraction",
                  "*_ci_low*, *_ci_high*": f"{level} CI over the split's profiled pairs (null below 3 pairs)",
                  "regime": "host-bound / device-bound when host_frac's CI lies on one side of "
                            "split.host_bound_threshold, undetermined when it straddles it or there is no CI",
                  "step_ms": f"median over the timed pairs with its {level} CI (ci_low, ci_high: exact order "
                             "statistics; over several periods, the mean of the periods' medians with a CI from "
                             "theirs), and percentiles of the pairs",
                  "foreign_cpu_frac": "CPU time of processes outside the engine and the sweep over the timed "
                                      "pairs, a fraction of the machine's CPU time"},
        "stability": {**stability_counts(rows), "line": stability_line(rows)},
        "design": {**design_counts(rows), "line": design_line(rows)},
        "cells": [cell_entry(row, run_url) for row in rows],
    }


def rows_from_summary(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The cell-table rows summary.json holds (ROW_KEYS): what the printed table shows."""
    rows = []
    for cell in summary["cells"]:
        row = {**cell["params"], "status": cell["status"], "cell_key": cell["cell_key"],
               "mlflow_run_id": cell["mlflow_run_id"], "error": cell["error"], "hostname": cell["where"]["hostname"]}
        row.update({column: cell["step_ms"][name] for name, column in STEP.items()})
        row.update(cell["split"])
        stability = cell.get("stability")
        row.update({"stable": None, "unstable_reasons": None} if stability is None else
                   {"stable": str(stability["stable"]).lower(), "unstable_reasons": ",".join(stability["reasons"])})
        rows.append(row)
    return rows


def sweep_description(meta: dict[str, Any], rows: list[dict[str, Any]],
                      run_url: Optional[Callable[[str], str]] = None, limit: int = NOTE_LIMIT) -> str:
    """The parent run's Markdown description: what was measured, how, the cell table (cut
    to fit MLflow's 8,000-character tag, with a pointer to cells.csv), where the rest is."""
    counts = pd.Series([str(r.get("status")) for r in rows]).value_counts().to_dict() if rows else {}
    head = [
        f"**{meta['what']}**, {len(rows)} cells (" + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) +
        f"), sweep {meta['status']}. Milliseconds per decode step; `host_frac` = host / step; "
        "a batch links to its cell's run.",
        *([f"**Stability**: {stability_line(rows)}; unstable cells are marked in the table's `stable` column "
           "(reasons: docs/measurement.md, Stability)."] if stability_line(rows) else []),
        "",
    ]
    has_phases = any(phase_entry(row) for row in rows)
    tail = [
        *(["", "**Host phases** per cell (ms per step: device, each host phase on the step's path, the "
           "front-end's work beside it): `host_phases.csv` and `figures/host_phases.png` (artifacts; "
           "docs/measurement.md, Host phases)."] if has_phases else []),
        "",
        f"Each step is the difference of a T=1 and a T={meta['T']} generate over T−1 steps ({meta['reps']} timed "
        f"pairs after {meta['warmups']} warm-ups; median and its {ci_percent(meta['ci_level'])} CI from order "
        "statistics, `ci_low` and `ci_high` in summary.json), split into device "
        f"(`{meta['kernel_source']}`) and host time from profiler traces.",
        "",
        f"Run directory `{meta['run_dir']}`: cells.csv, summary.json, figures/, workers/*.log. `cells.csv` and "
        "`summary.json` are artifacts of this run too, with the figures under `figures/`. "
        f"hostsweep {meta['versions'].get('hostsweep', '?')}, vLLM {meta['versions'].get('vllm', '?')}, "
        f"git {str(meta.get('git_sha', '?'))[:12]}. Links carry `?workflowType=machine_learning` "
        "(mlflow/mlflow#24498: without it MLflow 3 opens the GenAI overview).",
    ]
    budget = limit - sum(len(line) + 1 for line in head + tail)
    link = (lambda row: run_url(str(row["mlflow_run_id"])) if row.get("mlflow_run_id") else None) if run_url else None
    table = format_markdown(rows, budget, link,
                            overflow="… {shown} of {total} cells shown: every cell is in `cells.csv` (artifact).",
                            level=meta["ci_level"])
    return "\n".join([*head, table, *tail])[:limit]
