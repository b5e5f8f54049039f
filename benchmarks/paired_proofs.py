"""Do a release gate's verdicts hold while the VM's speed drifts? Paired against sequential,
on the real engine, against known truth.

Runs `python -m hostsweep` on a 16-cell grid (batch 1/2/4/8 x ctx 128/256/512/1024, split
off), each run in a fresh folder with its own MLflow store:

    aa-1, aa-2, aa-3   paired A/A (pair.enabled=true): both sides the same configuration,
                       in paired rounds (--design rounds: both engines in one worker, a
                       cell's two sides timed back to back in each of --reps rounds) or in
                       start pairs (--design starts: engine starts alternated A B, B A, A B);
                       the sweep's own paired diff with diff.fail_on=slower. Truth: nothing
                       changed.
    ab                 paired A/B with a planted 0.6 ms busy-wait in every engine step's
                       sample phase on side b (+pair.against.debug.delay_ms=0.6). Truth: each
                       cell's step grows by 0.6 ms, a ratio of 1 + 0.6 / step_a.
    calibrate          (by --runs) two cells, b1 and b8 at ctx 128, in paired rounds with many
                       rounds: what the planted busy-wait really adds to a step here (the
                       median over rounds of b - a, with its CI), the truth the planted
                       ratios are read against beside 1 + 0.6 / step_a.
    seq-paired         the paired runs' sides read as studies measured apart (stage=diff of
                       aa-1's side a against aa-2's, aa-2's side b against ab's): the same
                       measurements, judged sequentially, to show what pairing buys.
    seq1               (by --runs, after a start-pairs A/A: --design starts --runs aa-s,seq1)
                       seq1-a1, seq1-a2, seq1-b: one engine start each, diffed with the
                       between-start spread that A/A measured (diff.noise_floor_pct).
    seq-a1, seq-a2,    the same as separately measured studies (unpaired, the same number of
    seq-b              engine starts per study as one side of a paired run), one after another,
                       then `stage=diff` between them: seq-a1 vs seq-a2 (A/A) and seq-a1 vs
                       seq-b (the planted delay), on the spread between their own starts
                       (measure.replicates=--starts); also widened by the noise floor where a
                       paired A/A by start pairs ran before them in the same invocation.

It prints per run the gate's result, the verdict counts, how many planted ratios lie inside
their cell's CI, and the wall time; the targets: every paired A/A passes with no cell slower
or faster; the planted pair finds every cell slower with the planted ratio inside >= 90 %
of the CIs. Ratios and CIs come from each run's diff/diff.csv. Then, per paired run, the
speed canary beside the cells' steps: per engine start in the order they ran (start pairs),
or over the rounds (paired rounds: how far the machine's speed moved across the run against
how far the per-round ratio of the two sides moved).

    .venv/bin/python benchmarks/paired_proofs.py [--runs aa-1,aa-2,aa-3,ab,seq] [--keep DIR]
        [--design rounds|starts] [--reps 40] [--starts 3] [--rediff] [hydra overrides...]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import pandas as pd

GRID = ["batch=[1,2,4,8]", "ctx=[128,256,512,1024]", "split.enabled=false", "ray.exclusive=false"]
DELAY_MS = 0.6
PLANT = ["debug.delay_phase=sample", f"debug.delay_ms={DELAY_MS}"]
RUNS = ("aa-1", "ab", "aa-2", "aa-3", "seq-paired")
GATE = ["diff.fail_on=slower"]


def hostsweep(folder: Path, args: list[str]) -> tuple[int, float, str]:
    """`python -m hostsweep ARGS` in `folder` against its store; (exit code, seconds, console).
    A folder that holds a finished run (status.json) is not run again: --keep resumes."""
    done = folder / "status.json"
    if done.is_file():
        status = json.loads(done.read_text())
        return status["exit"], status["seconds"], (folder / "console.txt").read_text()
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "hostsweep", f"tracking.uri=sqlite:///{folder.parent / 'mlflow.db'}",
           f"output.pending_dir={folder.parent / 'pending'}", f"hydra.run.dir={folder / 'run'}", *args]
    started = time.time()
    proc = subprocess.run(cmd, cwd=folder, capture_output=True, text=True)
    console = proc.stdout + proc.stderr
    (folder / "console.txt").write_text(console)
    done.write_text(json.dumps({"exit": proc.returncode, "seconds": time.time() - started}))
    return proc.returncode, time.time() - started, console


def diff_rows(run_dir: Path) -> pd.DataFrame:
    table = pd.read_csv(run_dir / "diff" / "diff.csv")
    return table[table["quantity"] == "step_ms"]


def judged(name: str, rows: pd.DataFrame, rc: int, seconds: float, planted: bool) -> dict:
    counts = rows["verdict"].fillna("none").value_counts().to_dict()
    out = {"run": name, "exit": rc, "minutes": round(seconds / 60, 1), "cells": len(rows),
           **{v: int(counts.get(v, 0)) for v in ("slower", "faster", "same", "inconclusive")},
           "design": ",".join(sorted(set(rows.get("design", pd.Series(["?"])).astype(str))))}
    if planted:
        truth = 1 + DELAY_MS / rows["base"]
        inside = (rows["ci_low"] <= truth) & (truth <= rows["ci_high"])
        out |= {"planted_inside": int(inside.sum()), "planted_ratio": f"{truth.min():.3f}-{truth.max():.3f}",
                "measured_ratio": f"{rows['ratio'].min():.3f}-{rows['ratio'].max():.3f}"}
    else:
        out |= {"ratio": f"{rows['ratio'].min():.3f}-{rows['ratio'].max():.3f}"}
    return out


def geomean(run_dir: Path) -> dict:
    """The step's geometric mean ratio over the cells with its CI (diff.json): for a paired
    A/A by rounds, one draw of the ratio between two engine instances."""
    s = json.loads((run_dir / "diff" / "diff.json").read_text())["summary"].get("step_ms", {})
    if s.get("geomean_ratio") is None:
        return {}
    return {"geomean": f"{s['geomean_ratio']:.4f} [{s['ci_low']:.4f}, {s['ci_high']:.4f}]"}


def noise_floor(run_dir: Path) -> Optional[float]:
    data = json.loads((run_dir / "diff" / "diff.json").read_text())
    value = data.get("noise_floor_pct") or data.get("summary", {}).get("noise_floor_pct")
    return float(value) if value is not None else None


def abba(k: int) -> list[tuple[str, int]]:
    """The order a paired sweep starts its engines: (side, start) for A B, B A, A B, ..."""
    return [(side, i) for i in range(k) for side in (("a", "b") if i % 2 == 0 else ("b", "a"))]


def canary_beside_steps(root: Path, study: str) -> tuple[pd.DataFrame, float]:
    """Per engine start of a paired run, in the order they ran: the speed canary's median and
    the cells' steps relative to each cell's own median over every start of both sides (the
    machine's speed as the engine saw it), from every cell's raw_timings.csv; and the
    correlation of canary and relative step over the rounds of every start."""
    pairs = raw_pairs(root, study)
    pairs["step_rel"] = pairs["step_ms"] / pairs.groupby("cell")["step_ms"].transform("median")
    k = int(pairs["replicate"].max()) + 1
    order = {key: i + 1 for i, key in enumerate(abba(k))}
    pairs["ran"] = [order[(s, int(r))] for s, r in zip(pairs["side"], pairs["replicate"])]
    rounds = pairs.groupby(["ran", "round"])[["canary_ms", "step_rel"]].median()
    starts = pairs.groupby("ran").agg(side=("side", "first"), start=("replicate", "first"),
                                      canary_ms=("canary_ms", "median"), step_rel=("step_rel", "median"))
    return starts.reset_index(), float(rounds["canary_ms"].corr(rounds["step_rel"]))


def raw_pairs(root: Path, study: str) -> pd.DataFrame:
    """Every timed pair of a paired run's finished cells, with its side and cell."""
    import io

    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{root / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=[f"hostsweep-{study}"])
    runs = runs[runs["tags.cell_key"].notna() & (runs["status"] == "FINISHED")]
    tables = []
    for run_id, side, batch, ctx in zip(runs["run_id"], runs["params.side"], runs["params.batch"], runs["params.ctx"]):
        table = pd.read_csv(io.StringIO(mlflow.artifacts.load_text(f"runs:/{run_id}/raw_timings.csv")))
        tables.append(table.assign(side=side, cell=f"b{batch}-ctx{ctx}"))
    return pd.concat(tables)


def planted_delta(root: Path, study: str) -> dict[str, str]:
    """Per cell of a paired-rounds run: the median over rounds of side b's step minus side a's
    (ms), with the distribution-free 95 % CI of that median (hostsweep's median_ci)."""
    from hostsweep.measure.intervals import median_ci

    pairs = raw_pairs(root, study)
    wide = pairs.pivot_table(index=["cell", "pair_round"], columns="side", values="step_ms").dropna()
    out = {}
    for cell, rows in wide.groupby(level="cell"):
        delta = (rows["b"] - rows["a"]).to_numpy()
        ci = median_ci(list(delta), 0.95)
        out[cell] = (f"{float(pd.Series(delta).median()):.3f} ms [{ci.low:.3f}, {ci.high:.3f}] over {len(delta)} rounds, "
                     f"side a {rows['a'].median():.3f} ms")
    return out


def machine_against_pairing(root: Path, study: str) -> str:
    """Paired rounds: how far the machine's speed moved over the run (each cell's side-a step
    per round over that cell's median, its 10th to 90th percentile, and the canary's) against
    how far the per-round ratio of a cell's two sides moved (the same percentiles)."""
    pairs = raw_pairs(root, study)
    wide = pairs.pivot_table(index=["cell", "round"], columns="side", values=["step_ms", "canary_ms"])
    step_a = wide[("step_ms", "a")]
    machine = step_a / step_a.groupby(level="cell").transform("median")
    ratio = wide[("step_ms", "b")] / step_a
    canary = wide[("canary_ms", "a")] / wide[("canary_ms", "a")].median()

    def spread(v: pd.Series) -> str:
        return f"{v.quantile(0.1):.2f}-{v.quantile(0.9):.2f}"

    return (f"side a's step over its cell's median {spread(machine)} (p10-p90 over {len(machine)} cell rounds), "
            f"the canary over its median {spread(canary)}; the per-round ratio b/a {spread(ratio)}, "
            f"median {ratio.median():.3f}")


def sequential_studies(root: Path, prefix: str, study_args: list[str], floor: Optional[float]) -> list[dict]:
    """PREFIX-a1, PREFIX-a2 and PREFIX-b (the planted delay) measured one after another as
    separate studies, then `stage=diff` of a1 against a2 (an A/A) and against b, widened by
    the noise floor where one was measured: each comparison's judged() row, printed too."""
    spent, results = {}, []
    for study, extra in ((f"{prefix}-a1", []), (f"{prefix}-a2", []), (f"{prefix}-b", PLANT)):
        rc, spent[study], _ = hostsweep(root / study, [f"study={study}", *study_args, *extra])
        if rc != 0:
            print(f"{study}: exit {rc} (see {root / study / 'console.txt'})", flush=True)
    floor_arg = [f"diff.noise_floor_pct={floor:.2f}"] if floor is not None else []
    base = f"{prefix}-a1"
    for head, planted in ((f"{prefix}-a2", False), (f"{prefix}-b", True)):
        folder = root / f"diff-{head}"
        rc, _, _ = hostsweep(folder, ["stage=diff", f"diff.base={base}", f"diff.head={head}", *GATE, *floor_arg])
        label = f"sequential {base} vs {head}" + (f", floor {floor:.2f} %" if floor is not None else "")
        results.append(judged(label, diff_rows(folder / "run"), rc, spent[base] + spent[head], planted)
                       | geomean(folder / "run"))
        print(json.dumps(results[-1]), flush=True)
    return results


def main() -> None:
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--keep", type=Path, default=None, help="folder for the runs (default: a temporary one)")
    parser.add_argument("--design", choices=("rounds", "starts"), default="rounds", help="pair.design")
    parser.add_argument("--reps", type=int, default=40, help="timed pairs per cell and side (measure.reps)")
    parser.add_argument("--calibration-rounds", type=int, default=150, help="rounds of the calibrate run")
    parser.add_argument("--rediff", action="store_true", help="redo the kept runs' diffs (not their sweeps)")
    parser.add_argument("--starts", type=int, default=3, help="engine starts per side (pair.starts, starts design)")
    args, overrides = parser.parse_known_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="paired-proofs-"))
    grid = [*GRID, f"measure.reps={args.reps}", *overrides]
    design = [f"pair.design={args.design}"] + ([f"pair.starts={args.starts}"] if args.design == "starts" else [])
    results, floor = [], None
    for name in args.runs.split(","):
        if name.startswith(("aa", "ab")):
            pair = ["pair.enabled=true"] if name.startswith("aa") else [f"+pair.against.{p}" for p in PLANT]
            folder = root / name
            rc, seconds, _ = hostsweep(folder, [f"study={name}", *grid, *pair, *design, *GATE])
            # the verdicts from stage=diff of the study: what the sweep's own diff said, redone by
            # the diff of this tree (--rediff: after a change to the diff, without measuring again)
            again = root / f"{name}-diff"
            if args.rediff:
                shutil.rmtree(again, ignore_errors=True)
            diff_rc, _, _ = hostsweep(again, ["stage=diff", f"diff.base={name}", *GATE])
            if diff_rc != rc:
                print(f"{name}: the sweep exited {rc}, its stage=diff {diff_rc}", flush=True)
            rows = diff_rows(again / "run")
            results.append(judged(name, rows, diff_rc, seconds, planted=name == "ab") | geomean(again / "run"))
            if floor is None and name.startswith("aa"):
                floor = noise_floor(again / "run")
            print(json.dumps(results[-1]), flush=True)
        elif name == "calibrate":
            # What the planted busy-wait really adds to a step on this machine: one paired-rounds
            # run of two cells with many rounds, per cell the median over rounds of b - a (ms)
            # with its order-statistic CI. The A/As say the design reads 0 when nothing changed.
            folder = root / name
            rc, seconds, _ = hostsweep(folder, [f"study={name}", *GRID, "batch=[1,8]", "ctx=[128]",
                                                f"measure.reps={args.calibration_rounds}", "pair.design=rounds",
                                                *[f"+pair.against.{p}" for p in PLANT]])
            print(json.dumps({"run": name, "exit": rc, "minutes": round(seconds / 60, 1),
                              **planted_delta(root, name)}), flush=True)
        elif name == "seq-paired":
            # The paired runs' sides read as two studies measured apart: aa-1's side a against
            # aa-2's (an A/A, minutes apart), aa-2's side b against ab's (the planted delay).
            for base, head, side, planted in (("aa-1", "aa-2", "a", False), ("aa-2", "ab", "b", True)):
                folder = root / f"seq-{base}-{head}"
                rc, seconds, _ = hostsweep(folder, ["stage=diff", f"diff.base={base}", f"diff.head={head}", *GATE,
                                                    f"diff.filter=\"params.side = '{side}'\""])
                rows = diff_rows(folder / "run")
                results.append(judged(f"sequential: {base} side {side} vs {head} side {side}", rows, rc, seconds,
                                      planted))
                print(json.dumps(results[-1]), flush=True)
        elif name == "seq":
            results += sequential_studies(root, "seq", [*grid, f"measure.replicates={args.starts}"], floor)
        elif name == "seq1":
            # One engine start per study, diffed with the between-start spread the first
            # paired A/A of this invocation measured (run one by start pairs before it:
            # --design starts --runs aa-s,seq1): the floor docs/diff.md tells a user to pass.
            if floor is None:
                print("seq1: no noise floor (run a start-pairs A/A first in the same invocation)", flush=True)
                continue
            results += sequential_studies(root, "seq1", grid, floor)
    for name in [n for n in args.runs.split(",") if n.startswith(("aa-", "ab"))]:
        if args.design == "rounds":
            print(f"\n{name}: {machine_against_pairing(root, name)}")
            continue
        starts, r = canary_beside_steps(root, name)
        print(f"\n{name}: speed canary beside the steps (each cell's pairs over its median across both sides), "
              f"per engine start in the order they ran; correlation over the rounds {r:.2f}")
        print(starts.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    table = pd.DataFrame(results)
    print()
    print(table.to_string(index=False))
    if floor is not None:
        print(f"\nnoise floor from the first paired A/A: {floor:.2f} % (diff.noise_floor_pct for the sequential diffs)")
    print(f"runs kept in {root}")


if __name__ == "__main__":
    main()
