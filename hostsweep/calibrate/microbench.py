"""The roofs microbenchmark for the TP model (the SKU's achieved GEMM FLOP/s and copy
bandwidth; torch), and `run_on_sku`, which runs any calibration benchmark here or as a
Ray task pinned to the SKU it describes.

The all-reduce sweep lives in allreduce_bench.py; H(N) from measured cells in
model/host_calibration.py.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

import numpy as np


def _median_seconds(action: Callable[[], None], sync: Callable[[], None], reps: int) -> float:
    action()  # warm-up: allocation, kernel selection
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        action()
        sync()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def measure_roofs(gpu: bool, gemm_size: int = 4096, copy_mib: int = 512, reps: int = 5) -> dict[str, Any]:
    """Achieved dense GEMM FLOP/s (bf16 on GPUs, float32 on CPUs) and copy bandwidth."""
    import torch

    device = torch.device("cuda") if gpu else torch.device("cpu")
    dtype = torch.bfloat16 if gpu else torch.float32
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    a = torch.randn(gemm_size, gemm_size, device=device, dtype=dtype)
    b = torch.randn(gemm_size, gemm_size, device=device, dtype=dtype)
    gemm_s = _median_seconds(lambda: torch.mm(a, b), sync, reps)
    numel = copy_mib * 2 ** 20 // torch.finfo(dtype).bits * 8
    src, dst = torch.empty(numel, device=device, dtype=dtype), torch.empty(numel, device=device, dtype=dtype)
    copy_s = _median_seconds(lambda: dst.copy_(src), sync, reps)
    moved = 2 * numel * src.element_size()  # a copy reads and writes every byte
    return {"measured_tflops": 2 * gemm_size ** 3 / gemm_s / 1e12, "measured_bandwidth_gbps": moved / copy_s / 1e9,
            "gemm_dtype": str(dtype).replace("torch.", ""), "gemm_size": gemm_size, "copy_mib": copy_mib,
            "device": torch.cuda.get_device_name(0) if gpu else "cpu"}


def run_on_sku(function: Callable[..., Any], accelerator_type: Optional[str], gpus: int,
               address: Optional[str], *args: Any) -> Any:
    """Run `function(*args)` here, or as a Ray task on a node of the SKU when `address` is set."""
    if address is None:
        return function(*args)
    import ray

    from hostsweep.run.cluster import InfeasiblePlan, describe_inventory, live_nodes, node_offers

    ray.init(address=address, ignore_reinit_error=True)
    nodes = live_nodes()
    if not any(node_offers(n, accelerator_type, gpus) for n in nodes):
        raise InfeasiblePlan(f"no node has accelerator_type {accelerator_type} with >= {gpus} GPUs; "
                             f"the cluster has: {describe_inventory(nodes)}")
    options: dict[str, Any] = {"num_gpus": gpus}
    if accelerator_type:
        options["accelerator_type"] = accelerator_type
    return ray.get(ray.remote(function).options(**options).remote(*args))
