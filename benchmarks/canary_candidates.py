"""Which speed canary tracks what moves the engine? Candidate canaries timed beside the same
cells' pairs, round after round, each judged by how much of the cells' round-to-round step
moves its own moves explain (measure/canary_tracking.py, the statistic every run records).

Two cells (the default model at b1 ctx128 and b4 ctx512) are timed in interleaved rounds on
one engine; after each round every candidate is timed once, in an order rotated by round:

    current       run/canary.py as the worker runs it: a pure-Python loop and eight 64x64
                  float32 products, on the worker's one thread
    python        the pure-Python loop alone (the interpreter's speed: a step's host half)
    gemm-2t       products of the model's decode shapes (batch 4 x hidden by hidden x
                  intermediate, the engine's dtype) on two threads, as the engine's OMP
                  threads run them
    copy          a 64 MiB tensor copied (the memory system, which a larger model's weights
                  stream through)
    mixed         python + gemm-2t + copy

It prints per candidate the correlation r of its round-to-round moves with the cells'
common step moves, the share it explains (r^2), the slope (1: the step moves as the canary
does) and its cost per round. The one chosen replaces the worker's canary when it tracks
clearly better; which, and the numbers, go to benchmarks/RESULTS.md.

    .venv/bin/python benchmarks/canary_candidates.py [--rounds 80] [hydra overrides...]
"""
from __future__ import annotations

import argparse
import time
from typing import Callable

import numpy as np
import torch

from hostsweep.measure.canary_tracking import tracking
from hostsweep.measure.protocol import time_pair
from hostsweep.run.canary import Canary, python_loop
from hostsweep.run.worker import SweepWorker
from studies import composed_study

COPY_BYTES = 64 * 1024 * 1024
GEMM_REPEATS = 20
BLOCK = 8  # rounds a block: the machine's slower moves, which a round's pair noise hides


def candidates(hidden: int, intermediate: int, dtype: torch.dtype) -> dict[str, Callable[[], None]]:
    current = Canary()
    a = torch.randn((4, hidden), dtype=dtype)
    w = torch.randn((hidden, intermediate), dtype=dtype)
    src = torch.ones(COPY_BYTES // 4, dtype=torch.float32)
    dst = torch.empty_like(src)

    def gemm_2t() -> None:
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            for _ in range(GEMM_REPEATS):
                torch.mm(a, w)
        finally:
            torch.set_num_threads(threads)

    def copy() -> None:
        dst.copy_(src)

    def mixed() -> None:
        python_loop()
        gemm_2t()
        copy()

    return {"current": current.time_ms, "python": python_loop, "gemm-2t": gemm_2t, "copy": copy, "mixed": mixed}


def timed_ms(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=80, help="rounds of the two cells, each followed by every candidate")
    args, overrides = parser.parse_known_args()
    study, cells = composed_study(["+sku=cpu", "batch=[1,4]", "ctx=[128,512]", "split.enabled=false", *overrides])
    cells = [c for c in cells if (c.batch, c.ctx) in ((1, 128), (4, 512))]
    shape = study.models[0].shape
    started = time.perf_counter()
    worker = SweepWorker(cells[0].engine)
    dtype = worker.engine.llm.llm_engine.vllm_config.model_config.dtype  # what the engine resolved `auto` to
    runs = candidates(shape.hidden_size, shape.intermediate_size, dtype)
    for run in runs.values():  # first runs pay for allocation and thread start-up
        run()
    generates = [worker._timed_generate(worker.prompts(c)) for c in cells]
    for generate, cell in zip(generates, cells):
        for _ in range(3):
            time_pair(generate, cell.T, 0, True)
    steps: list[tuple[int, int, float]] = []
    canaries: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(args.rounds):
        for i, (generate, cell) in enumerate(zip(generates, cells)):
            steps.append((r, i, time_pair(generate, cell.T, r, r % 2 == 0).step_s * 1e3))
        order = names[r % len(names):] + names[:r % len(names)]
        timed = {name: timed_ms(runs[name]) for name in order}
        for name in names:
            canaries[name].append(timed[name])
    worker.close()
    print(f"{len(cells)} cells ({', '.join(f'b{c.batch} ctx{c.ctx}' for c in cells)}), {args.rounds} rounds, "
          f"engine dtype {dtype}, {(time.perf_counter() - started) / 60:.1f} min in all")
    print(f"{'candidate':>10} {'r':>6} {'explains':>9} {'slope':>6} {'ms/round':>9}   over blocks of {BLOCK} rounds: "
          "r, explains")
    for name in names:
        t = tracking(((0, 0, r), i, step, canaries[name][r]) for r, i, step in steps)
        b = tracking(((0, 0, r // BLOCK), i, step, canaries[name][r]) for r, i, step in steps)
        cost = float(np.median(canaries[name]))
        rounds = f"{t.r:+6.2f} {t.explained_pct:8.0f}% {t.slope:6.2f}" if t else f"{'–':>6} {'–':>9} {'–':>6}"
        blocks = f"{b.r:+.2f}, {b.explained_pct:.0f}%" if b else "–"
        print(f"{name:>10} {rounds} {cost:9.2f}   {blocks}")


if __name__ == "__main__":
    main()
