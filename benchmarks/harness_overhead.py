"""Does the Ray harness change what it measures? One cell, in one run, three ways:

  A  a plain-process engine (the worker class called directly) with every Ray process
     frozen (SIGSTOP: Ray's daemons, the actor and its engine use no CPU while A runs)
  B  that same plain-process engine with Ray's processes live beside it
  C  a Ray worker actor's engine (what `python -m hostsweep` does)

Each round measures all three, rotating their order, so slow drift of this shared
machine hits all alike, and the ratios C/A, B/A and C/B are taken per round. Before Ray
starts and after it stops the plain engine is also measured with no Ray at all (the
bracket): it checks that freezing Ray is as good as not running it, and shows the drift.

It prints each ratio's median with a bootstrap 95% CI and a verdict against the 3%
target: "yes" when the whole CI lies within 3% of 1, "no" when it lies wholly outside,
otherwise "unresolved" (more rounds needed).

    .venv/bin/python benchmarks/harness_overhead.py [--rounds N] [hydra overrides, e.g. ctx=[512]]
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import numpy as np

from hostsweep.measure.protocol import bootstrap_median_ci
from hostsweep.measure.results import MeasureOptions
from hostsweep.run.worker import SweepWorker
from studies import composed_study

TARGET = 0.03
RESAMPLES = 4000


@contextmanager
def frozen(pids: set[int]) -> Iterator[None]:
    """SIGSTOP these processes for the block, SIGCONT them after, whatever happens."""
    stopped = []
    try:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
            except ProcessLookupError:
                pass
        yield
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def verdict(low: float, high: float) -> str:
    if 1 - TARGET <= low and high <= 1 + TARGET:
        return "yes"
    if high < 1 - TARGET or low > 1 + TARGET:
        return "no"
    return "unresolved"


def report(label: str, ratios: list[float], rng: np.random.Generator) -> None:
    low, high = bootstrap_median_ci(ratios, RESAMPLES, 0.95, rng)
    print(f"{label:42s} {statistics.median(ratios):.3f}  95% CI [{low:.3f}, {high:.3f}]  "
          f"within {TARGET:.0%}: {verdict(low, high)}")


def main() -> None:
    import ray

    from hostsweep.run.actors import new_worker, release_worker
    from hostsweep.run.cluster import connect, disconnect
    from hostsweep.run.hygiene import descendant_pids

    def descendants() -> set[int]:
        return set(descendant_pids(os.getpid()))

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30, help="rounds of A, B and C")
    parser.add_argument("--bracket", type=int, default=5, help="no-Ray rounds before Ray starts and after it stops")
    args, overrides = parser.parse_known_args()
    study, cells = composed_study(["+sku=cpu", "batch=[1]", "ctx=[128]", "split.enabled=false", *overrides])
    cell = cells[0]
    options = MeasureOptions.of(study.config)
    started_at = time.perf_counter()

    plain = SweepWorker(cell.engine)
    engine_processes = descendants()  # the plain engine's EngineCore and its workers

    def measure_plain() -> float:
        return plain.measure(cell, options).measurement.step_ms

    no_ray_before = [measure_plain() for _ in range(args.bracket)]
    started = connect(None, study.config.ray.confine_daemons, study.config.ray.idle_daemons)
    worker = new_worker(cell.engine)
    actor = worker.actor
    actor_host = ray.get(actor.host_info.remote())  # waits for the actor's engine

    def measure_ray_frozen() -> float:
        with frozen(descendants() - engine_processes):
            return measure_plain()

    def measure_actor() -> float:
        return ray.get(actor.measure.remote(cell, options)).measurement.step_ms

    conditions: dict[str, Callable[[], float]] = {"A": measure_ray_frozen, "B": measure_plain, "C": measure_actor}
    steps: dict[str, list[float]] = {name: [] for name in conditions}
    for round_ in range(args.rounds):
        names = list(conditions)
        for name in names[round_ % 3:] + names[:round_ % 3]:
            steps[name].append(conditions[name]())
    ray.get(actor.close.remote())
    release_worker(worker)
    disconnect(started)
    no_ray_after = [measure_plain() for _ in range(args.bracket)]
    plain.close()

    rng = np.random.default_rng(0)
    ray_cfg = study.config.ray
    print(f"cell {cell.key}; confine_daemons={ray_cfg.confine_daemons} idle_daemons={ray_cfg.idle_daemons}; "
          f"{args.rounds} rounds, "
          f"{2 * args.bracket} no-Ray bracket rounds, {time.perf_counter() - started_at:.0f} s")
    print(f"actor host info {actor_host}")
    rows = (("no Ray (before)", no_ray_before), ("A plain, Ray frozen", steps["A"]),
            ("B plain, Ray live", steps["B"]), ("C Ray worker actor", steps["C"]),
            ("no Ray (after)", no_ray_after))
    for label, values in rows:
        print(f"{label:20s} median {statistics.median(values):.3f} ms/step; "
              f"rounds {' '.join(f'{v:.2f}' for v in values)}")
    per_round = {pair: [x / y for x, y in zip(steps[pair[0]], steps[pair[1]])] for pair in ("CA", "BA", "CB")}
    report("C/A the whole harness", per_round["CA"], rng)
    report("B/A Ray's processes live vs frozen", per_round["BA"], rng)
    report("C/B the actor itself", per_round["CB"], rng)
    bracket = statistics.median(no_ray_before + no_ray_after)
    print(f"check: frozen-Ray A / no-Ray bracket = {statistics.median(steps['A']) / bracket:.3f} (unpaired); "
          f"drift: bracket after / before = {statistics.median(no_ray_after) / statistics.median(no_ray_before):.3f}")


if __name__ == "__main__":
    main()
