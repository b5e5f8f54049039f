"""`hostsweep-model`: fit the TP latency model on measured cells, score it held-out, log it.

    hostsweep-model fit --experiment hostsweep-tp70b --calibration calib.yaml --train-sku h100 --train-tp 2
    hostsweep-model fit --cells outputs/.../cells.csv --calibration seed002-h100
    hostsweep-model whatif runs:/<run_id>/model --model llama-3.1-70b --sku h100 --batch 1 --ctx 2048
    hostsweep-model allreduce --ranks 2 --out calib.yaml      # gloo here, NCCL on GPUs
    hostsweep-model roofs --sku h100 --ray-address auto --out calib.yaml
    hostsweep-model host --experiment hostsweep-default --model tiny-llama --sku cpu --out calib.yaml
Calibrations are logged as runs of the MLflow experiment "calibration".
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from hostsweep.model.compare import cell_frame, falsified_skus, generalization, in_regime, predictions_table
from hostsweep.config.options import load_calibration as load_calibration_config
from hostsweep.config.options import load_model_shape, load_sku
from hostsweep.config.schema import DEFAULT_TRACKING_URI, ConfigError
from hostsweep.model.fit import AllReduceFit, HostFit, mape_summary
from hostsweep.model.hostforms import DEFAULT_FORM, FORM_CLASSES, compare_forms, fit_form, verdict
from hostsweep.model.tpmodel import INPUT_COLUMNS, model_spec, predict_rows, tp_scaling


def load_calibration(name_or_path: str) -> tuple[dict[str, AllReduceFit], HostFit, dict[str, dict]]:
    """The calibration's terms in the model's units: all-reduce fits by SKU, H(N), roofs."""
    calibration = load_calibration_config(name_or_path)
    allreduce = {sku: AllReduceFit(v.latency_us * 1e-6, v.bandwidth_gbps * 1e9)
                 for sku, v in calibration.allreduce.items()}
    host = HostFit(calibration.host.s0_ms * 1e-3, calibration.host.s1_ms * 1e-3)
    return allreduce, host, {sku: asdict(roofs) for sku, roofs in calibration.roofs.items()}


def measured_cells(args: argparse.Namespace) -> pd.DataFrame:
    frames = [pd.read_csv(path) for path in args.cells]
    if args.experiment:
        from hostsweep.record.tracking import read_cells

        frames.append(read_cells(args.tracking_uri, args.experiment))
    measured = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    if measured.empty:
        raise ConfigError("no measured cells: give --cells CSV files or --experiment names with finished runs")
    if "status" in measured:
        measured = measured[measured["status"] == "FINISHED"]
    return measured.reset_index(drop=True)


def fit_command(args: argparse.Namespace) -> int:
    measured = measured_cells(args)
    allreduce, host, measured_roofs = load_calibration(args.calibration)
    shapes = {m: load_model_shape(m) for m in measured["model"].unique()}
    skus = {s: {**asdict(load_sku(s)), **measured_roofs.get(s, {})} for s in measured["sku"].unique()}
    if args.roofs == "measured" and (missing := sorted(set(skus) - set(measured_roofs))):
        raise ConfigError(f"--roofs measured needs a roofs section for sku {missing} in the calibration "
                          "(hostsweep-model roofs --sku NAME --out FILE)")
    cells = cell_frame(measured, shapes, skus, args.roofs)
    cells["in_regime"] = in_regime(cells, args.utilization)
    selected = ((cells["sku"] == args.train_sku) & cells["tp"].isin(args.train_tp)).to_numpy()
    train, held_out = cells[selected & cells["in_regime"]], cells[~selected & cells["in_regime"]]
    fitted = fit_form(args.form, train, allreduce, host)
    table = predictions_table(fitted, cells, allreduce, host, selected)
    comparison = compare_forms(train, held_out, allreduce, host)
    summary = generalization(table)
    print(summary.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    print(comparison.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"host term: {verdict(comparison)}")
    broken = falsified_skus(table)
    print(f"additive model falsified on: {', '.join(broken) if broken else 'no SKU'}")
    metrics = _fit_metrics(table)
    params = {"form": args.form, "train_selection": f"sku={args.train_sku} tp={args.train_tp} in-regime",
              "g": fitted.g, "host_params_s": fitted.host_params, "s0_s": host.s0_s, "s1_s": host.s1_s,
              "roofs": args.roofs, "utilization": args.utilization,
              **{f"lambda_s.{k}": v.latency_s for k, v in allreduce.items()},
              **{f"beta_Bps.{k}": v.bandwidth_Bps for k, v in allreduce.items()}}
    from hostsweep.record.registry import log_model_fit

    spec = model_spec(fitted, allreduce, host, shapes, skus, args.roofs)
    run_id = log_model_fit(args.tracking_uri, args.models_experiment, f"{args.form} g={fitted.g:.3f}",
                           params, metrics, {"predictions": table, "host_forms": comparison,
                                             "generalization": summary}, spec,
                           predict_rows, INPUT_COLUMNS)
    print(f"logged model: runs:/{run_id}/model (experiment {args.models_experiment!r} in {args.tracking_uri})")
    return 0


def _fit_metrics(table: pd.DataFrame) -> dict[str, float]:
    train, held = table[table["role"] == "train"], table[table["role"] == "held-out"]
    held_in = held[held["in_regime"]]
    metrics = {f"train_{k}": v for k, v in mape_summary(train["predicted_ms"], train["step_ms"]).items()}
    metrics |= {f"heldout_{k}": v for k, v in mape_summary(held_in["predicted_ms"], held_in["step_ms"]).items()}
    metrics |= {f"heldout_with_outliers_{k}": v
                for k, v in mape_summary(held["predicted_ms"], held["step_ms"]).items()}
    metrics["falsifying_cells"] = float(table["falsifies"].sum())
    return {k: float(v) for k, v in metrics.items()}


def whatif_command(args: argparse.Namespace) -> int:
    from hostsweep.record.registry import load_model_spec

    spec = load_model_spec(args.tracking_uri, args.model_uri)
    table, stop = tp_scaling(spec, args.model, args.sku, args.batch, args.ctx, args.tp, args.min_gain)
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    if stop is None:
        print(f"every doubling up to tp={max(args.tp)} gains at least {args.min_gain:.0%}")
    else:
        print(f"more GPUs stop helping at tp={stop}: the next degree gains under {args.min_gain:.0%}")
    return 0


def _write_calibration(path: str | None, section: str, values: dict) -> None:
    """Merge one section into a calibration YAML (created if absent)."""
    if not path:
        return
    target = Path(path)
    data = yaml.safe_load(target.read_text()) if target.is_file() else {}
    data = data or {}
    data.setdefault(section, {})
    data[section].update(values)
    target.write_text(yaml.safe_dump(data, sort_keys=True))
    print(f"wrote {section} to {path}")


def allreduce_command(args: argparse.Namespace) -> int:
    from hostsweep.model.allreduce_bench import run_allreduce_sweep
    from hostsweep.model.calibrate import run_on_sku
    from hostsweep.model.fit import fit_allreduce
    from hostsweep.record.registry import log_calibration

    sku = load_sku(args.sku)
    sizes = np.geomspace(args.min_bytes, args.max_bytes, args.points).astype(int)
    gpus = args.ranks if args.backend == "nccl" else 0
    frame = run_on_sku(run_allreduce_sweep, sku.accelerator_type, gpus, args.ray_address,
                       args.ranks, sizes, args.reps, args.backend)
    fit = fit_allreduce(frame["bytes"], frame["seconds"])
    print(frame.to_string(index=False))
    print(f"lambda = {fit.latency_s * 1e6:.1f} us, beta = {fit.bandwidth_Bps / 1e9:.2f} GB/s "
          f"({args.ranks} ranks, {args.backend}, sku {args.sku})")
    log_calibration(args.tracking_uri, "allreduce", args.sku,
                    {"ranks": args.ranks, "backend": args.backend, "reps": args.reps},
                    {"lambda_us": fit.latency_s * 1e6, "beta_gbps": fit.bandwidth_Bps / 1e9}, frame)
    _write_calibration(args.out, "allreduce", {args.sku: {"latency_us": fit.latency_s * 1e6,
                                                          "bandwidth_gbps": fit.bandwidth_Bps / 1e9}})
    return 0


def roofs_command(args: argparse.Namespace) -> int:
    from hostsweep.model.calibrate import measure_roofs, run_on_sku
    from hostsweep.record.registry import log_calibration

    sku = load_sku(args.sku)
    gpu = sku.accelerator_type is not None
    roofs = run_on_sku(measure_roofs, sku.accelerator_type, 1 if gpu else 0, args.ray_address,
                       gpu, args.gemm_size, args.copy_mib)
    datasheet = {"peak_bf16_tflops": sku.peak_bf16_tflops, "mem_bandwidth_gbps": sku.mem_bandwidth_gbps}
    print(f"sku {args.sku}: {roofs['measured_tflops']:.2f} TFLOP/s ({roofs['gemm_dtype']} GEMM), "
          f"{roofs['measured_bandwidth_gbps']:.1f} GB/s copy; datasheet {datasheet}")
    log_calibration(args.tracking_uri, "roofs", args.sku, {**roofs, **datasheet},
                    {k: roofs[k] for k in ("measured_tflops", "measured_bandwidth_gbps")},
                    pd.DataFrame([{**roofs, **datasheet}]))
    _write_calibration(args.out, "roofs", {args.sku: {k: roofs[k] for k in ("measured_tflops",
                                                                           "measured_bandwidth_gbps")}})
    return 0


def host_command(args: argparse.Namespace) -> int:
    from hostsweep.model.calibrate import host_calibration
    from hostsweep.record.registry import log_calibration

    cells = measured_cells(args)
    cells = cells[(cells["model"] == args.model) & (cells["sku"] == args.sku)]
    fit, table = host_calibration(cells)
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"H(N) = {fit.s0_s * 1e3:.3f} ms + {fit.s1_s * 1e3:.4f} ms x (N - 1)  ({args.model} on {args.sku}, tp=1)")
    log_calibration(args.tracking_uri, "host", args.sku, {"model": args.model, "cells": len(table)},
                    {"s0_ms": fit.s0_s * 1e3, "s1_ms": fit.s1_s * 1e3}, table)
    _write_calibration(args.out, "host", {"s0_ms": fit.s0_s * 1e3, "s1_ms": fit.s1_s * 1e3})
    return 0


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="hostsweep-model", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    top.add_argument("--tracking-uri", default=DEFAULT_TRACKING_URI, help="MLflow store or server")
    sub = top.add_subparsers(dest="command", required=True)
    fit = sub.add_parser("fit", help="fit on training cells, score held-out, log to MLflow")
    fit.add_argument("--cells", action="append", default=[], help="cells.csv from a sweep (repeatable)")
    fit.add_argument("--experiment", action="append", default=[], help="sweep experiment to read (repeatable)")
    fit.add_argument("--calibration", required=True, help="calibration YAML, or a shipped name (seed002-h100)")
    fit.add_argument("--train-sku", required=True)
    fit.add_argument("--train-tp", type=int, nargs="+", default=[2])
    fit.add_argument("--form", choices=list(FORM_CLASSES), default=DEFAULT_FORM)
    fit.add_argument("--roofs", choices=["datasheet", "measured"], default="datasheet")
    fit.add_argument("--utilization", type=float, default=0.9)
    fit.add_argument("--models-experiment", default="models")
    whatif = sub.add_parser("whatif", help="what going from TP k to 2k buys, from a logged model")
    whatif.add_argument("model_uri")
    whatif.add_argument("--model", required=True)
    whatif.add_argument("--sku", required=True)
    whatif.add_argument("--batch", type=int, default=1)
    whatif.add_argument("--ctx", type=int, default=2048)
    whatif.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    whatif.add_argument("--min-gain", type=float, default=0.10)
    ar = sub.add_parser("allreduce", help="all-reduce microbenchmark: fit lambda and beta")
    ar.add_argument("--ranks", type=int, default=2)
    ar.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    ar.add_argument("--min-bytes", type=float, default=4e3)
    ar.add_argument("--max-bytes", type=float, default=32e6)
    ar.add_argument("--points", type=int, default=12)
    ar.add_argument("--reps", type=int, default=10)
    ar.add_argument("--sku", default="cpu")
    ar.add_argument("--out", default=None, help="merge the fit into this calibration YAML")
    ar.add_argument("--ray-address", default=None, help="run as a Ray task on a node of --sku")
    roofs = sub.add_parser("roofs", help="achieved GEMM FLOP/s and memory bandwidth of a SKU")
    roofs.add_argument("--sku", default="cpu")
    roofs.add_argument("--gemm-size", type=int, default=4096)
    roofs.add_argument("--copy-mib", type=int, default=512)
    roofs.add_argument("--out", default=None, help="merge the roofs into this calibration YAML")
    roofs.add_argument("--ray-address", default=None, help="run as a Ray task on a node of --sku")
    host = sub.add_parser("host", help="H(N) from host_ms of tp=1 split cells")
    host.add_argument("--cells", action="append", default=[])
    host.add_argument("--experiment", action="append", default=[])
    host.add_argument("--model", required=True)
    host.add_argument("--sku", required=True)
    host.add_argument("--out", default=None, help="merge H(N) into this calibration YAML")
    return top


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    commands = {"fit": fit_command, "whatif": whatif_command, "allreduce": allreduce_command,
                "roofs": roofs_command, "host": host_command}
    try:
        sys.exit(commands[args.command](args))
    except (ConfigError, ValueError) as exc:
        print(f"hostsweep-model: error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
