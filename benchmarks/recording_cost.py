"""What recording costs per cell, old code against new, interleaved: the tracker alone.

sweep_scale.py times whole sweeps, where Ray, the fake worker and the machine's load move
the figures by tens of percent between runs. This times only what the driver does with
MLflow (hostsweep/record/tracking.py), in a fresh process per (code, round), the two trees
alternating round by round so a load that drifts hits both alike:

- claim: SweepTracker.claim of N cells (the plan's MLflow part, after start_sweep);
- log: N measured cells logged into their claims as a sweep's recorder does, through its
  BackgroundLogger with `--deliveries K` threads (tracking.deliveries) and the cells waiting
  together in one SweepTracker.log_cells (one transaction into a database store;
  raw_timings.csv each); with several K, each K is a variant of its own, timed in the same
  rounds (the old tree: log_cell after log_cell);
- finished_runs: resume's read-back of the N cells; read_cells: the model stage's.

It prints each phase's median over the rounds in ms per cell and s per N, and old / new.

    .venv/bin/python benchmarks/recording_cost.py --cells 1000 --rounds 3 --baseline-src OLD_TREE
        [--tracking-uri http://127.0.0.1:5000] [--deliveries 1 4]

The old tree logs cell after cell in one thread (its uploader had one); --deliveries
applies to the new tree only.

Make OLD_TREE as docs/benchmarks.md says (git archive of the old commit's hostsweep and conf).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Optional

PHASES = ("claim", "log", "finished_runs", "read_cells")

ONE_ROUND = r"""
import json, sys, time
from hostsweep.record.store import quiet_mlflow
quiet_mlflow()
from hostsweep.measure.protocol import CellMeasurement, RepTiming
from hostsweep.measure.results import CellResult
from hostsweep.record.read.readback import read_cells
from hostsweep.record.tracking import SweepTracker

uri, name, n, deliveries = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
params = {"sku": "cpu", "model": "tiny-llama", "mode": "eager", "tp": 1, "batch": 1, "ctx": 128, "T": 2,
          "reps": 2, "warmups": 0, "dtype": "float32", "engine": "fake", "tp_executor": "mp"}
reps = (RepTiming(0, True, 0.010, 0.106, 0.003), RepTiming(1, False, 0.011, 0.107, 0.003))
host = {"hostname": "bench", "device_name": "cpu", "hostsweep_version": "0", "git_sha": "0"}
cells = [(f"cpu/tiny-llama/eager/tp1/b{i}/ctx128/T2/0123456789", {**params, "batch": i}) for i in range(n)]
import hostsweep
print("hostsweep from", hostsweep.__file__, file=sys.stderr)
tracker = SweepTracker(uri, name)
tracker.start_sweep("bench", "study: bench\n", {"n_cells": n}, {}, ("batch",))
times = {}
start = time.perf_counter()
claims, _ = tracker.claim(iter(cells), 300)
times["claim"] = time.perf_counter() - start
def cell(item):
    i, key, p = item
    result = CellResult(key=key, params=p, status="FINISHED",
                        measurement=CellMeasurement(3.0, 2.9, 3.1, 10.5, 106.5, reps), error=None, host=host,
                        duration_s=0.5, started_at=1_700_000_000.0 + i, ended_at=1_700_000_000.5 + i)
    return result, {"journal_entry": f"e{i}"}, claims.get(key)
def deliver(item):
    tracker.log_cell(*cell(item))
    tracker.delivered(f"e{item[0]}")
def deliver_many(items):  # the recorder's way: the cells waiting, together
    tracker.log_cells([cell(item) for item in items])
    for item in items:
        tracker.delivered(f"e{item[0]}")
start = time.perf_counter()
if deliveries == 0:  # the old tree: no deliveries argument, cell after cell
    for i, (key, p) in enumerate(cells):
        deliver((i, key, p))
else:
    from hostsweep.record.uploader import BackgroundLogger
    uploader = BackgroundLogger(deliver, tracker.heartbeat, 60, 30, deliveries=deliveries, deliver_many=deliver_many,
                                batch=tracker.cells_per_write())
    for i, (key, p) in enumerate(cells):
        uploader.submit((i, key, p))
    assert uploader.close(60) == 0 and uploader.failure() is None
times["log"] = time.perf_counter() - start
tracker.finish_sweep("FINISHED", {})
start = time.perf_counter()
assert len(tracker.finished_runs()) == n
times["finished_runs"] = time.perf_counter() - start
start = time.perf_counter()
assert len(read_cells(uri, [name])) == n
times["read_cells"] = time.perf_counter() - start
print(json.dumps(times))
"""


def one_round(uri: str, name: str, cells: int, src: Optional[Path], cwd: Path, deliveries: int) -> dict[str, float]:
    """One round in a fresh process; run from `cwd`, not the checkout, whose hostsweep/ would
    come before PYTHONPATH's (python -c puts the current folder first)."""
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(src), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    out = subprocess.run([sys.executable, "-c", ONE_ROUND, uri, name, str(cells), str(deliveries)], env=env, capture_output=True,
                         text=True, cwd=cwd)
    if out.returncode:
        raise SystemExit(f"a round failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline-src", type=Path, default=None, help="a checkout of the old code (see above)")
    parser.add_argument("--tracking-uri", default=None, help="default: a fresh sqlite file per round")
    parser.add_argument("--deliveries", type=int, nargs="+", default=[1],
                        help="delivery threads of the new tree's uploader (tracking.deliveries); several: one "
                             "variant each")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="recording_cost-"))
    print(f"work folder {root}", flush=True)
    # (tag, tree, deliveries): the new tree once per --deliveries, the old one cell after cell
    trees = [(f"new-d{k}" if len(args.deliveries) > 1 else "new", None, k) for k in args.deliveries]
    trees += [("old", args.baseline_src.resolve(), 0)] if args.baseline_src else []
    found: dict[str, list[dict[str, float]]] = {tag: [] for tag, _, _ in trees}
    for r in range(args.rounds):
        for tag, src, deliveries in (trees if r % 2 == 0 else trees[::-1]):  # alternate which goes first
            uri = args.tracking_uri or f"sqlite:///{root / f'{tag}-{r}.db'}"
            name = f"hostsweep-recording-{tag}-{r}-{datetime.now():%H%M%S%f}"
            found[tag].append(one_round(uri, name, args.cells, src, root, deliveries))
            print(f"round {r + 1} {tag}: " + ", ".join(f"{k} {v:.2f} s" for k, v in found[tag][-1].items()),
                  flush=True)
    print(f"\n{args.cells} cells, {args.rounds} rounds, store {args.tracking_uri or 'sqlite (fresh file per round)'}; "
          f"median s (ms per cell); load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    first = trees[0][0]
    for phase in PHASES:
        med = {tag: statistics.median(r[phase] for r in rounds) for tag, rounds in found.items()}
        line = ", ".join(f"{tag} {v:.2f} s ({1000 * v / args.cells:.2f} ms/cell)" for tag, v in med.items())
        line += "".join(f"; {tag} / {first} {v / med[first]:.2f}x" for tag, v in med.items() if tag != first)
        if phase == "log":
            line += "; cells/s " + ", ".join(f"{tag} {args.cells / v:.1f}" for tag, v in med.items())
        print(f"  {phase}: {line}")


if __name__ == "__main__":
    main()
