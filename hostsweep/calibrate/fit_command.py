"""`hostsweep-model fit` and `synth`: read measured cells, run `study_fit.fit_study`, print
the report, write fit.json (+ predictions.csv) and log the fit to MLflow; or write
synthetic cells from a chosen truth to try the fit on. `fit_and_log` is the one fit path
the stages (`python -m hostsweep stage=fit|compare|all`) call too.

MLflow is imported lazily (record.registry), so this module imports like the pure core.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

import numpy as np
import pandas as pd

from hostsweep.config.options import load_calibration, load_model_shape, load_sku
from hostsweep.config.redact import redact
from hostsweep.config.schema import ConfigError
from hostsweep.measure.unstable import Exclusion, exclude_unstable
from hostsweep.model.fit import mape_summary
from hostsweep.model.fit_console import render
from hostsweep.model.hostforms import DEFAULT_FORM, FORMS
from hostsweep.model.inputs import model_inputs
from hostsweep.model.study_fit import (BOUNDS, G_MODES, CalibrationTerms, FitOptions, FitReport, calibration_terms,
                                       fit_study)
from hostsweep.model.synthetic import (HOST_TRUTHS, TP_STUDY_OUTLIER_FACTOR, push_below_bound, clean_step_s, grid,
                                       host_truth_s, measure)
from hostsweep.model.tpmodel import INPUT_COLUMNS, model_spec, predict_rows


def measured_cells(args: argparse.Namespace) -> pd.DataFrame:
    missing = [str(path) for path in args.cells if not Path(path).is_file()]
    if missing:
        raise ConfigError(f"--cells {', '.join(missing)}: no such file")
    frames = [pd.read_csv(path) for path in args.cells]
    if args.experiment:
        from hostsweep.record.read.readback import read_cells

        frames.append(read_cells(args.tracking_uri, args.experiment))
    measured = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    if measured.empty:
        raise ConfigError("no measured cells: give --cells CSV files or --experiment names with finished runs")
    if "status" in measured:
        measured = measured[measured["status"] == "FINISHED"]
    return measured.reset_index(drop=True)


def _sku_specs(names, terms: CalibrationTerms, roofs: str) -> dict[str, dict]:
    specs = {s: {**asdict(load_sku(s)), **terms.roofs.get(s, {})} for s in names}
    if roofs == "measured" and (missing := sorted(set(specs) - set(terms.roofs))):
        raise ConfigError(f"--roofs measured needs a roofs section for sku {missing} in the calibration "
                          "(hostsweep-model roofs --sku NAME --out FILE)")
    return specs


def _json_path(args: argparse.Namespace) -> Path:
    if args.json:
        return Path(args.json)
    folder = Path(args.out_dir) if args.out_dir else Path("outputs", "fit", *datetime.now().strftime("%Y-%m-%d %H-%M-%S").split())
    return folder / "fit.json"


def _fit_metrics(report: FitReport) -> dict[str, float]:
    """Training and held-out MAPE of the chosen form; held-out pools the compared groups
    (in-regime, not falsified), per group metrics beside it."""
    table = report.predictions
    compared = {(g["sku"], g["tp"]) for g in report.groups if g["role"] == "held-out" and not g["falsified"]}
    in_compared = np.array([key in compared for key in zip(table["sku"], table["tp"])], bool)
    held = table[in_compared & (table["role"] == "held-out").to_numpy() & table["in_regime"].to_numpy(bool)]
    train = table[table["role"] == "train"]
    metrics = {"g": report.scale["g"], "g_with_out_of_regime": report.scale["g_with_out_of_regime"],
               "falsifying_cells": float(table["falsifies"].sum())}
    metrics |= {f"train_{k}": v for k, v in mape_summary(train["predicted_ms"], train["step_ms"]).items()}
    metrics |= {f"heldout_{k}": v for k, v in mape_summary(held["predicted_ms"], held["step_ms"]).items()}
    for score in report.scores:
        if score["role"] == "held-out" and score["form"] == report.options.form:
            metrics[f"heldout_mape_mean.{score['sku']}_tp{score['tp']}"] = score["mape_mean"]
    return {k: float(v) for k, v in metrics.items()}


def _params(report: FitReport, roofs: str) -> dict[str, object]:
    chosen, options = report.chosen, report.options
    return {"form": chosen.form, "g_mode": options.g_mode, "g": chosen.g,
            "train_selection": f"sku={options.train_sku} tp={list(options.train_tp)} in-regime",
            **{f"host.{k}": v for k, v in chosen.named_params_ms().items()},
            "s0_ms": report.calibration["host"]["s0_ms"], "s1_ms": report.calibration["host"]["s1_ms"],
            **{f"lambda_us.{s}": v["latency_us"] for s, v in report.calibration["allreduce"].items()},
            **{f"beta_gbps.{s}": v["bandwidth_gbps"] for s, v in report.calibration["allreduce"].items()},
            "roofs": roofs, "utilization": options.utilization, "verdict": report.verdict["verdict"],
            # the between-start SD the verdicts' intervals hold; "none": the cells' spread only
            "start_floor_pct": "none" if options.start_floor_pct is None else options.start_floor_pct}


@dataclass(frozen=True)
class FitOutcome:
    """A fit written and logged: the report, its JSON (fit.json's content), where fit.json
    went and the MLflow run that holds it and the model."""

    report: FitReport
    data: dict
    path: Path
    run_id: str


def fit_and_log(measured: pd.DataFrame, terms: CalibrationTerms, skus: dict[str, dict], options: FitOptions,
                json_path: Path, tracking_uri: str, models_experiment: str, roofs: str = "datasheet",
                tokens: int | None = None, extra_params: dict[str, object] | None = None,
                exclusion: Exclusion | None = None, host_line: dict[str, object] | None = None) -> FitOutcome:
    """The fit stage's one path (used by `stage=fit|compare|all` and `hostsweep-model fit`):
    model inputs, fit_study, fit.json + predictions.csv at `json_path`, and a run in the
    models experiment with the chosen form as a pyfunc. `skus` are the SKU specs with the
    roofs to use under `roofs`' keys (model_inputs). `exclusion` (the unstable cells left out
    before `measured`) and `host_line` (H(N)'s CI and bound, when fitted from cells) go
    into fit.json as "unstable" and beside calibration.host."""
    shapes = {m: load_model_shape(m) for m in measured["model"].unique()}
    cells = model_inputs(measured, shapes, skus, roofs, tokens=tokens)
    report = fit_study(cells, terms, options)
    data = report.to_dict()
    if exclusion is not None:
        data["unstable"] = exclusion.to_dict()
        extra_params = {**(extra_params or {}), "unstable_left_out": exclusion.count}
    if host_line:
        data["calibration"]["host"].update(_finite(host_line))
    json_path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, indent=1, allow_nan=False)
    json_path.write_text(text)
    report.predictions.to_csv(json_path.with_name("predictions.csv"), index=False)
    from hostsweep.record.registry import log_model_fit

    trained = int(cells.loc[report.predictions["role"] == "train", "T"].max())
    spec = model_spec(report.chosen, terms.allreduce, terms.host, shapes, skus, roofs, trained)
    run_id = log_model_fit(tracking_uri, models_experiment, f"{options.form} g={report.chosen.g:.3f}",
                           {**_params(report, roofs), **(extra_params or {})}, _fit_metrics(report),
                           {"predictions": report.predictions, "host_forms": pd.DataFrame(report.scores)},
                           spec, predict_rows, INPUT_COLUMNS, texts={"fit.json": text})
    return FitOutcome(report, data, json_path, run_id)


def _finite(values: dict[str, object]) -> dict[str, object]:
    """JSON-safe: a NaN (no CI) becomes None."""
    return {k: None if isinstance(v, float) and not np.isfinite(v) else v for k, v in values.items()}


def fit_command(args: argparse.Namespace) -> int:
    measured, exclusion = exclude_unstable(measured_cells(args), not args.keep_unstable)
    measured = measured.reset_index(drop=True)
    terms = calibration_terms(load_calibration(args.calibration))
    skus = _sku_specs(measured["sku"].unique(), terms, args.roofs)
    options = FitOptions(args.train_sku, tuple(args.train_tp), args.form, args.g_mode, args.bound,
                         args.utilization, args.resamples, args.seed, args.margin,
                         start_floor_pct=args.start_floor_pct)
    outcome = fit_and_log(measured, terms, skus, options, _json_path(args), args.tracking_uri,
                          args.models_experiment, args.roofs, args.tokens, exclusion=exclusion)
    print(render(outcome.data))
    print(f"\nwrote {outcome.path} and {outcome.path.with_name('predictions.csv')}")
    print(f"logged model: runs:/{outcome.run_id}/model (experiment {args.models_experiment!r} in {redact(args.tracking_uri)})")
    return 0


def synth_command(args: argparse.Namespace) -> int:
    """Cells drawn from g, the calibration's T_ar and H, and a chosen host-term truth."""
    terms = calibration_terms(load_calibration(args.calibration))
    shapes = {args.model: load_model_shape(args.model)}
    cells = grid(args.sku, args.model, shapes, _sku_specs(args.sku, terms, "datasheet"), args.tp, args.batch, args.ctx)
    host = host_truth_s(args.truth, cells, terms.host, min(args.tp))
    step = clean_step_s(cells, args.g, terms.allreduce, host)
    out = measure(cells, step, args.noise, args.seed, args.ci_pct, args.outlier_factor)
    below = np.zeros(len(out), bool)
    for sku_tp in args.below_bound:
        sku, _, tp = sku_tp.partition(":")
        group = ((out["sku"] == sku) & (out["tp"] == int(tp))).to_numpy() if tp.isdigit() else np.zeros(len(out), bool)
        if not group.any():
            raise ConfigError(f"--below-bound {sku_tp} matches no cell: the grid has sku {', '.join(args.sku)} "
                              f"and tp {', '.join(map(str, args.tp))} (give SKU:TP, and the SKU in --sku)")
        below |= group
    out = push_below_bound(out, below, terms.allreduce, terms.host, args.below_factor)
    columns = ["sku", "model", "tp", "batch", "ctx", "T", "step_ms", "step_ci_low_ms", "step_ci_high_ms"]
    out.assign(status="FINISHED")[columns + ["status"]].to_csv(args.out, index=False)
    print(f"wrote {len(out)} cells to {args.out} (truth {args.truth}, g = {args.g}, noise {args.noise:.1%}, "
          f"seed {args.seed})")
    return 0


def fit_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `hostsweep-model fit`."""
    parser.add_argument("--cells", action="append", default=[], help="cells.csv from a sweep (repeatable)")
    parser.add_argument("--experiment", action="append", default=[], help="sweep experiment to read (repeatable)")
    parser.add_argument("--calibration", required=True, help="calibration YAML, or a shipped name (seed002-h100)")
    parser.add_argument("--train-sku", required=True, help="SKU whose cells train the model")
    parser.add_argument("--train-tp", type=int, nargs="+", default=[2], help="TP degrees that train the model")
    parser.add_argument("--form", choices=list(FORMS), default=DEFAULT_FORM, help="host form of the logged model")
    parser.add_argument("--g-mode", choices=G_MODES, default="pinned",
                        help="pinned: one g with H = S(N) (as the TP study [2]); joint: every form refits g (warns when unidentifiable)")
    parser.add_argument("--bound", choices=BOUNDS, default="microbench",
                        help="falsification bound H: the microbenchmark S(N), or the lowest k-invariant fit")
    parser.add_argument("--margin", type=float, default=1.0, help="MAPE points a verdict's CI must clear")
    parser.add_argument("--start-floor-pct", type=float, default=None,
                        help="the step's SD (%%) between engine starts (fit.start_floor_pct): the held-out verdicts' "
                             "intervals hold it; default none")
    parser.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples per held-out group")
    parser.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    parser.add_argument("--tokens", type=int, default=None, help="T of cells that carry no T column")
    parser.add_argument("--roofs", choices=["datasheet", "measured"], default="datasheet", help="roofs of T_cmp")
    parser.add_argument("--utilization", type=float, default=0.9, help="memory fraction of the in-regime rule")
    parser.add_argument("--models-experiment", default="models", help="MLflow experiment of the fitted model")
    parser.add_argument("--keep-unstable", action="store_true",
                        help="fit the cells the sweep flagged unstable too (default: leave them out, and say so)")
    parser.add_argument("--json", default=None, help="write the report here (default: OUT_DIR/fit.json)")
    parser.add_argument("--out-dir", default=None, help="folder for fit.json and predictions.csv "
                        "(default: outputs/fit/<date>/<time>)")


def synth_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `hostsweep-model synth`."""
    parser.add_argument("--calibration", default="seed002-h100", help="T_ar and H(N) of the truth")
    parser.add_argument("--out", required=True, help="cells CSV to write")
    parser.add_argument("--model", default="llama-3.1-70b", help="model shape")
    parser.add_argument("--sku", nargs="+", default=["h100"], help="SKUs (each needs an all-reduce calibration)")
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4], help="TP degrees")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8], help="batch sizes N")
    parser.add_argument("--ctx", type=int, nargs="+", default=[512, 2048, 4096], help="context lengths")
    parser.add_argument("--g", type=float, default=0.30, help="true compute scale (the TP study [2]: 0.30)")
    parser.add_argument("--truth", choices=HOST_TRUTHS, default="invariant",
                        help="host term: S(N) at every k, or S(N)·k/k0, or S(N)·k0/k (k0 the lowest TP)")
    parser.add_argument("--noise", type=float, default=0.015, help="relative noise per cell (sd)")
    parser.add_argument("--ci-pct", type=float, default=None,
                        help="half-width of each cell's 95%% CI, percent (default 196 x noise)")
    parser.add_argument("--seed", type=int, default=0, help="noise seed")
    parser.add_argument("--outlier-factor", type=float, default=TP_STUDY_OUTLIER_FACTOR,
                        help="out-of-regime cells measure this x their model value (the TP study [2]: 43.3%% error)")
    parser.add_argument("--below-bound", nargs="*", default=[], metavar="SKU:TP",
                        help="groups measured at --below-factor x (S(N) + T_ar): cells that falsify the model")
    parser.add_argument("--below-factor", type=float, default=0.75, help="see --below-bound")
