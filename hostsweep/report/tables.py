"""The printed cell table: one fixed-width line per cell, in grid order; and the same table
in Markdown for the sweep's MLflow description.

Numbers are shown as cells.csv and MLflow hold them: milliseconds per decode step to the
microsecond, host_frac as a fraction of step_ms (not a percentage), so a value read here is
the value a script reads there.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import pandas as pd

from hostsweep.config.grid import CELL_AXES
from hostsweep.measure.results import format_ci

# Axes shown only when some cell is off their usual value (random prompts).
VARIED_ONLY = {"workload": "random"}
# The cell's axes (config/grid.py), then what was measured.
COLUMNS = (*(a for a in CELL_AXES if a not in VARIED_ONLY), "step_ms", "ci_ms", "device_ms", "host_frac",
           "regime", "hostname", "status")
# The grid's inner axes vary within a sweep's table; any other axis the same for every cell
# is said once, above it (the run's name).
INNER_AXES = ("batch", "ctx")


def ci_percent(level: float) -> str:
    """'95%': a CI's level as every table, heading and summary names it (measure.ci_level,
    diff.ci_level), so that a study run at another level never reads as a 95 % one."""
    return f"{level * 100:g}%"


def column_label(column: str, level: float) -> str:
    """A column's header: the step CI's column names its level (ci95_ms, ci90_ms)."""
    return f"ci{ci_percent(level)[:-1]}_ms" if column == "ci_ms" else column


def _number(value: object) -> Optional[float]:
    """A finite float from a row value (resumed rows come back from MLflow; CSV gives NaN)."""
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return number if pd.notna(number) else None


def display_row(row: dict[str, object]) -> dict[str, str]:
    """A cell's row as the strings the table shows."""
    shown = {k: "" if row.get(k) is None or pd.isna(row.get(k)) else str(row.get(k))  # type: ignore[arg-type]
             for k in COLUMNS}
    step, low, high = (_number(row.get(k)) for k in ("step_ms", "step_ci_low_ms", "step_ci_high_ms"))
    shown["step_ms"] = f"{step:.3f}" if step is not None else "-"
    shown["ci_ms"] = format_ci(low, high, 3) or "-"
    device, frac = _number(row.get("device_ms")), _number(row.get("host_frac"))
    if device is not None and frac is not None:  # host_frac with its CI over the profiled pairs, when it has one
        low, high = _number(row.get("host_frac_ci_low")), _number(row.get("host_frac_ci_high"))
        ci = f" {format_ci(low, high, 2)}" if low is not None and high is not None else ""
        shown["device_ms"], shown["host_frac"] = f"{device:.3f}", f"{frac:.3f}{ci}"
    else:  # no split, or an impossible or implausible one (measure/results.split_is_possible)
        shown["device_ms"], shown["host_frac"], shown["regime"] = "-", "-", "-"
    shown.update({axis: str(row.get(axis) or usual) for axis, usual in VARIED_ONLY.items()})
    shown["stable"] = stable_mark(row)
    shown["side"] = side_of(row)
    return shown


def side_of(row: dict[str, object]) -> str:
    """A paired study's side of the cell (a, b), '' for an unpaired one."""
    side = row.get("side")
    return "" if side is None or pd.isna(side) else str(side)  # type: ignore[arg-type]


def stable_mark(row: dict[str, object]) -> str:
    """'yes', or 'NO: foreign_cpu,drift' for an unstable cell ('' when it was not judged)."""
    stable = str(row.get("stable")).lower()
    if stable == "true":
        return "yes"
    if stable == "false":
        reasons = row.get("unstable_reasons")
        return "NO: " + (str(reasons) if reasons is not None and not pd.isna(reasons) else "?")  # type: ignore[arg-type]
    return ""


def table_columns(rows: list[dict[str, object]]) -> list[str]:
    """COLUMNS, with a workload column when a study has a workload other than random prompts,
    a stable column when its cells were judged (measure/stability.py), and a side column
    first in a paired study."""
    columns = list(COLUMNS)
    for axis, usual in VARIED_ONLY.items():
        if any(str(r.get(axis) or usual) != usual for r in rows):
            columns.insert(sum(c in CELL_AXES for c in columns), axis)  # after the last axis shown
    if any(stable_mark(r) for r in rows):
        columns.append("stable")
    if any(side_of(r) for r in rows):  # a paired study: each cell twice, side a and side b
        columns.insert(0, "side")
    return columns


def format_table(rows: Iterable[dict[str, object]], level: float = 0.95) -> str:
    """A fixed-width text table, one line per cell, in grid order, every column left-aligned;
    `level`: the step CIs' (measure.ci_level), named in their column's header."""
    rows = list(rows)
    columns = table_columns(rows)
    shown = [display_row(r) for r in rows]
    header = [column_label(c, level) for c in columns]
    widths = {c: max([len(h), *(len(r[c]) for r in shown)]) for c, h in zip(columns, header)}
    lines = [header, *([r[c] for c in columns] for r in shown)]
    return "\n".join("  ".join(v.ljust(widths[c]) for c, v in zip(columns, line)).rstrip() for line in lines)


# Above this many cells the console gets an overview instead of one line per cell.
MAX_PRINTED_ROWS = 200


def format_overview(rows: Iterable[dict[str, object]]) -> str:
    """A few lines for a sweep too large to print cell by cell: cells by status, and the
    spread of step_ms and host_frac over the measured ones."""
    frame = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))
    counts = frame["status"].value_counts() if "status" in frame else pd.Series(dtype=int)
    lines = [f"{len(frame)} cells: " + ", ".join(f"{n} {status}" for status, n in counts.items())]
    for column in ("step_ms", "device_ms", "host_frac"):
        values = pd.to_numeric(frame[column], errors="coerce").dropna() if column in frame else pd.Series()
        if len(values):
            low, mid, high = values.quantile([0.0, 0.5, 1.0])
            lines.append(f"  {column}: median {mid:.3f}, min {low:.3f}, max {high:.3f} over {len(values)} cells")
    return "\n".join(lines)


def format_markdown(rows: Iterable[dict[str, object]], max_chars: int,
                    link: Optional[Callable[[dict[str, object]], Optional[str]]] = None,
                    overflow: str = "", level: float = 0.95) -> str:
    """The table in Markdown, cut to `max_chars` at a row boundary; when rows are left out
    the last line is `overflow` formatted with {shown} and {total}. `link(row)` gives a URL
    for a row's batch cell (its MLflow run); `level` as format_table's."""
    rows = list(rows)
    # What is the same for every cell is said once, above the table (the run's name).
    same = {c for c in CELL_AXES if c not in INNER_AXES and len({str(r.get(c)) for r in rows}) == 1}
    columns = [c for c in table_columns(rows) if c != "hostname" and c not in same]
    lines = ["| " + " | ".join(column_label(c, level) for c in columns) + " |", "|" + "---|" * len(columns)]
    budget = max_chars - len(overflow) - 40
    used = sum(len(line) + 1 for line in lines)
    for count, row in enumerate(rows):
        shown = display_row(row)
        url = link(row) if link is not None else None
        if url:
            shown["batch"] = f"[{shown['batch']}]({url})"
        line = "| " + " | ".join(shown[c] for c in columns) + " |"
        if used + len(line) + 1 > budget:
            return "\n".join([*lines, "", overflow.format(shown=count, total=len(rows))])
        lines.append(line)
        used += len(line) + 1
    return "\n".join(lines)


FRONTEND_COLUMN = "overlapped_frontend_process_outputs_ms"


def phase_columns(cells: pd.DataFrame) -> list[str]:
    """The cells' phase_<name>_ms columns, in the order a step runs the phases."""
    from hostsweep.measure.phases import PHASE_ORDER

    found = [c for c in cells.columns if c.startswith("phase_") and c.endswith("_ms")
             and not c.endswith(("_ci_low_ms", "_ci_high_ms")) and cells[c].notna().any()]
    rank = {f"phase_{name}_ms": i for i, name in enumerate(PHASE_ORDER)}
    return sorted(found, key=lambda c: (rank.get(c, len(rank)), c))


def host_phase_table(cells: pd.DataFrame) -> pd.DataFrame:
    """Per cell with host phases, ms per decode step: device, each host phase in the order a
    step runs them, the front-end's work beside the step (overlapped, not part of host_ms)
    and the share of host_ms the phases name. Empty when no cell has phases. A negative phase
    whose CI holds 0 is noise around zero and shows as 0 (its CI stays in cells.csv)."""
    columns = phase_columns(cells)
    if not columns:
        return pd.DataFrame()
    rows = cells.dropna(subset=columns, how="all").copy()
    for column in columns:
        low, high = (f"{column[:-len('_ms')]}_ci_{end}_ms" for end in ("low", "high"))
        if {low, high} <= set(rows):
            noise = (rows[column] < 0) & (rows[low] <= 0) & (rows[high] >= 0)
            rows.loc[noise, column] = 0.0
    # cells.csv's own column names (phase_<name>_ms, overlapped_<name>_ms): one name per
    # quantity in every table, so a reader joins host_phases.csv to cells.csv without a map
    shown = [c for c in (*CELL_AXES, "step_ms", "device_ms", *columns, FRONTEND_COLUMN, "attributed_frac")
             if c in rows]
    return rows[shown].reset_index(drop=True)
