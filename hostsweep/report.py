"""The cell table: rows for the CSV in the run directory, and the printed summary."""
from __future__ import annotations

from typing import Iterable

from hostsweep.worker import CellResult

COLUMNS = ("sku", "model", "mode", "tp", "batch", "ctx", "step_ms", "ci95_ms", "device_ms", "host_frac",
           "regime", "host", "status")


def cell_row(result: CellResult, run_id: str) -> dict[str, object]:
    """One flat row per cell: params, metrics, provenance, and its MLflow run id."""
    m = result.measurement
    return {
        **result.params,
        "status": result.status,
        "step_ms": m.step_ms if m else None,
        "step_ci_low_ms": m.step_ci_low_ms if m else None,
        "step_ci_high_ms": m.step_ci_high_ms if m else None,
        "wall_1_ms": m.wall_1_ms if m else None,
        "wall_T_ms": m.wall_T_ms if m else None,
        "device_ms": result.split.device_ms if result.split else None,
        "host_ms": result.split.host_ms if result.split else None,
        "host_frac": result.split.host_frac if result.split else None,
        "overlap_gap_ms": result.split.overlap_gap_ms if result.split else None,
        "profiler_overhead": result.split.profiler_overhead if result.split else None,
        "kernel_source": result.split.kernel_source if result.split else None,
        "regime": result.split.regime if result.split else None,
        "r2_wall": result.linearity.r2_wall if result.linearity else None,
        "r2_kernel": result.linearity.r2_kernel if result.linearity else None,
        "slope_disagreement": result.linearity.slope_disagreement if result.linearity else None,
        "host": result.host.get("hostname", "?"),
        "device": result.host.get("device_name", "?"),
        "cell_key": result.key,
        "mlflow_run_id": run_id,
        "error": (result.error or "").splitlines()[0] if result.error else "",
    }


def _display(row: dict[str, object]) -> dict[str, str]:
    shown = {k: str(row.get(k, "")) for k in COLUMNS}
    if row.get("step_ms") is not None:
        shown["step_ms"] = f"{row['step_ms']:.3f}"
        shown["ci95_ms"] = f"[{row['step_ci_low_ms']:.3f}, {row['step_ci_high_ms']:.3f}]"
    else:
        shown["step_ms"], shown["ci95_ms"] = "-", "-"
    if row.get("device_ms") is not None:
        shown["device_ms"] = f"{row['device_ms']:.3f}"
        shown["host_frac"] = f"{row['host_frac']:.1%}"
    else:
        shown["device_ms"], shown["host_frac"], shown["regime"] = "-", "-", "-"
    return shown


def format_table(rows: Iterable[dict[str, object]]) -> str:
    """A fixed-width text table, one line per cell, in grid order."""
    shown = [_display(r) for r in rows]
    widths = {c: max([len(c)] + [len(s[c]) for s in shown]) for c in COLUMNS}
    lines = ["  ".join(c.ljust(widths[c]) for c in COLUMNS)]
    lines.append("  ".join("-" * widths[c] for c in COLUMNS))
    lines += ["  ".join(s[c].ljust(widths[c]) for c in COLUMNS) for s in shown]
    return "\n".join(lines)
