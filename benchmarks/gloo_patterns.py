"""How long one gloo all-reduce takes on this machine, by where its threads may run and what
the rank does between calls; and what the all-reduce calibration (calibrate/engine_allreduce)
measures beside them, in one run.

Why: on a CPU whose vLLM kernels lack the shared-memory all-reduce (no AVX-512), the engine's
TP ranks reduce through gloo, and each rank's threads (gloo's included) are bound to the
rank's core. A gloo all-reduce then waits on the scheduler of that one core, and its time
depends on the pattern of calls. This prints each pattern's median and 10th/90th percentile,
and its ratio to the calibration's median, so that docs/tp-model.md's statement ("no setup
of the microbenchmark reproduces the in-situ time") rests on numbers measured together.

    python benchmarks/gloo_patterns.py [--reps 300] [--bytes 4096]

Two ranks, float32, loopback TCP. Run it alone on the machine: it measures scheduling.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import time

import numpy as np

PATTERNS = ("back_to_back", "after_barrier", "compute_between")
OMP_KEYS = ("OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank(rank: int, port: int, pattern: str, nbytes: int, reps: int, out: "mp.Queue") -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tensor, matrix = torch.zeros(max(1, nbytes // 4)), torch.randn(192, 192)
    for _ in range(20):
        dist.all_reduce(tensor)
    times = []
    for _ in range(reps):
        if pattern == "after_barrier":
            dist.barrier()
        elif pattern == "compute_between":
            matrix @ matrix  # a projection's worth of work between all-reduces, as in a decode step
        start = time.perf_counter()
        dist.all_reduce(tensor)
        times.append(time.perf_counter() - start)
    out.put((rank, times))
    dist.destroy_process_group()


def gloo_pattern(pattern: str, bound: bool, nbytes: int, reps: int) -> np.ndarray:
    """Per-call seconds, the slower rank's of each call; `bound`: each rank's threads on one
    core, the environment vLLM's executor gives a CPU TP worker (OMP_PROC_BIND binds the first
    thread at start, and threads started later, gloo's, inherit its core)."""
    context, port = mp.get_context("spawn"), _free_port()
    out, processes = context.Queue(), []
    for rank in range(2):
        if bound:
            os.environ.update(OMP_NUM_THREADS="1", OMP_PLACES=f"{{{rank}}}", OMP_PROC_BIND="true")
        process = context.Process(target=_rank, args=(rank, port, pattern, nbytes, reps, out))
        process.start()
        processes.append(process)
        for key in OMP_KEYS:
            os.environ.pop(key, None)
    results = dict(out.get() for _ in processes)
    for process in processes:
        process.join()
    return np.maximum(np.array(results[0]), np.array(results[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=300, help="timed all-reduces per pattern")
    parser.add_argument("--bytes", type=int, default=4096, help="message size (bytes of float32)")
    args = parser.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("gloo_patterns: needs 2 cores")
    from hostsweep.calibrate.engine_allreduce import cpu_engine_path, run_engine_allreduce
    from hostsweep.config.machine import cpu_model_name

    print(f"machine: {cpu_model_name()}; vLLM's CPU all-reduce path here: {cpu_engine_path()}")
    calibration = run_engine_allreduce(2, np.array([args.bytes]), 15, "float32")
    calibrated = float(calibration["seconds"].iloc[0])
    print(f"calibration (vLLM get_tp_group().all_reduce, {calibration['path'].iloc[0]}, back to back): "
          f"{calibrated * 1e6:.0f} us [{calibration['ci_low_s'].iloc[0] * 1e6:.0f}, "
          f"{calibration['ci_high_s'].iloc[0] * 1e6:.0f}]")
    print(f"{'threads':<10} {'pattern':<16} {'median_us':>9} {'p10_us':>7} {'p90_us':>7} {'/calib':>7}")
    for bound in (True, False):
        for pattern in PATTERNS:
            seconds = gloo_pattern(pattern, bound, args.bytes, args.reps)
            median = float(np.median(seconds))
            print(f"{'one core' if bound else 'any core':<10} {pattern:<16} {median * 1e6:9.0f} "
                  f"{np.percentile(seconds, 10) * 1e6:7.0f} {np.percentile(seconds, 90) * 1e6:7.0f} "
                  f"{median / calibrated:7.2f}")


if __name__ == "__main__":
    main()
