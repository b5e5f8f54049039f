"""What does the idle partner engine of paired rounds cost the timed side? One cell timed on
engine A alone, with engine B started beside it and idle, with B timed right before each of
A's pairs (as paired rounds do), and alone again after B is closed (A B B A over time, so a
drift of the machine lands on "alone" from both sides).

Both engines serve the same cell in this process, as a paired-rounds worker holds its two
sides. Per phase it prints the median step of A's pairs with its order-statistic CI, its
ratio to the two alone phases pooled, and B's CPU while A was timed: the CPU seconds of B's
processes (its EngineCore and worker) over the wall seconds of A's pairs, in % of one core,
and the same for A's own processes for scale. The question (issue: a paired sweep's four
engine processes showed 38-55 % CPU each on a 2-core VM): is an idle partner's CPU, or its
having just run, a cost to the timed side beyond the noise?

    .venv/bin/python benchmarks/idle_partner.py [--pairs 40] [hydra overrides, e.g. batch=[4]]
"""
from __future__ import annotations

import argparse
import os
import time
from typing import Callable, Optional

import numpy as np
import psutil

from hostsweep.measure.intervals import median_ci
from hostsweep.measure.protocol import time_pair
from hostsweep.run.worker import SweepWorker
from studies import composed_study


def tree(pids: set[int]) -> list[psutil.Process]:
    out = []
    for pid in pids:
        try:
            out.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return out


def cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for p in processes:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def descendants() -> set[int]:
    return {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)}


def timed_phase(name: str, generate: Callable[[int], float], T: int, pairs: int, own: list[psutil.Process],
                partner: list[psutil.Process], before_each: Optional[Callable[[], None]] = None) -> dict:
    steps, own_cpu, partner_cpu, walls = [], 0.0, 0.0, 0.0
    for k in range(pairs):
        if before_each is not None:
            before_each()
        own_0, partner_0, start = cpu_seconds(own), cpu_seconds(partner), time.perf_counter()
        timing = time_pair(generate, T, k, k % 2 == 0)
        walls += time.perf_counter() - start
        own_cpu += cpu_seconds(own) - own_0
        partner_cpu += cpu_seconds(partner) - partner_0
        steps.append(timing.step_s * 1e3)
    ci = median_ci(np.array(steps), 0.95)
    return {"phase": name, "steps": np.array(steps), "median": float(np.median(steps)), "low": ci.low,
            "high": ci.high, "own_cpu_pct": 100 * own_cpu / walls, "partner_cpu_pct": 100 * partner_cpu / walls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=40, help="timed pairs of A per phase")
    args, overrides = parser.parse_known_args()
    study, cells = composed_study(["+sku=cpu", "batch=[1]", "ctx=[128]", "split.enabled=false", *overrides])
    cell = cells[0]
    started = time.perf_counter()
    before = descendants()
    a = SweepWorker(cell.engine)
    a_procs = tree(descendants() - before)
    generate_a = a._timed_generate(a.prompts(cell))
    for _ in range(3):  # warm-up: not timed
        time_pair(generate_a, cell.T, 0, True)
    results = [timed_phase("alone (before B)", generate_a, cell.T, args.pairs, a_procs, [])]
    before_b = descendants()
    b = SweepWorker(cell.engine)
    b_procs = tree(descendants() - before_b)
    generate_b = b._timed_generate(b.prompts(cell))
    for _ in range(3):
        time_pair(generate_b, cell.T, 0, True)
    time.sleep(1.0)  # B settles idle
    results.append(timed_phase("B started, idle", generate_a, cell.T, args.pairs, a_procs, b_procs))

    def b_pair() -> None:  # what paired rounds do: the other side's pair right before this one
        time_pair(generate_b, cell.T, 0, True)

    results.append(timed_phase("B timed before each pair", generate_a, cell.T, args.pairs, a_procs, b_procs,
                               before_each=b_pair))
    results.append(timed_phase("B started, idle (again)", generate_a, cell.T, args.pairs, a_procs, b_procs))
    b.close()
    results.append(timed_phase("alone (B closed)", generate_a, cell.T, args.pairs, a_procs, []))
    a.close()
    alone = np.concatenate([r["steps"] for r in results if r["phase"].startswith("alone")])
    alone_median = float(np.median(alone))
    print(f"cell b{cell.batch} ctx{cell.ctx} T={cell.T}, {args.pairs} pairs a phase, "
          f"{(time.perf_counter() - started) / 60:.1f} min in all; B's and A's CPU in % of one core while A's "
          "pairs ran")
    print(f"{'phase':>26} {'step ms':>8} {'95% CI':>17} {'/ alone':>8} {'B cpu %':>8} {'A cpu %':>8}")
    for r in results:
        print(f"{r['phase']:>26} {r['median']:8.3f} [{r['low']:6.3f}, {r['high']:6.3f}] "
              f"{r['median'] / alone_median:8.3f} {r['partner_cpu_pct']:8.1f} {r['own_cpu_pct']:8.1f}")
    rng = np.random.default_rng(0)
    for r in results:
        if r["phase"].startswith("alone"):
            continue
        # the ratio of medians against the alone phases pooled, with a bootstrap CI over both
        boot = [np.median(rng.choice(r["steps"], r["steps"].size)) / np.median(rng.choice(alone, alone.size))
                for _ in range(2000)]
        low, high = np.percentile(boot, [2.5, 97.5])
        print(f"{r['phase']:>26}: median step / alone {r['median'] / alone_median:.3f} [{low:.3f}, {high:.3f}]")


if __name__ == "__main__":
    main()
