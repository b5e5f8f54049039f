"""Is a host phase on the step's critical path? Sleep a known d ms inside it and see what moves.

For each delay d (0 first, the baseline), one vLLM engine (the CPU build here) is started with
the test-only hook `debug.delay_phase=<phase> debug.delay_ms=d` (engines/vllm_plugin.py), one
cell is timed as a sweep times it (its step with a bootstrap 95% CI), and --pairs profiled
T=1 / T pairs give that phase's host ms per step, with a bootstrap CI of their median. It
prints, per d: the step and its rise over d=0, the phase and its rise, and the largest move
of any other phase. A phase on the critical path moves the step and itself by d; one that
overlaps the next step (`--phase frontend_process_outputs`: the front-end's output
processing, reported as overlapped) moves itself by d and the step by less, and
`frontend_exposed` says how much of it the step could not hide.

    .venv/bin/python benchmarks/phase_delay.py [--phase sample] [--delays 0 2] [--pairs 5] [hydra overrides]

Each delay is an engine start (~30 s here) and a cell (~20 s): keep the list short on a shared
machine.
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np

from hostsweep.measure.protocol import bootstrap_median_ci
from hostsweep.measure.results import MeasureOptions
from hostsweep.run.worker import SweepWorker
from studies import composed_study

RESAMPLES = 2000


def measure(phase: str, delay_ms: float, pairs: int, overrides: list[str]) -> dict[str, object]:
    """The cell's step (median, CI) and, over `pairs` profiled pairs, every phase's host ms."""
    debug = [f"debug.delay_phase={phase}", f"debug.delay_ms={delay_ms}"] if delay_ms > 0 else []
    study, cells = composed_study(["+sku=cpu", "batch=[1]", "ctx=[128]", *debug, *overrides])
    cell = cells[0]
    options = MeasureOptions.of(study.config)
    worker = SweepWorker(cell.engine)
    try:
        result = worker.measure(cell, options)
        if result.status != "FINISHED":
            raise RuntimeError(result.error)
        m = result.measurement
        prompts = worker.prompts(cell)
        splits = [worker._profiled_pairs(cell, [worker._profile_pair(cell, prompts, options, None)], m, options)
                  for _ in range(pairs)]  # one pair each: its phases as profiled (host_ms, unscaled)
        phases = [s.phases for s in splits]
    finally:
        worker.close()
    if any(p is None for p in phases):
        raise RuntimeError("no host phases: is hostsweep's vLLM plugin installed (pip install -e .)?")
    # Host phases and the front-end's overlapped work (measure/phases.py) by one name each.
    per_pair = [{**p.host_ms, **p.overlapped_ms} for p in phases]
    per_phase = {name: [pair.get(name, 0.0) for pair in per_pair] for name in sorted(set().union(*per_pair))}
    per_phase["(profiled step)"] = [s.profiled_step_ms for s in splits]
    per_phase["(device)"] = [s.device_ms for s in splits]
    return {"step": (m.step_ms, m.step_ci_low_ms, m.step_ci_high_ms), "phases": per_phase}


def median_ci(values: list[float]) -> tuple[float, float, float]:
    low, high = bootstrap_median_ci(values, RESAMPLES, 0.95, np.random.default_rng(0))
    return statistics.median(values), low, high


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", default="sample", help="the phase the delay sits in (config debug.delay_phase)")
    parser.add_argument("--delays", type=float, nargs="+", default=[0.0, 2.0], help="delays in ms; 0 is the baseline")
    parser.add_argument("--pairs", type=int, default=5, help="profiled T=1/T pairs per delay (the phases' CI)")
    args, overrides = parser.parse_known_args()
    delays = [0.0] + [d for d in args.delays if d > 0]
    runs = {d: measure(args.phase, d, args.pairs, overrides) for d in delays}
    base = runs[0.0]
    name = "forward_dispatch" if args.phase == "forward" else args.phase
    print(f"delay in phase {args.phase!r}; ms per step, median [95% CI]; {args.pairs} profiled pairs per delay")
    print(f"{'d':>5} | {'step':>22} {'Δstep':>6} | {name + ' (phase)':>24} {'Δphase':>7} | largest Δ other phase")
    for d, run in runs.items():
        step, low, high = run["step"]  # type: ignore[misc]
        phase = median_ci(run["phases"].get(name, [0.0]))  # type: ignore[union-attr]
        base_phase = statistics.median(base["phases"].get(name, [0.0]))  # type: ignore[union-attr]
        others = {p: statistics.median(v) - statistics.median(base["phases"].get(p, [0.0]))  # type: ignore[union-attr]
                  for p, v in run["phases"].items() if p != name and not p.startswith("(")}  # type: ignore[union-attr]
        worst = max(others.items(), key=lambda kv: abs(kv[1]), default=("-", 0.0))
        print(f"{d:5.1f} | {step:6.3f} [{low:6.3f}, {high:6.3f}] {step - base['step'][0]:+6.3f} | "  # type: ignore[index]
              f"{phase[0]:6.3f} [{phase[1]:6.3f}, {phase[2]:6.3f}] {phase[0] - base_phase:+7.3f} | "
              f"{worst[0]} {worst[1]:+.3f}")
    print("\nper phase, ms per step (median of the profiled pairs) at each delay:")
    names = list(base["phases"])  # type: ignore[arg-type]
    print(f"{'phase':>22} " + " ".join(f"{'d=' + format(d, 'g'):>8}" for d in runs))
    for p in names:
        print(f"{p:>22} " + " ".join(f"{statistics.median(run['phases'].get(p, [0.0])):8.3f}"  # type: ignore[union-attr]
                                     for run in runs.values()))


if __name__ == "__main__":
    main()
