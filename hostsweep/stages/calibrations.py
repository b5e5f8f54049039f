"""Noise calibrations in MLflow (the store edge of compare/floors.py; stages/noise.py is the
stage that measures them): `stage=noise` logs each as a run of the noise.experiment
experiment (tag hostsweep.kind=noise_calibration, tags naming the host, its device and the
engine's vLLM version, the floors as metrics), and the floors set to auto (compare/floors.py)
take the newest FINISHED one of the machine and engine their cells ran on."""
from __future__ import annotations

import logging
import math
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from mlflow.tracking import MlflowClient

from hostsweep.compare.floors import FloorEstimate, MachineEngine, NoiseCalibration
from hostsweep.record.reports import ReportRun

log = logging.getLogger(__name__)
KIND = "noise_calibration"
TAGS = {"host": "noise.host", "device": "noise.device", "engine": "noise.engine"}
FLOORS = ("instance", "start")


def _quoted(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def floor_metrics(calibration: NoiseCalibration) -> dict[str, float]:
    """A calibration's floors as run metrics: <floor>_floor_pct, _upper_pct, _df, and the confidence."""
    metrics: dict[str, float] = {}
    for name in FLOORS:
        estimate: Optional[FloorEstimate] = getattr(calibration, name)
        if estimate is not None:
            metrics |= {f"{name}_floor_pct": estimate.pct, f"{name}_floor_upper_pct": estimate.upper_pct,
                        f"{name}_floor_df": estimate.df, "confidence": estimate.confidence}
    return metrics


def open_calibration_run(uri: str, experiment: str, where: MachineEngine, study: str) -> ReportRun:
    """The calibration's run, opened before its sweeps so their logs can name it."""
    return ReportRun(uri, experiment, f"noise-{where.host}-{study}",
                     {"hostsweep.kind": KIND, **{tag: getattr(where, field) for field, tag in TAGS.items()}})


def log_noise_calibration(run: ReportRun, calibration: NoiseCalibration, params: dict[str, object], folder: Path,
                    note: str) -> None:
    run.log(folder, params, floor_metrics(calibration), note)
    run.finish()


def _estimate(metrics: dict[str, float], name: str) -> Optional[FloorEstimate]:
    try:
        values = [metrics[f"{name}_floor_{part}"] for part in ("pct", "upper_pct", "df")] + [metrics["confidence"]]
    except KeyError:
        return None
    return FloorEstimate(*(float(v) for v in values)) if all(math.isfinite(float(v)) for v in values[:1]) else None


def newest_calibration(uri: str, experiment: str, where: Optional[MachineEngine]) -> Optional[NoiseCalibration]:
    """The newest FINISHED noise calibration of `where` in the store, or None (none logged, no
    such experiment, the store unreadable: a lookup never stops a diff, it says so and the
    floors fall back to their defaults)."""
    if where is None:
        return None
    try:
        client = MlflowClient(uri)
        found = client.get_experiment_by_name(experiment)
        if found is None:
            return None
        conditions = [f"tags.`hostsweep.kind` = '{KIND}'", "attributes.status = 'FINISHED'",
                      *(f"tags.`{tag}` = {_quoted(getattr(where, field))}" for field, tag in TAGS.items())]
        runs = client.search_runs([found.experiment_id], " and ".join(conditions), max_results=1,
                                  order_by=["attributes.start_time DESC"])
    except Exception as exc:  # noqa: BLE001 - the store answers the diff's own reads; a lookup is optional
        log.warning("could not look up noise calibrations in %s: %s", experiment, exc)
        return None
    if not runs:
        return None
    run = runs[0]
    created = datetime.fromtimestamp(run.info.start_time / 1000, tz=timezone.utc).strftime("%Y-%m-%d")
    metrics = dict(run.data.metrics)
    return NoiseCalibration(run.info.run_id, created, where, _estimate(metrics, "instance"), _estimate(metrics, "start"))
