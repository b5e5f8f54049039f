"""`hostsweep-model`: fit the TP latency model on measured cells, score it held-out, log it.

    hostsweep-model fit --experiment hostsweep-tp70b --calibration calib.yaml --train-sku h100 --train-tp 2
    hostsweep-model fit --cells outputs/.../cells.csv --calibration seed002-h100 --train-sku h100
    hostsweep-model synth --calibration seed002-h100 --out tp-study.csv   # cells from the TP study's [2] own numbers
    hostsweep-model whatif runs:/<run_id>/model --model llama-3.1-70b --sku h100 --batch 1 --ctx 2048
    hostsweep-model allreduce --ranks 2 --out calib.yaml      # vLLM's own TP all-reduce (shared memory on CPUs)
    hostsweep-model allreduce --path standalone --ranks 2 --out calib.yaml   # the TP study's method (gloo, NCCL)
    hostsweep-model roofs --sku h100 --ray-address auto --out calib.yaml
    hostsweep-model host --experiment hostsweep-default --model tiny-llama --sku cpu --out calib.yaml
Calibrations are logged as runs of the MLflow experiment "calibration".

[2] The TP study: "Why Adding GPUs Should — But Doesn't — Halve Decode" (README.md#references).
"""
from __future__ import annotations

import argparse
import os
from dataclasses import asdict
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from hostsweep.calibrate.fit_command import fit_arguments, fit_command, measured_cells, synth_arguments, synth_command
from hostsweep.calibrate.microbench import roof_dtype
from hostsweep.config.options import load_sku
from hostsweep.config.redact import redact, redact_console, redact_log_records
from hostsweep.config.schema import DEFAULT_TRACKING_URI, TRACKING_URI_ENV, ConfigError
from hostsweep.model.tpmodel import tp_scaling
from hostsweep.record.store import quiet_mlflow

TP_STUDY = "[2] The TP study: \"Why Adding GPUs Should — But Doesn't — Halve Decode\" (README.md#references)."


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
    """λ, β on the engine's path (vLLM's own TP communicator) or standalone (torch.distributed,
    the TP study's method); the calibration section records which (`path`, `method`): the
    engine path's under `allreduce`, the standalone one under `allreduce_standalone`."""
    from hostsweep.calibrate.allreduce_terms import measure_allreduce
    from hostsweep.record.registry import log_calibration

    sku = asdict(load_sku(args.sku))
    gpu = sku.get("accelerator_type") is not None
    if args.path == "standalone" and args.backend == "nccl" and not gpu:
        raise ConfigError(f"--backend nccl needs a GPU SKU; sku {args.sku} is a CPU")
    sizes = np.geomspace(args.min_bytes, args.max_bytes, args.points).astype(int)
    measured = measure_allreduce(args.path, sku, args.ranks, sizes, args.dtype or roof_dtype(gpu), args.ray_address,
                                 reps=args.reps)
    record = measured.record
    print(measured.frame.to_string(index=False))
    print(f"lambda = {record.latency_us:.1f} us, beta = {record.bandwidth_gbps:.2f} GB/s "
          f"({record.method}, sku {args.sku})")
    log_calibration(args.tracking_uri, "allreduce", args.sku, measured.params,
                    {"lambda_us": record.latency_us, "beta_gbps": record.bandwidth_gbps}, measured.frame)
    section = "allreduce" if args.path == "engine" else "allreduce_standalone"
    _write_calibration(args.out, section, {args.sku: asdict(record)})
    return 0


def roofs_command(args: argparse.Namespace) -> int:
    from hostsweep.calibrate.microbench import measure_roofs, run_on_sku
    from hostsweep.record.registry import log_calibration

    sku = load_sku(args.sku)
    gpu = sku.accelerator_type is not None
    roofs = run_on_sku(measure_roofs, sku.accelerator_type, 1 if gpu else 0, args.ray_address,
                       gpu, args.gemm_size, args.copy_mib, 5, args.dtype, apart=True)
    datasheet = {"peak_bf16_tflops": sku.peak_bf16_tflops, "mem_bandwidth_gbps": sku.mem_bandwidth_gbps}
    print(f"sku {args.sku}: {roofs['measured_tflops']:.2f} TFLOP/s ({roofs['dtype']} GEMM, {roofs['matmul']}), "
          f"{roofs['measured_bandwidth_gbps']:.1f} GB/s copy; datasheet {datasheet}")
    log_calibration(args.tracking_uri, "roofs", args.sku, {**roofs, **datasheet},
                    {k: roofs[k] for k in ("measured_tflops", "measured_bandwidth_gbps")},
                    pd.DataFrame([{**roofs, **datasheet}]))
    values = {**{k: roofs[k] for k in ("measured_tflops", "measured_bandwidth_gbps")}, "dtype": roofs["dtype"],
              "matmul": roofs["matmul"]}
    _write_calibration(args.out, "roofs", {args.sku: values})
    _write_calibration(args.out, "roofs_by_dtype", {f"{args.sku}/{roofs['dtype']}": values})
    return 0


def host_command(args: argparse.Namespace) -> int:
    from hostsweep.model.host_calibration import calibrate_host
    from hostsweep.record.registry import log_calibration

    cells = measured_cells(args)
    cells = cells[(cells["model"] == args.model) & (cells["sku"] == args.sku)]
    calibrated = calibrate_host(cells, args.max_batch and [args.max_batch], not args.keep_unstable)
    print(calibrated.table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"{calibrated.describe()}  ({args.model} on {args.sku}, tp=1)")
    values = calibrated.values()
    log_calibration(args.tracking_uri, "host", args.sku, {"model": args.model, "cells": len(calibrated.table)},
                    values, calibrated.table)
    _write_calibration(args.out, "host", {"s0_ms": values["s0_ms"], "s1_ms": values["s1_ms"]})
    return 0


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="hostsweep-model", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    # the sweep's default too (config/schema.py): a cluster's head exports HOSTSWEEP_TRACKING_URI
    top.add_argument("--tracking-uri", default=os.environ.get(TRACKING_URI_ENV) or DEFAULT_TRACKING_URI,
                     help=f"MLflow store or server (default: ${TRACKING_URI_ENV} when set, else {DEFAULT_TRACKING_URI})")
    sub = top.add_subparsers(dest="command", required=True)
    fit_arguments(sub.add_parser("fit", help="fit on training cells, score held-out, write fit.json, log to MLflow",
                                 description=TP_STUDY))
    synth_arguments(sub.add_parser("synth", help="synthetic cells from a known truth (the TP study's [2] grid by default)",
                                   description=TP_STUDY))
    whatif = sub.add_parser("whatif", help="what going from TP k to 2k buys, from a logged model")
    whatif.add_argument("model_uri", help="the logged model, e.g. runs:/<run_id>/model or models:/<name>/<version>")
    whatif.add_argument("--model", required=True, help="model shape to predict for (a conf/model name)")
    whatif.add_argument("--sku", required=True, help="SKU to predict for (a conf/sku name)")
    whatif.add_argument("--batch", type=int, default=1, help="batch size N")
    whatif.add_argument("--ctx", type=int, default=2048, help="context length")
    whatif.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8], help="TP degrees to compare")
    whatif.add_argument("--min-gain", type=float, default=0.10,
                        help="a doubling that gains less than this fraction of the step stops helping")
    ar = sub.add_parser("allreduce", help="all-reduce on the engine's path (or standalone): fit lambda and beta")
    ar.add_argument("--path", choices=["engine", "standalone"], default="engine",
                    help="engine: through vLLM's own TP communicator (shared memory on the CPU build, custom "
                         "all-reduce or NCCL on GPUs); standalone: torch.distributed, the TP study's method")
    ar.add_argument("--ranks", type=int, default=2, help="ranks taking part (the TP degree; GPUs on a GPU SKU)")
    ar.add_argument("--backend", choices=["gloo", "nccl"], default="gloo",
                    help="standalone only, and chosen from the SKU: gloo on CPUs, nccl on GPUs")
    ar.add_argument("--dtype", default=None, help="message dtype (default: what engine.dtype=auto resolves to)")
    ar.add_argument("--min-bytes", type=float, default=4e3, help="smallest message, bytes")
    ar.add_argument("--max-bytes", type=float, default=32e6, help="largest message, bytes")
    ar.add_argument("--points", type=int, default=12, help="message sizes, log-spaced between the two")
    ar.add_argument("--reps", type=int, default=10, help="timed all-reduces per size")
    ar.add_argument("--sku", default="cpu", help="SKU it runs on (and the calibration section it writes)")
    ar.add_argument("--out", default=None, help="merge the fit into this calibration YAML")
    ar.add_argument("--ray-address", default=None, help="run as a Ray task on a node of --sku")
    roofs = sub.add_parser("roofs", help="achieved GEMM FLOP/s and memory bandwidth of a SKU")
    roofs.add_argument("--sku", default="cpu", help="SKU to measure (a conf/sku name)")
    roofs.add_argument("--gemm-size", type=int, default=4096, help="n of the n x n x n GEMM")
    roofs.add_argument("--copy-mib", type=int, default=512, help="MiB copied for the bandwidth")
    roofs.add_argument("--dtype", default=None, help="GEMM and copy dtype (default: what engine.dtype=auto resolves to)")
    roofs.add_argument("--out", default=None, help="merge the roofs into this calibration YAML")
    roofs.add_argument("--ray-address", default=None, help="run as a Ray task on a node of --sku")
    host = sub.add_parser("host", help="H(N) from host_ms of tp=1 split cells")
    host.add_argument("--cells", action="append", default=[], help="cells.csv from a sweep (repeatable)")
    host.add_argument("--experiment", action="append", default=[], help="sweep experiment to read (repeatable)")
    host.add_argument("--model", required=True, help="the model whose TP-1 cells are fitted")
    host.add_argument("--sku", required=True, help="the SKU whose TP-1 cells are fitted")
    host.add_argument("--out", default=None, help="merge H(N) into this calibration YAML")
    host.add_argument("--max-batch", type=int, default=None,
                      help="keep H(N) >= 0 up to this batch too (default: up to the largest measured)")
    host.add_argument("--keep-unstable", action="store_true", help="fit the cells flagged unstable too")
    return top


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    commands = {"fit": fit_command, "synth": synth_command, "whatif": whatif_command,
                "allreduce": allreduce_command, "roofs": roofs_command, "host": host_command}
    quiet_mlflow()
    redact_console()
    redact_log_records()
    try:
        sys.exit(commands[args.command](args))
    except (ConfigError, ValueError) as exc:
        print(f"hostsweep-model: error: {redact(str(exc))}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
