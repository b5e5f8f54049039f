"""A fitted TP latency model as plain data, and what-if answers from it (pure).

The spec is JSON-able (it is what MLflow stores with the pyfunc model): the host form,
g and its parameters, the calibration terms, the T its cells were measured with, and the
shapes and SKUs it may predict for.
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Any, Mapping

import numpy as np
import pandas as pd

from hostsweep.model.fit import AllReduceFit, HostFit
from hostsweep.model.hostforms import FittedForm, predict_s
from hostsweep.model.inputs import in_regime, model_inputs

INPUT_COLUMNS = ("model", "sku", "tp", "batch", "ctx")


def model_spec(fitted: FittedForm, allreduce: Mapping[str, AllReduceFit], host: HostFit,
               shapes: Mapping[str, Mapping[str, Any]], skus: Mapping[str, Mapping[str, Any]],
               roofs: str = "datasheet", tokens: int | None = None) -> dict[str, Any]:
    """`tokens`: the T the training cells were measured with (the memory criterion needs it)."""
    return {
        "form": fitted.form, "g": fitted.g, "host_params": list(fitted.host_params), "tokens": tokens,
        "allreduce": {sku: asdict(fit) for sku, fit in allreduce.items()},
        "host": asdict(host), "roofs": roofs,
        "shapes": {name: dict(shape) for name, shape in shapes.items()},
        "skus": {name: dict(sku) for name, sku in skus.items()},
    }


def _unknown(values: pd.Series, known: Mapping[str, Any], what: str) -> None:
    missing = sorted(set(values) - set(known))
    if missing:
        raise ValueError(f"unknown {what} {missing}; this model knows: {sorted(known)}")


def predict_rows(spec: Mapping[str, Any], rows: pd.DataFrame) -> pd.DataFrame:
    """step_ms (and in_regime) for rows of (model, sku, tp, batch, ctx)."""
    _unknown(rows["model"], spec["shapes"], "model")
    _unknown(rows["sku"], spec["skus"], "sku")
    frame = rows[list(INPUT_COLUMNS)].copy()
    frame["step_ms"] = np.nan
    if spec.get("tokens") is None:
        raise ValueError("this model's spec has no 'tokens' (T of its training cells): refit it with hostsweep-model fit")
    cells = model_inputs(frame, spec["shapes"], spec["skus"], spec["roofs"], tokens=spec["tokens"])
    fitted = FittedForm(spec["form"], spec["g"], tuple(spec["host_params"]))
    allreduce = {sku: AllReduceFit(**fit) for sku, fit in spec["allreduce"].items()}
    host = HostFit(**spec["host"])
    out = rows.copy()
    out["step_ms"] = predict_s(fitted, cells, allreduce, host) * 1e3
    out["in_regime"] = in_regime(cells)
    return out


def tp_scaling(spec: Mapping[str, Any], model: str, sku: str, batch: int, ctx: int,
               tps: list[int], min_gain: float = 0.10) -> tuple[pd.DataFrame, int | None]:
    """Predicted step per TP degree, the gain of each doubling, and the first k where
    going to the next degree gains less than `min_gain` (None if every step pays)."""
    rows = pd.DataFrame({"model": model, "sku": sku, "tp": tps, "batch": batch, "ctx": ctx})
    table = predict_rows(spec, rows)
    table["speedup_vs_previous"] = table["step_ms"].shift(1) / table["step_ms"]
    stop = None
    for previous, current in zip(table.itertuples(), list(table.itertuples())[1:]):
        if previous.in_regime and current.speedup_vs_previous - 1.0 < min_gain:
            stop = int(previous.tp)
            break
    return table, stop
