"""All-reduce microbenchmark: torch.distributed all_reduce over message sizes, k ranks
on one node (gloo on CPU, NCCL on GPUs); median seconds per size, for fit_allreduce."""
from __future__ import annotations

import os
import socket
import statistics
import time

import numpy as np
import pandas as pd

INNER_MAX = 20  # all-reduces per timed sample for the smallest messages
INNER_BYTES = 4e6  # ... and fewer as messages grow: about this many bytes per sample


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, sizes: list[int], reps: int, backend: str, queue) -> None:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    sync = torch.cuda.synchronize if backend == "nccl" else (lambda: None)
    dtype = torch.bfloat16 if backend == "nccl" else torch.float32
    results = []
    for nbytes in sizes:
        tensor = torch.ones(max(1, nbytes // torch.finfo(dtype).bits * 8), dtype=dtype, device=device)
        for _ in range(3):  # warm-up: connection setup and allocator
            dist.all_reduce(tensor)
        sync()
        # A sample is the mean of several back-to-back all-reduces (as nccl-tests does): one
        # small all-reduce is ~0.1 ms, below a shared machine's scheduling jitter.
        inner = max(1, min(INNER_MAX, int(INNER_BYTES // max(nbytes, 1))))
        times = []
        for _ in range(reps):
            dist.barrier()
            sync()
            start = time.perf_counter()
            for _ in range(inner):
                dist.all_reduce(tensor)
            sync()
            times.append((time.perf_counter() - start) / inner)
        results.append((tensor.numel() * tensor.element_size(), statistics.median(times)))
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def run_allreduce_sweep(ranks: int, sizes: np.ndarray, reps: int, backend: str = "gloo") -> pd.DataFrame:
    """Median all-reduce seconds per message size across `ranks` local processes."""
    import torch.multiprocessing as mp

    if ranks < 2:
        raise ValueError(f"an all-reduce needs at least 2 ranks, got {ranks}")
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    mp.start_processes(_rank_main, args=(ranks, _free_port(), [int(s) for s in sizes], reps, backend, queue),
                       nprocs=ranks, join=True, start_method="spawn")
    return pd.DataFrame(queue.get(), columns=["bytes", "seconds"])
