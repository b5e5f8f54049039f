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

from hostsweep.calibrate.allreduce_terms import (allreduce_entry, can_measure, decode_sizes, describe_record,
                                                 measure_allreduce, other_path, require, unavailable)
from hostsweep.calibrate.microbench import measure_roofs, run_on_sku
from hostsweep.config.machine import cpu_flags, default_dtype
from hostsweep.config.options import check_option, load_calibration, load_model_shape, load_sku
from hostsweep.config.schema import (ALLREDUCE_PATHS, HOST_SOURCES, ROOF_SOURCES, AllReduceCalibration,
                                     CalibrationConfig, ConfigError, FitConfig, HostCalibration, RoofsCalibration)
from hostsweep.model.host_calibration import HostLineCalibration, calibrate_host
from hostsweep.model.inputs import DTYPE_BYTES
from hostsweep.model.study_fit import CalibrationTerms, calibration_terms
from hostsweep.model.term_checks import STANDALONE, path_of
from hostsweep.record.registry import log_calibration

log = logging.getLogger(__name__)
GIB = 1024 ** 3


@dataclass
class FixedTerms:
    terms: CalibrationTerms
    skus: dict[str, dict[str, Any]]  # SKU specs; peak_bf16_tflops / mem_bandwidth_gbps hold the roofs in use
    sources: list[dict[str, Any]] = field(default_factory=list)  # term, sku, value, source, run_id
    warnings: list[str] = field(default_factory=list)
    host_line: Optional[HostLineCalibration] = None  # H(N) fitted here from TP-1 cells, with its CI
    allreduce_paths: dict[str, str] = field(default_factory=dict)  # by SKU: the path of the T_ar in use

    def note(self, term: str, sku: str, value: str, source: str, run_id: str = "") -> None:
        self.sources.append({"term": term, "sku": sku, "value": value, "source": source, "run_id": run_id})


def check_fit_sources(fit: FitConfig) -> None:
    for name, value, allowed in (("fit.roofs", fit.roofs, ROOF_SOURCES), ("fit.host", fit.host, HOST_SOURCES),
                                 ("fit.allreduce", fit.allreduce, ALLREDUCE_PATHS)):
        if value not in allowed:
            raise ConfigError(f"{name}={value!r} is not allowed; allowed: {', '.join(allowed)}")


def base_calibration(composed: Optional[CalibrationConfig], fit: FitConfig) -> CalibrationConfig:
    """A copy of the composed calibration group with fit.calibration_file's sections over it."""
    calibration = copy.deepcopy(composed) if composed is not None else CalibrationConfig()
    if fit.calibration_file:
        extra = load_calibration(fit.calibration_file)
        calibration.allreduce.update(extra.allreduce)
        calibration.allreduce_standalone.update(extra.allreduce_standalone)
        calibration.roofs.update(extra.roofs)
        calibration.roofs_by_dtype.update(extra.roofs_by_dtype)
        if extra.host.s0_ms or extra.host.s1_ms:
            calibration.host = extra.host
    return calibration


def _datasheet(spec: dict[str, Any]) -> bool:
    return spec.get("peak_bf16_tflops") is not None and spec.get("mem_bandwidth_gbps") is not None


def roof_key(sku: str, dtype: str) -> str:
    """The key of a (SKU, dtype) roof in CalibrationConfig.roofs_by_dtype."""
    return f"{sku}/{dtype}"


def _calibrated_roof(calibration: CalibrationConfig, sku: str, dtype: str) -> Optional[RoofsCalibration]:
    """The calibration's roof of `sku` in `dtype`; a SKU roof that records no dtype (written
    before roofs recorded theirs) is taken as it is."""
    if roof_key(sku, dtype) in calibration.roofs_by_dtype:
        return calibration.roofs_by_dtype[roof_key(sku, dtype)]
    roof = calibration.roofs.get(sku)
    return roof if roof is not None and roof.dtype in (None, dtype) else None


def _roofs(sku: str, spec: dict[str, Any], cells: pd.DataFrame, calibration: CalibrationConfig, fit: FitConfig,
           uri: str, address: Optional[str], fixed: FixedTerms) -> None:
    """Put the roofs in use into spec's datasheet keys and say where they came from. Measured
    roofs run in the dtype the SKU's cells ran (one roof per dtype where they mix: spec's
    `roofs_by_dtype`, which model_inputs applies per cell), through the engine's matmul."""
    if fit.roofs == "datasheet" or (fit.roofs == "auto" and _datasheet(spec)):
        if not _datasheet(spec):
            raise ConfigError(f"fit.roofs=datasheet: sku {sku} has no datasheet roofs in conf/sku/{sku}.yaml; "
                              "use fit.roofs=measured or auto")
        fixed.note("roofs", sku, f"{spec['peak_bf16_tflops']:g} TFLOP/s, {spec['mem_bandwidth_gbps']:g} GB/s",
                   f"datasheet (conf/sku/{sku}.yaml)")
        return
    gpu = spec.get("accelerator_type") is not None
    dtypes = list(cells["dtype"].dropna().value_counts().index) if "dtype" in cells else []
    spec["roofs_by_dtype"] = {}
    for dtype in [str(d) for d in dtypes] or [_dtype_of(cells, gpu)]:
        run_id, source, roofs = "", "calibration", _calibrated_roof(calibration, sku, dtype)
        if roofs is None:
            if not fit.calibrate:
                raise ConfigError(f"sku {sku} needs measured roofs in {dtype}: add a roofs section (hostsweep-model "
                                  f"roofs --sku {sku} --dtype {dtype} --out FILE, then fit.calibration_file=FILE) "
                                  "or set fit.calibrate=true")
            measured = run_on_sku(measure_roofs, spec.get("accelerator_type"), 1 if gpu else 0, address, gpu,
                                  4096, 512, 5, dtype, apart=True)
            values = {k: measured[k] for k in ("measured_tflops", "measured_bandwidth_gbps")}
            run_id = log_calibration(uri, "roofs", sku, measured, values, pd.DataFrame([measured]))
            roofs = RoofsCalibration(**values, dtype=measured["dtype"], matmul=measured["matmul"])
            calibration.roofs_by_dtype[roof_key(sku, dtype)] = roofs
            calibration.roofs.setdefault(sku, roofs)
            source = f"measured by this stage ({measured['dtype']} GEMM {measured['gemm_size']} via " \
                     f"{measured['matmul']}, copy)"
        spec["roofs_by_dtype"][dtype] = {"peak_bf16_tflops": roofs.measured_tflops,
                                         "mem_bandwidth_gbps": roofs.measured_bandwidth_gbps}
        fixed.note("roofs", sku, f"{roofs.measured_tflops:.4g} TFLOP/s, {roofs.measured_bandwidth_gbps:.4g} GB/s "
                   f"({roofs.dtype or 'dtype not recorded'}; cells in {dtype})", source, run_id)
    first = next(iter(spec["roofs_by_dtype"].values()))  # the most common dtype's: cells without one use it
    spec["peak_bf16_tflops"], spec["mem_bandwidth_gbps"] = first["peak_bf16_tflops"], first["mem_bandwidth_gbps"]


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
    """λ, β of a SKU with TP > 1 cells on the path fit.allreduce asks for (allreduce_terms.py):
    the calibration's, or measured on the SKU over its cells' decode message sizes, with the
    other path measured and recorded beside it (the engine's and the TP study's method side
    by side). calibration.allreduce[sku] ends as the entry in use, allreduce_standalone[sku]
    holds the standalone one where there is one."""
    want, gpu = fit.allreduce, spec.get("accelerator_type") is not None
    record, run_id, source = allreduce_entry(calibration, sku, want), "", "calibration"
    beside = allreduce_entry(calibration, sku, other_path(want))
    measurable = fit.calibrate and (can_measure(want, gpu, address) or beside is None)
    if record is None and measurable:
        ranks, dtype = int(cells["tp"].max()), _dtype_of(cells, gpu)
        for path in (want, other_path(want)):
            if path != want and (beside is not None or not can_measure(path, gpu, address)):
                continue
            try:
                measured = measure_allreduce(path, spec, ranks, decode_sizes(_message_bytes(cells)), dtype,
                                             address)
            except Exception as exc:  # the path beside is a record, not an input: its failure is a warning
                if path == want:
                    raise
                fixed.warnings.append(f"the {path} all-reduce of sku {sku}, recorded beside the one in use, "
                                      f"could not be measured: {exc}")
                continue
            values = {"lambda_us": measured.record.latency_us, "beta_gbps": measured.record.bandwidth_gbps}
            logged = log_calibration(uri, "allreduce", sku, measured.params, values, measured.frame)
            if path == want:
                record, run_id = measured.record, logged
                source = f"measured by this stage ({measured.record.method}, {len(measured.frame)} sizes)"
            else:
                beside = measured.record
                fixed.note(f"allreduce ({path}, beside)", sku, describe_record(beside),
                           f"measured by this stage ({beside.method}); not used by the fit", logged)
    elif record is None and beside is not None:
        fixed.warnings.append(f"{unavailable(sku, want, fit.calibrate)}: T_ar uses its {path_of(beside)} entry "
                              f"({beside.method or 'no method recorded'}), which is NOT the engine's path")
        record, source = beside, f"calibration ({path_of(beside)}: fit.allreduce={want} unavailable)"
    record = require(record, sku, want, fit.calibrate)
    calibration.allreduce[sku] = record
    for entry in (record, beside):
        if entry is not None and path_of(entry) == STANDALONE:
            calibration.allreduce_standalone[sku] = entry
    fixed.allreduce_paths[sku] = path_of(record)
    fixed.note("allreduce", sku, f"{describe_record(record)} ({path_of(record)} path)", source, run_id)


def _dtype_of(cells: pd.DataFrame, gpu: bool) -> str:
    """The dtype the cells' engines ran (their recorded `dtype`; the most common where they
    mix), else the one `engine.dtype=auto` resolves to on this machine."""
    if "dtype" in cells and cells["dtype"].notna().any():
        return str(cells["dtype"].dropna().mode().iloc[0])
    return default_dtype(gpu, cpu_flags())


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
        _roofs(sku, skus[sku], cells[cells["sku"] == sku], calibration, fit, tracking_uri, ray_address, fixed)
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
