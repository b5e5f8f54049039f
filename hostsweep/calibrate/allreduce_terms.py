"""Which all-reduce the fit's T_ar comes from (`fit.allreduce=engine|standalone`), and its
measurement when the calibration lacks it.

engine (the default): the all-reduce through vLLM's own tensor-parallel communicator
(calibrate/engine_allreduce.py) — the one every decode step of a TP cell pays. standalone: a
torch.distributed all-reduce (calibrate/allreduce_bench.py), the TP study's [2] method, kept
and recorded beside the engine path's so the two can be compared. A calibration entry that
records no path (a paper's reported λ, β) is standalone.

When the engine path is asked for but cannot be measured here (fit.calibrate=false, or a GPU
SKU with neither a Ray address nor a local GPU) and the calibration holds only a standalone
entry, that entry is used, with a warning, and its path is recorded: the falsification guard
(model/term_checks.py) then reports any falsification resting on it as not on the engine's path.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import pandas as pd

from hostsweep.config.schema import AllReduceCalibration, CalibrationConfig, ConfigError
from hostsweep.model.term_checks import ENGINE, STANDALONE, path_of

ALLREDUCE_REPS = 20


def other_path(path: str) -> str:
    return STANDALONE if path == ENGINE else ENGINE


def allreduce_entry(calibration: CalibrationConfig, sku: str, path: str) -> Optional[AllReduceCalibration]:
    """The calibration's all-reduce of `sku` measured on `path`, from `allreduce` or
    `allreduce_standalone`, whichever records that path."""
    for record in (calibration.allreduce.get(sku), calibration.allreduce_standalone.get(sku)):
        if record is not None and path_of(record) == path:
            return record
    return None


def decode_sizes(message_bytes: np.ndarray, points: int = 8) -> np.ndarray:
    """The cells' own decode messages (batch × hidden × dtype bytes, each once) and a
    log-spaced sweep from the smallest to at least 16× the largest (and 16 MiB), where time
    clearly grows with size: λ is read at the decode sizes, β needs the large end
    (fit_allreduce weighs residuals relatively, so that end does not set λ)."""
    message = np.asarray(message_bytes, float)
    sweep = np.geomspace(message.min(), max(16 * message.max(), 2 ** 24), points)
    return np.unique(np.concatenate([message, sweep]).astype(int))


def can_measure(path: str, gpu: bool, address: Optional[str]) -> bool:
    """Whether `path` can be measured for the SKU from here: a CPU SKU always (here, or as a
    Ray task), a GPU SKU through a Ray address or on a local GPU."""
    if not gpu or address is not None:
        return True
    import torch

    return bool(torch.cuda.is_available())


@dataclass(frozen=True)
class MeasuredAllReduce:
    record: AllReduceCalibration
    frame: pd.DataFrame  # per size: bytes, seconds (median), ci_low_s, ci_high_s[, path]
    params: dict[str, Any]  # what the calibration run logs as params


def measure_allreduce(path: str, spec: dict[str, Any], ranks: int, sizes: np.ndarray, dtype: str,
                      address: Optional[str], disable_custom_all_reduce: bool = False,
                      reps: int = ALLREDUCE_REPS) -> MeasuredAllReduce:
    """λ, β of one path over message `sizes` (bytes; decode_sizes of the cells for the fit) on
    `ranks` ranks of the SKU, in `dtype` (the engine path; the standalone one keeps its own)."""
    from hostsweep.calibrate.microbench import run_on_sku
    from hostsweep.model.fit import fit_allreduce

    gpu = spec.get("accelerator_type") is not None
    sizes = np.unique(np.asarray(sizes, int))
    if path == ENGINE:
        from hostsweep.calibrate.engine_allreduce import describe_paths, run_engine_allreduce

        frame = run_on_sku(run_engine_allreduce, spec.get("accelerator_type"), ranks if gpu else 0, address,
                           ranks, sizes, reps, dtype, disable_custom_all_reduce, apart=True)
        method = describe_paths(frame)
    else:
        from hostsweep.calibrate.allreduce_bench import run_allreduce_sweep

        backend = "nccl" if gpu else "gloo"
        frame = run_on_sku(run_allreduce_sweep, spec.get("accelerator_type"), ranks if gpu else 0, address,
                           ranks, sizes, reps, backend)
        method = f"torch.distributed all_reduce ({backend}, {ranks} ranks): the TP study's method"
    fitted = fit_allreduce(frame["bytes"], frame["seconds"])
    record = AllReduceCalibration(fitted.latency_s * 1e6, fitted.bandwidth_Bps / 1e9, path, method)
    params = {"ranks": ranks, "path": path, "method": method, "reps": reps, "dtype": dtype,
              "sizes": len(sizes), "max_bytes": int(sizes.max())}
    return MeasuredAllReduce(record, frame, params)


def describe_record(record: AllReduceCalibration) -> str:
    return f"λ = {record.latency_us:.1f} µs, β = {record.bandwidth_gbps:.3g} GB/s"


def unavailable(sku: str, path: str, calibrate: bool) -> str:
    """Why `path` could not be had for `sku`: the start of the warning or error."""
    why = "fit.calibrate=false" if not calibrate else "it cannot be measured from here (a GPU SKU: give ray.address)"
    return (f"sku {sku} has TP>1 cells but the calibration has no all-reduce for it on the {path} path "
            f"(fit.allreduce={path}) and {why}")


def require(record: Optional[AllReduceCalibration], sku: str, path: str, calibrate: bool) -> AllReduceCalibration:
    """`record`, or a one-line ConfigError saying how to get one."""
    if record is None:
        raise ConfigError(f"{unavailable(sku, path, calibrate)}: compose one (hostsweep-model allreduce --path {path} "
                          f"--sku {sku} --out FILE, fit.calibration_file=FILE) or set fit.calibrate=true")
    return record
