"""What do the host phases add to a cell's split? Two engines side by side, one with phases.

Engine A runs with `split.phases=true` (hostsweep's vLLM plugin scopes the profiled pairs,
times the EngineCore, and the worker parses the phases), engine B with `split.phases=false`;
both serve the same cell in this process. After each has timed the cell once, the split
phase alone (SweepWorker._split: profiler start and stop, the profiled pair, trace export,
parsing) runs --rounds times on each, alternating A and B, so drift lands on both. It prints
the median split_s and split_overhead_s of each and the median of the paired differences
A - B with a bootstrap 95% CI: the issue's target is at most 0.3 s.

    .venv/bin/python benchmarks/phase_cost.py [--rounds 8] [hydra overrides, e.g. ctx=[512]]
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np

from hostsweep.measure.protocol import bootstrap_median_ci
from hostsweep.measure.results import MeasureOptions
from hostsweep.run.worker import SweepWorker
from studies import composed_study


def study_cell(phases: bool, overrides: list[str]):
    study, cells = composed_study(["+sku=cpu", "batch=[1]", "ctx=[128]", f"split.phases={str(phases).lower()}",
                                   *overrides])
    return cells[0], MeasureOptions.of(study.config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8, help="split phases per engine, alternating")
    args, overrides = parser.parse_known_args()
    sides = {"A phases on": study_cell(True, overrides), "B phases off": study_cell(False, overrides)}
    workers = {name: SweepWorker(cell.engine) for name, (cell, _) in sides.items()}  # A first: its env
    try:
        timed = {name: workers[name].measure(cell, opts) for name, (cell, opts) in sides.items()}
        prompts = {name: workers[name].prompts(cell) for name, (cell, _) in sides.items()}  # as measure's
        costs: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
        for r in range(args.rounds):
            for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                cell, opts = sides[name]
                pair = workers[name]._profile_pair(cell, prompts[name], opts, None)
                split = workers[name]._split(cell, [pair], timed[name].measurement, opts)
                costs[name].append((split.split_s, split.split_overhead_s))
    finally:
        for worker in workers.values():
            worker.close()
    for name, values in costs.items():
        print(f"{name}: split_s median {statistics.median(v[0] for v in values):.3f} s, "
              f"split_overhead_s median {statistics.median(v[1] for v in values):.3f} s ({len(values)} splits)")
    a, b = costs["A phases on"], costs["B phases off"]
    diffs = [x[0] - y[0] for x, y in zip(a, b)]
    low, high = bootstrap_median_ci(diffs, 2000, 0.95, np.random.default_rng(0))
    print(f"A - B split_s, paired: median {statistics.median(diffs):+.3f} s, 95% CI [{low:+.3f}, {high:+.3f}] "
          f"(target: <= +0.3 s)")


if __name__ == "__main__":
    main()
