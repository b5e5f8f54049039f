"""Does the harness scale? N-cell sweeps through the real path (`python -m hostsweep`: local
Ray, one fake-engine worker actor, the journal, cells.csv, a sqlite MLflow store), with the
fake engine answering instantly (HOSTSWEEP_FAKE_TIME_SCALE=0), so what is timed is the
harness alone.

For each N it prints: the sweep's wall time; cells per second while measuring (first to
last cell recorded) and end to end (first cell to the process's exit, MLflow's queue
drained); the driver's peak RSS (psutil, polled every 0.1 s); the time to plan (process
start to the "planned:" log line); then the same command again, which resumes every cell
(its plan time and wall); and the time to read every cell back into one DataFrame the two
ways hostsweep does (the model stage's read_cells, resume's finished_runs).

    .venv/bin/python benchmarks/sweep_scale.py --cells 1000 10000 [--keep DIR]
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import psutil

STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]")


def grid(cells: int) -> tuple[list[int], list[int]]:
    """batch x ctx lists with exactly `cells` cells of the same sizes whatever their number:
    batch 1..100 and contexts spread evenly over 8..107, so a cell costs the same in every
    sweep and only the count changes."""
    batches = min(100, cells)
    contexts = max(1, cells // batches)
    step = 100 // contexts if contexts <= 100 else 1
    ctx = [8 + i * step for i in range(contexts)]
    return list(range(1, batches + 1)), ctx


def command(cells: int, store: Path, run_dir: Path) -> list[str]:
    batch, ctx = grid(cells)
    return [sys.executable, "-m", "hostsweep", "+sku=cpu", "engine.name=fake", f"study=scale-{cells}",
            f"batch=[{','.join(map(str, batch))}]", f"ctx=[{','.join(map(str, ctx))}]",
            "measure.T=2", "measure.reps=2", "measure.warmups=0", "measure.bootstrap_resamples=100",
            "split.enabled=false", "ray.exclusive=false", f"tracking.uri=sqlite:///{store}",
            f"output.pending_dir={run_dir.parent / 'pending'}", f"hydra.run.dir={run_dir}"]


def run(cmd: list[str], cwd: Path, log: Path) -> dict[str, float]:
    """Run one sweep process; its wall, peak RSS (MiB), exit code, and RSS samples."""
    env = {**os.environ, "HOSTSWEEP_FAKE_TIME_SCALE": "0"}
    started = time.time()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
        watched, samples = psutil.Process(proc.pid), []
        while proc.poll() is None:
            try:
                samples.append((time.time(), watched.memory_info().rss / 2**20))
            except psutil.Error:
                pass
            time.sleep(0.1)
    return {"started": started, "wall": time.time() - started, "rss_mib": max(r for _, r in samples),
            "rc": proc.returncode, "samples": samples}


def peak_between(samples: list[tuple[float, float]], start: float, end: float) -> float:
    return max((rss for when, rss in samples if start <= when <= end), default=float("nan"))


def log_times(run_dir: Path, cells: int) -> dict[str, float]:
    """Epoch times of the plan line and of the first and last recorded cell."""
    found: dict[str, float] = {}
    for line in (run_dir / "hostsweep.log").read_text().splitlines():
        match = STAMP.match(line)
        if not match:
            continue
        when = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if "planned:" in line:
            found["planned"] = when
        elif f"] - [1/{cells}]" in line:
            found["first"] = when
        elif f"] - [{cells}/{cells}]" in line:
            found["last"] = when
    return found


def read_back(store: Path, cells: int) -> tuple[float, int, float, int]:
    """Seconds to read every cell run into one DataFrame (model stage) and by key (resume)."""
    from hostsweep.record.store import quiet_mlflow
    from hostsweep.record.readback import read_cells
    from hostsweep.record.tracking import SweepTracker

    quiet_mlflow()
    uri, name = f"sqlite:///{store}", f"hostsweep-scale-{cells}"
    start = time.perf_counter()
    frame = read_cells(uri, [name])
    frame_s = time.perf_counter() - start
    start = time.perf_counter()
    finished = SweepTracker(uri, name).finished_runs()
    return frame_s, len(frame), time.perf_counter() - start, len(finished)


def bench(cells: int, root: Path) -> None:
    store = root / f"mlflow-{cells}.db"
    first_dir, again_dir = root / f"first-{cells}", root / f"resume-{cells}"
    first = run(command(cells, store, first_dir), root, root / f"first-{cells}.out")
    times = log_times(first_dir, cells)
    measured = len(open(first_dir / "cells.csv").readlines()) - 1
    print(f"\n{cells} cells: rc {first['rc']}, {measured} rows in cells.csv, wall {first['wall']:.1f} s, "
          f"driver peak RSS {first['rss_mib']:.0f} MiB")
    if "last" in times:
        end = first["started"] + first["wall"]
        print(f"  driver peak RSS while measuring {peak_between(first['samples'], 0, times['last']):.0f} MiB, "
              f"after (MLflow drain, summary, figures) {peak_between(first['samples'], times['last'], end):.0f} MiB")
    if {"planned", "first", "last"} <= set(times):
        plan_s = times["planned"] - first["started"]
        measuring = max(times["last"] - times["first"], 1e-9)
        end_to_end = first["started"] + first["wall"] - times["first"]
        print(f"  plan {plan_s:.1f} s; cells/s while measuring {(cells - 1) / measuring:.1f}, "
              f"end to end (MLflow drained) {cells / end_to_end:.1f}")
    again = run(command(cells, store, again_dir), root, root / f"resume-{cells}.out")
    resumed = log_times(again_dir, cells)
    plan_again = resumed.get("planned", float("nan")) - again["started"]
    print(f"  resume (all {cells} FINISHED): rc {again['rc']}, plan {plan_again:.1f} s, wall {again['wall']:.1f} s, "
          f"driver peak RSS {again['rss_mib']:.0f} MiB")
    frame_s, rows, keyed_s, keys = read_back(store, cells)
    print(f"  read back: read_cells {frame_s:.1f} s ({rows} rows), finished_runs {keyed_s:.1f} s ({keys} keys)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--keep", type=Path, default=None, help="work in this folder and keep it")
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="sweep_scale-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"work folder {root}; batch x ctx grids: " + ", ".join(
        f"{n} = {len(grid(n)[0])} x {len(grid(n)[1])}" for n in args.cells))
    try:
        for cells in args.cells:
            bench(cells, root)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
