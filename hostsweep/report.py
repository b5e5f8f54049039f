"""The cell table: rows for the CSV in the run directory, and the printed summary."""
from __future__ import annotations

from typing import Iterable

from hostsweep.worker import CellResult

COLUMNS = ("sku", "model", "mode", "tp", "batch", "ctx", "step_ms", "ci95_ms", "host", "status")


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
    return shown


def format_table(rows: Iterable[dict[str, object]]) -> str:
    """A fixed-width text table, one line per cell, in grid order."""
    shown = [_display(r) for r in rows]
    widths = {c: max([len(c)] + [len(s[c]) for s in shown]) for c in COLUMNS}
    lines = ["  ".join(c.ljust(widths[c]) for c in COLUMNS)]
    lines.append("  ".join("-" * widths[c] for c in COLUMNS))
    lines += ["  ".join(s[c].ljust(widths[c]) for c in COLUMNS) for s in shown]
    return "\n".join(lines)
