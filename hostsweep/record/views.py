"""How a person finds and reads a study's runs in the MLflow UI: run names that lead with
what varies, links that open the runs table, descriptions, the `mlflow ui` command.

MLflow 3.17 opens an experiment on its GenAI overview unless the link carries
`?workflowType=machine_learning` (or the browser's localStorage says otherwise): the UI
decides in the browser, and nothing on the server side (not the experiment tag
`mlflow.experimentKind`) changes it (mlflow/mlflow#24498). So every link hostsweep prints
or writes carries it.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence
from urllib.parse import urlsplit

from hostsweep.config.redact import redact
from hostsweep.config.validation import is_server
from hostsweep.record.store import served_artifacts

JOURNAL_TAG = "journal_entry"  # the run-directory journal entry a cell run was logged from
NOTE_TAG = "mlflow.note.content"  # a run's or experiment's Markdown description
# What MLflow's UI writes for an experiment created in its "model training" view; harmless,
# and what an upstream fix of mlflow/mlflow#24498 would read.
KIND_TAG, KIND = "mlflow.experimentKind", "custom_model_development"
UI_VIEW = "workflowType=machine_learning"


# The cell axes a run name may need, in the order they are named: b4-ctx512-eager-tp2.
NAME_AXES = ("mode", "tp", "workload", "sku", "model")


def varying_axes(cells: Sequence[dict[str, object]]) -> tuple[str, ...]:
    """The NAME_AXES whose value differs across a sweep's cells (their params)."""
    return tuple(a for a in NAME_AXES if len({str(c.get(a)) for c in cells}) > 1)


def cell_run_name(params: dict[str, object], varying: Optional[Sequence[str]] = None) -> str:
    """A cell run's name, leading with what varies: `b4-ctx512` when batch and ctx are all
    that varies in its sweep (the parent's name says the rest), `b4-ctx512-eager-tp1` when
    modes and TP degrees do too. Unknown (None): every axis but a random workload."""
    axes = varying if varying is not None else [a for a in NAME_AXES
                                                if a != "workload" or params.get(a, "random") != "random"]
    parts = [f"b{params['batch']}", f"ctx{params['ctx']}"]
    parts += [f"tp{params['tp']}" if axis == "tp" else str(params.get(axis)) for axis in axes]
    return "-".join(parts)


def ui_base(tracking_uri: str, port: int = 5000) -> str:
    """Where the UI of a store is: the server itself, or `mlflow ui` on loopback for a file store."""
    if is_server(tracking_uri):
        parts = urlsplit(tracking_uri)  # credentials stay out: the browser asks for its own
        host = f"[{parts.hostname}]" if parts.hostname and ":" in parts.hostname else parts.hostname
        return f"{parts.scheme}://{host}{f':{parts.port}' if parts.port else ''}{parts.path.rstrip('/')}"
    return f"http://127.0.0.1:{port}"


def runs_table_url(experiment_id: str, port: int = 5000, run_id: Optional[str] = None,
                   base: Optional[str] = None) -> str:
    """The UI link to an experiment's runs table (or one run): MLflow 3.x opens a GenAI
    overview unless the link asks for the machine-learning workflow."""
    where = f"runs/{run_id}" if run_id else "runs"
    return f"{base or f'http://127.0.0.1:{port}'}/#/experiments/{experiment_id}/{where}?{UI_VIEW}"


def store_label(tracking_uri: str) -> str:
    """The store's URI as printed and written in summaries and reports: a sqlite path made
    absolute (a command quoting it works from any folder), credentials starred out."""
    return redact(absolute_store_uri(tracking_uri))


def absolute_store_uri(tracking_uri: str) -> str:
    """A sqlite store's URI with an absolute path, so a command quoting it works from any folder."""
    prefix = "sqlite:///"
    if tracking_uri.startswith(prefix) and not tracking_uri.startswith(prefix + "/"):
        return prefix + str(Path(tracking_uri[len(prefix):]).resolve())
    return tracking_uri


def ui_command(tracking_uri: str, port: int = 5000) -> str:
    """The stock MLflow UI on this store, bound to loopback (the interpreter that ran the
    stage has mlflow, whether or not its venv is activated); None-like for a server. On a
    tracking server's database, with the server's artifact destination (tracking.artifacts)
    so its files show too."""
    served = served_artifacts()
    artifacts = f" --artifacts-destination {served}" if served else ""
    return (f"{sys.executable} -m mlflow ui --backend-store-uri {store_label(tracking_uri)}"
            f"{artifacts} --host 127.0.0.1 --port {port}")


def open_ui_line(tracking_uri: str, port: int = 5000) -> str:
    """The console's line on how to open the UI: a tracking server already is the UI (its
    address, credentials left for the browser to ask); a database or file store needs the
    stock `mlflow ui` started on it (ui_command)."""
    if is_server(tracking_uri):
        return f"open the UI: {ui_base(tracking_uri)} (the tracking server serves it)"
    return f"open the UI: {ui_command(tracking_uri, port)}"


def experiment_description(study: str) -> str:
    return (f"**hostsweep study `{study}`**: where the time in one LLM decode step goes. Each parent run is one "
            "sweep (named study: sku/model/mode/tp), with one child run per cell (named for what varies, e.g. "
            "`b4-ctx512`). A cell's step time is the difference of a T=1 and a T-token generate over T−1 steps "
            "(median of the timed pairs, its CI from order statistics at measure.ci_level, 95% by default), "
            "split into device and host time from profiler "
            "traces. Metrics are ms per decode step to the microsecond; `host_frac` is host / step.\n\n"
            "Open this view with `?workflowType=machine_learning` on the link (hostsweep prints such links): "
            "MLflow 3 otherwise opens experiments on a GenAI overview (mlflow/mlflow#24498).")


MODELS_DESCRIPTION = (
    "**hostsweep fitted models**: one run per fit of the closed-form TP decode model (the tensor-parallel "
    "study *Why Adding GPUs Should — But Doesn't — Halve Decode*: g·T_cmp/k + T_ar(k) + H(N)) on a study's "
    "training cells. Params say which cells trained it and where every fixed term came from; metrics are held-out MAPE per host form; the artifacts hold "
    "fit.json, predictions.csv and a pyfunc `model` (load it with `mlflow.pyfunc.load_model`).")
CALIBRATION_DESCRIPTION = (
    "**hostsweep calibrations**: microbenchmark runs (all-reduce λ/β, achieved GEMM FLOP/s and copy "
    "bandwidth, single-device host overhead H(N)), one per SKU and kind (`<kind>/<sku>`), each with "
    "its raw table; the fit and compare stages cite the run they used.")


def cell_note(params: dict[str, object], metrics: dict[str, float], regime: Optional[str],
              unstable_reasons: str = "") -> str:
    """A measured cell's run description: the cell and its numbers in one line, and first,
    when it was judged unstable, why (measure/stability.py)."""
    what = (f"b{params['batch']} ctx{params['ctx']} on {params['sku']}/{params['model']}/{params['mode']}/"
            f"tp{params['tp']}")
    line = (f"**{what}**: {metrics['step_ms']:.3f} ms per decode step, 95% CI "
            f"[{metrics['step_ci_low_ms']:.3f}, {metrics['step_ci_high_ms']:.3f}]")
    if "device_ms" in metrics and "host_frac" in metrics:
        line += (f"; device {metrics['device_ms']:.3f} ms, host {metrics.get('host_ms', float('nan')):.3f} ms, "
                 f"host_frac {metrics['host_frac']:.3f} ({regime or '?'})")
    if unstable_reasons:
        line = f"**UNSTABLE** ({unstable_reasons}; docs/measurement.md, Stability). " + line
    return line + ". Raw per-rep timings: `raw_timings.csv`; ops by time per step: `top_ops.csv`."
