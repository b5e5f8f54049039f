"""The TP model's fixed terms for a selection of cells: each SKU's roofs and memory, the
all-reduce fit of every SKU with TP > 1 cells, and H(N). Each comes from the composed
calibration (`calibration=…`, `fit.calibration_file`), the SKU's datasheet, or is measured
here when missing and `fit.calibrate` allows it; every measured term is logged as a run of
the MLflow experiment "calibration". `FixedTerms.sources` says where each came from.
"""
from __future__ import annotations

import copy
import logging
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import numpy as np
import pandas as pd
import psutil

from hostsweep.calibrate.microbench import measure_roofs, run_on_sku
from hostsweep.config.options import check_option, load_calibration, load_model_shape, load_sku
from hostsweep.config.schema import (HOST_SOURCES, ROOF_SOURCES, AllReduceCalibration, CalibrationConfig, ConfigError,
                                     FitConfig, HostCalibration, RoofsCalibration)
from hostsweep.model.host_calibration import HostLineCalibration, calibrate_host
from hostsweep.model.inputs import DTYPE_BYTES
from hostsweep.model.study_fit import CalibrationTerms, calibration_terms
from hostsweep.record.registry import log_calibration

log = logging.getLogger(__name__)
GIB = 1024 ** 3
ALLREDUCE_REPS = 20


@dataclass
class FixedTerms:
    terms: CalibrationTerms
    skus: dict[str, dict[str, Any]]  # SKU specs; peak_bf16_tflops / mem_bandwidth_gbps hold the roofs in use
    sources: list[dict[str, Any]] = field(default_factory=list)  # term, sku, value, source, run_id
    warnings: list[str] = field(default_factory=list)
    host_line: Optional[HostLineCalibration] = None  # H(N) fitted here from TP-1 cells, with its CI

    def note(self, term: str, sku: str, value: str, source: str, run_id: str = "") -> None:
        self.sources.append({"term": term, "sku": sku, "value": value, "source": source, "run_id": run_id})


def check_fit_sources(fit: FitConfig) -> None:
    for name, value, allowed in (("fit.roofs", fit.roofs, ROOF_SOURCES), ("fit.host", fit.host, HOST_SOURCES)):
        if value not in allowed:
            raise ConfigError(f"{name}={value!r} is not allowed; allowed: {', '.join(allowed)}")


def base_calibration(composed: Optional[CalibrationConfig], fit: FitConfig) -> CalibrationConfig:
    """A copy of the composed calibration group with fit.calibration_file's sections over it."""
    calibration = copy.deepcopy(composed) if composed is not None else CalibrationConfig()
    if fit.calibration_file:
        extra = load_calibration(fit.calibration_file)
        calibration.allreduce.update(extra.allreduce)
        calibration.roofs.update(extra.roofs)
        if extra.host.s0_ms or extra.host.s1_ms:
            calibration.host = extra.host
    return calibration


def _datasheet(spec: dict[str, Any]) -> bool:
    return spec.get("peak_bf16_tflops") is not None and spec.get("mem_bandwidth_gbps") is not None


def _roofs(sku: str, spec: dict[str, Any], calibration: CalibrationConfig, fit: FitConfig, uri: str,
           address: Optional[str], fixed: FixedTerms) -> None:
    """Put the roofs in use into spec's datasheet keys and say where they came from."""
    if fit.roofs == "datasheet" or (fit.roofs == "auto" and _datasheet(spec)):
        if not _datasheet(spec):
            raise ConfigError(f"fit.roofs=datasheet: sku {sku} has no datasheet roofs in conf/sku/{sku}.yaml; "
                              "use fit.roofs=measured or auto")
        fixed.note("roofs", sku, f"{spec['peak_bf16_tflops']:g} TFLOP/s, {spec['mem_bandwidth_gbps']:g} GB/s",
                   f"datasheet (conf/sku/{sku}.yaml)")
        return
    run_id, source = "", "calibration"
    if sku not in calibration.roofs:
        if not fit.calibrate:
            raise ConfigError(f"sku {sku} needs measured roofs: add a roofs section (hostsweep-model roofs --sku {sku} "
                              "--out FILE, then fit.calibration_file=FILE) or set fit.calibrate=true")
        gpu = spec.get("accelerator_type") is not None
        measured = run_on_sku(measure_roofs, spec.get("accelerator_type"), 1 if gpu else 0, address, gpu)
        roofs = {k: measured[k] for k in ("measured_tflops", "measured_bandwidth_gbps")}
        run_id = log_calibration(uri, "roofs", sku, measured, roofs, pd.DataFrame([measured]))
        calibration.roofs[sku] = RoofsCalibration(**roofs)
        source = f"measured by this stage ({measured['gemm_dtype']} GEMM {measured['gemm_size']}, copy)"
    roofs = calibration.roofs[sku]
    spec["peak_bf16_tflops"], spec["mem_bandwidth_gbps"] = roofs.measured_tflops, roofs.measured_bandwidth_gbps
    fixed.note("roofs", sku, f"{roofs.measured_tflops:.4g} TFLOP/s, {roofs.measured_bandwidth_gbps:.4g} GB/s",
               source, run_id)


def _memory(sku: str, spec: dict[str, Any], fixed: FixedTerms) -> None:
    if spec.get("device_memory_gib") is None:  # the CPU: the engine's memory is the host's RAM
        spec["device_memory_gib"] = psutil.virtual_memory().total / GIB
        fixed.note("memory", sku, f"{spec['device_memory_gib']:.1f} GiB", "host RAM (psutil), this machine")


def _message_bytes(cells: pd.DataFrame) -> np.ndarray:
    hidden = np.array([load_model_shape(m)["hidden_size"] for m in cells["model"]], float)
    dtype = np.array([DTYPE_BYTES.get(d, 2) for d in cells.get("dtype", pd.Series("bfloat16", index=cells.index))])
    return cells["batch"].to_numpy(float) * hidden * dtype


def _allreduce(sku: str, spec: dict[str, Any], cells: pd.DataFrame, calibration: CalibrationConfig, fit: FitConfig,
               uri: str, address: Optional[str], fixed: FixedTerms) -> None:
    """λ, β of a SKU with TP > 1 cells: the calibration's, or measured from its cells'
    smallest decode message up to at least 16 MiB, where time clearly grows with size
    (fit_allreduce weighs residuals relatively, so the large end does not set λ)."""
    from hostsweep.calibrate.allreduce_bench import run_allreduce_sweep
    from hostsweep.model.fit import fit_allreduce

    run_id, source = "", "calibration"
    if sku not in calibration.allreduce:
        if not fit.calibrate:
            raise ConfigError(f"sku {sku} has TP>1 cells but the calibration has no all-reduce for it: compose one "
                              f"(hostsweep-model allreduce --sku {sku} --out FILE, fit.calibration_file=FILE) "
                              "or set fit.calibrate=true")
        gpu = spec.get("accelerator_type") is not None
        ranks, backend = int(cells["tp"].max()), "nccl" if gpu else "gloo"
        message = _message_bytes(cells)
        sizes = np.unique(np.geomspace(message.min(), max(16 * message.max(), 2 ** 24), 12).astype(int))
        frame = run_on_sku(run_allreduce_sweep, spec.get("accelerator_type"), ranks if gpu else 0, address,
                           ranks, sizes, ALLREDUCE_REPS, backend)
        measured = fit_allreduce(frame["bytes"], frame["seconds"])
        values = {"lambda_us": measured.latency_s * 1e6, "beta_gbps": measured.bandwidth_Bps / 1e9}
        run_id = log_calibration(uri, "allreduce", sku, {"ranks": ranks, "backend": backend, "reps": ALLREDUCE_REPS},
                                 values, frame)
        calibration.allreduce[sku] = AllReduceCalibration(values["lambda_us"], values["beta_gbps"])
        source = f"measured by this stage ({backend}, {ranks} ranks, {len(sizes)} sizes up to {sizes.max()} B)"
    fit_ = calibration.allreduce[sku]
    fixed.note("allreduce", sku, f"λ = {fit_.latency_us:.1f} µs, β = {fit_.bandwidth_gbps:.3g} GB/s", source, run_id)


def host_source(calibration: CalibrationConfig, fit: FitConfig) -> str:
    """Where H(N) comes from: auto takes the calibration's when it has one (non-zero)."""
    if fit.host != "auto":
        return fit.host
    return "calibration" if (calibration.host.s0_ms or calibration.host.s1_ms) else "cells"


def _host(cells: pd.DataFrame, train_sku: str, calibration: CalibrationConfig, fit: FitConfig, uri: str,
          fixed: FixedTerms) -> None:
    """H(N) from the calibration, or fitted to host_ms of the train SKU's TP-1 split cells:
    bounded to >= 0 up to the largest batch of `cells` (every cell it is applied to), with
    a bootstrap CI, unstable cells left out (fit.exclude_unstable)."""
    if host_source(calibration, fit) == "calibration":
        host = calibration.host
        fixed.note("host", "all", f"H(N) = {host.s0_ms:.3f} + {host.s1_ms:.4f}·(N−1) ms", "calibration")
        return
    single = cells[(cells["sku"] == train_sku) & (cells["tp"] == 1)]
    if fit.host_model:
        single = single[single["model"] == fit.host_model]
    try:
        calibrated = calibrate_host(single, cells["batch"].to_numpy(float), fit.exclude_unstable, seed=fit.seed)
    except ValueError as exc:
        raise ConfigError(f"fit.host=cells, sku {train_sku}{' model ' + fit.host_model if fit.host_model else ''}: "
                          f"{exc}; measure tp=1 with split.enabled=true or compose a calibration with a host "
                          "section") from None
    values = calibrated.values()
    run_id = log_calibration(uri, "host", train_sku, {"model": fit.host_model or "all", "cells": len(calibrated.table),
                                                      "bound": f"H >= 0 for N = 1..{calibrated.line.high:g}",
                                                      "ci": "residual bootstrap, expanded percentile 95%"},
                             values, calibrated.table)
    calibration.host = HostCalibration(values["s0_ms"], values["s1_ms"])
    fixed.host_line = calibrated
    fixed.note("host", train_sku, calibrated.describe(), f"fitted to host_ms of {len(calibrated.table)} TP-1 cells",
               run_id)
    if calibrated.line.at_bound:
        line = calibrated.line
        fixed.warnings.append(f"H(N) fitted to the TP-1 cells would go negative over N = 1..{line.high:g} (unbounded "
                              f"{line.unbounded_s0_ms:.3f} {'−' if line.unbounded_s1_ms < 0 else '+'} "
                              f"{abs(line.unbounded_s1_ms):.4f}·(N−1) ms): held >= 0 there "
                              f"({', '.join(line.at_bound)} at 0); the TP-1 host split is noisy or stale")


def fixed_terms(cells: pd.DataFrame, train_sku: str, composed: Optional[CalibrationConfig], fit: FitConfig,
                tracking_uri: str, ray_address: Optional[str]) -> FixedTerms:
    """Everything the fit holds fixed, for these cells."""
    calibration = base_calibration(composed, fit)
    skus: dict[str, dict[str, Any]] = {}
    fixed = FixedTerms(calibration_terms(calibration), skus)
    for sku in sorted(cells["sku"].unique()):
        check_option("sku", sku, " (a cell's sku)")
        skus[sku] = asdict(load_sku(sku))
        _roofs(sku, skus[sku], calibration, fit, tracking_uri, ray_address, fixed)
        _memory(sku, skus[sku], fixed)
        sharded = cells[(cells["sku"] == sku) & (cells["tp"] > 1)]
        if not sharded.empty:
            _allreduce(sku, skus[sku], sharded, calibration, fit, tracking_uri, ray_address, fixed)
    _host(cells, train_sku, calibration, fit, tracking_uri, fixed)
    fixed.terms = calibration_terms(calibration)
    _check_host(fixed, cells)
    return fixed


def _check_host(fixed: FixedTerms, cells: pd.DataFrame) -> None:
    """A host line that goes negative over the measured batches is not a physical time;
    the fit still uses it (it is what was measured), and the report says so."""
    batches = np.array(sorted(cells["batch"].unique()), float)
    host_ms = fixed.terms.host.time_s(batches) * 1e3
    if (host_ms < 0).any():
        fixed.warnings.append(f"H(N) is negative at N = {', '.join(f'{b:g}' for b in batches[host_ms < 0])} "
                              f"({', '.join(f'{h:.2f}' for h in host_ms[host_ms < 0])} ms): the host line fitted to "
                              "the TP-1 cells is not physical there, and S(N) + T_ar is no lower bound")
