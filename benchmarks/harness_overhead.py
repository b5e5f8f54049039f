"""Does the Ray harness change what it measures? One cell, measured in one run three ways:

  A  plain process, no Ray running (the worker class called directly)
  B  the same plain-process engine, with a local Ray cluster's daemons running beside it
  C  through a Ray worker actor (what `python -m hostsweep` does)

and prints the medians and the ratios C/A (the whole harness), B/A (Ray's daemons on the
same cores) and C/B (the actor itself). Target: C/A within 3%.

    .venv/bin/python benchmarks/harness_overhead.py [hydra overrides, e.g. batch=[1] ctx=[128]]
"""
from __future__ import annotations

import statistics
import sys

from hydra import compose, initialize_config_module

from hostsweep.config import register_configs, to_sweep_config
from hostsweep.grid import build_cells
from hostsweep.worker import MeasureOptions, SweepWorker


def main() -> None:
    import ray

    from hostsweep.cluster import connect, disconnect, new_worker, release_worker

    register_configs()
    with initialize_config_module("hostsweep.conf", version_base="1.3"):
        cfg = to_sweep_config(compose("config", overrides=["+sku=cpu", "batch=[1]", "ctx=[128]",
                                                           "split.enabled=false",
                                                           *[a for a in sys.argv[1:] if not a.startswith("--")]]))
    cell = build_cells(cfg)[0]
    options = MeasureOptions(split=False)
    rounds = 3
    plain = SweepWorker(cell.engine)
    alone = [plain.measure(cell, options).measurement.step_ms for _ in range(rounds)]
    started = connect(None, confine_daemons="--confine-daemons" in sys.argv)
    beside_ray = [plain.measure(cell, options).measurement.step_ms for _ in range(rounds)]
    plain.close()
    actor = new_worker(cell.engine)
    through_actor = [ray.get(actor.measure.remote(cell, options)).measurement.step_ms for _ in range(rounds)]
    actor_host = ray.get(actor.host_info.remote())
    ray.get(actor.close.remote())
    release_worker(actor)
    disconnect(started)
    a, b, c = (statistics.median(x) for x in (alone, beside_ray, through_actor))
    print(f"cell {cell.key}; actor host info {actor_host}")
    for label, median, steps in (("A plain, no Ray", a, alone), ("B plain, Ray daemons up", b, beside_ray),
                                 ("C Ray worker actor", c, through_actor)):
        print(f"{label:24s} {median:.3f} ms/step (rounds {', '.join(f'{s:.3f}' for s in steps)})")
    print(f"C/A = {c / a:.3f} (whole harness; target within 3%: {'yes' if abs(c / a - 1) <= 0.03 else 'no'})")
    print(f"B/A = {b / a:.3f} (Ray daemons on the same cores)   C/B = {c / b:.3f} (the actor itself)")
    spread = max((max(x) - min(x)) / statistics.median(x) for x in (alone, beside_ray, through_actor))
    print(f"noise: rounds of one configuration spread up to {spread:.1%}; ratios closer to 1 than that "
          "are not resolved by this run")


if __name__ == "__main__":
    main()
