"""The printed cell table: one fixed-width line per cell, in grid order."""
from __future__ import annotations

from typing import Iterable

import pandas as pd

COLUMNS = ("sku", "model", "mode", "tp", "batch", "ctx", "step_ms", "ci95_ms", "device_ms", "host_frac",
           "regime", "host", "status")


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
    """A fixed-width text table, one line per cell, in grid order; a workload column when a
    study has a workload other than the default random prompts."""
    rows = list(rows)
    columns = list(COLUMNS)
    if any(str(r.get("workload", "random")) != "random" for r in rows):
        columns.insert(columns.index("ctx") + 1, "workload")
    shown = [{**_display(r), "workload": str(r.get("workload", "random"))} for r in rows]
    return pd.DataFrame(shown, columns=columns).to_string(index=False, justify="left")
