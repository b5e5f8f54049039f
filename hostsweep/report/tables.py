"""What is recorded per cell: its metrics and split tags (for MLflow and the CSV), the
rows of the cell table in the run directory, and the printed summary."""
from __future__ import annotations

from typing import Iterable

from hostsweep.measure.threadstates import idle_fraction
from hostsweep.run.worker import CellResult

COLUMNS = ("sku", "model", "mode", "tp", "batch", "ctx", "step_ms", "ci95_ms", "device_ms", "host_frac",
           "regime", "host", "status")


def cell_metrics(result: CellResult) -> dict[str, float]:
    m = result.measurement
    if m is None:
        return {}
    metrics = {
        "step_ms": m.step_ms, "step_ci_low_ms": m.step_ci_low_ms, "step_ci_high_ms": m.step_ci_high_ms,
        "wall_1_ms": m.wall_1_ms, "wall_T_ms": m.wall_T_ms, "cell_duration_s": result.duration_s,
    }
    if result.split is not None:
        sp = result.split
        metrics.update(device_ms=sp.device_ms, host_ms=sp.host_ms, host_frac=sp.host_frac,
                       overlap_gap_ms=sp.overlap_gap_ms, profiled_step_ms=sp.profiled_step_ms,
                       profiler_overhead=sp.profiler_overhead)
        if sp.kernel_source == "cuda":
            metrics.update(copy_ms=sp.copy_ms, copy_bytes_per_step=sp.copy_bytes)
    if result.thread_states is not None and not result.thread_states.empty:
        metrics["pyspy_idle_frac"] = idle_fraction(result.thread_states)
    if result.linearity is not None:
        lin = result.linearity
        metrics.update(r2_wall=lin.r2_wall, r2_kernel=lin.r2_kernel,
                       slope_disagreement=lin.slope_disagreement, linearity_slope_fit_ms=lin.slope_fit_ms)
    return metrics


SPLIT_TAGS = ("kernel_source", "regime")


def split_tags(result: CellResult) -> dict[str, str]:
    if result.split is None:
        return {}
    return dict(zip(SPLIT_TAGS, (result.split.kernel_source, result.split.regime)))


def cell_row(result: CellResult, run_id: str) -> dict[str, object]:
    """One flat row per cell: params, the metrics and tags its MLflow run gets, provenance,
    and its run id. Metrics a cell does not have are absent (empty in the CSV)."""
    return {
        **result.params,
        "status": result.status,
        **cell_metrics(result),
        **split_tags(result),
        "host": result.host.get("hostname", "?"),
        "device": result.host.get("device_name", "?"),
        "cell_key": result.key,
        "mlflow_run_id": run_id,
        "error": (result.error or "").splitlines()[0] if result.error else "",
    }


def logged_row(params: dict[str, str], metrics: dict[str, float], tags: dict[str, str],
               run_id: str) -> dict[str, object]:
    """cell_row's columns for a FINISHED cell read back from its MLflow run (a resumed
    sweep's earlier cells); the host/device columns come from its provenance tags."""
    return {
        **params,
        "status": "FINISHED",
        **metrics,
        **{k: tags[k] for k in SPLIT_TAGS if k in tags},
        "host": tags.get("hostname", "?"),
        "device": tags.get("device_name", "?"),
        "cell_key": tags["cell_key"],
        "mlflow_run_id": run_id,
        "error": "",
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
