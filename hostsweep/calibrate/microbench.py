"""The roofs microbenchmark for the TP model (the SKU's achieved GEMM FLOP/s and copy
bandwidth; torch), and `run_on_sku`, which runs any calibration benchmark here or as a
Ray task pinned to the SKU it describes; here, one that loads vLLM runs in a process of its
own (`apart`).

The all-reduce sweep lives in allreduce_bench.py; H(N) from measured cells in
model/host_calibration.py.
"""
from __future__ import annotations

import multiprocessing
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


def _engine_gemm(a: Any, b: Any, gpu: bool) -> tuple[Callable[[], Any], str]:
    """The GEMM as the engine's linear layers run it, and its name. On the CPU build vLLM's
    unquantized linear layers call vLLM's own oneDNN matmul (`_C::onednn_mm` on a handle
    built from the transposed weight; vllm model_executor/layers/utils.py
    dispatch_cpu_unquantized_gemm), not torch.mm: that op is timed here where vLLM has it.
    (On AMX CPUs vLLM sends small projections to its sgl-kernel GEMM instead; a roof is a
    large GEMM, which stays on oneDNN there too.) On GPUs the unquantized linear is
    torch's matmul (cuBLAS)."""
    import torch

    if not gpu:
        try:
            from vllm import _custom_ops as ops

            if ops._supports_onednn:
                handle = ops.create_onednn_mm(b.t().contiguous().t(), 32)  # [K, N] over an [N, K] weight
                return (lambda: ops.onednn_mm(handle, a, None)), "vllm _C::onednn_mm (oneDNN, the engine's linear)"
        except (ImportError, RuntimeError, AttributeError):
            pass  # no vLLM CPU build here: torch's matmul, and the roof says so
    return (lambda: torch.mm(a, b)), "torch.mm" + (" (cuBLAS)" if gpu else "")


def roof_dtype(gpu: bool, dtype: Optional[str] = None) -> str:
    """The dtype the roofs run in: the engines' (their cells' recorded `dtype`, passed in),
    else what `engine.dtype=auto` resolves to on this machine (config/machine.default_dtype,
    the rule config/resolve.py applies before the engine starts)."""
    if dtype and dtype != "auto":
        return dtype
    from hostsweep.config.machine import cpu_flags, default_dtype

    return default_dtype(gpu, cpu_flags())


def measure_roofs(gpu: bool, gemm_size: int = 4096, copy_mib: int = 512, reps: int = 5,
                  dtype: Optional[str] = None) -> dict[str, Any]:
    """Achieved dense GEMM FLOP/s and copy bandwidth in the engine's dtype (roof_dtype), the
    GEMM through the engine's matmul path (_engine_gemm)."""
    import torch

    device = torch.device("cuda") if gpu else torch.device("cpu")
    dtype_name = roof_dtype(gpu, dtype)
    torch_dtype = getattr(torch, dtype_name)
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    a = torch.randn(gemm_size, gemm_size, device=device, dtype=torch_dtype)
    b = torch.randn(gemm_size, gemm_size, device=device, dtype=torch_dtype)
    gemm, matmul = _engine_gemm(a, b, gpu)
    gemm_s = _median_seconds(gemm, sync, reps)
    numel = copy_mib * 2 ** 20 // torch.tensor([], dtype=torch_dtype).element_size()
    src, dst = (torch.empty(numel, device=device, dtype=torch_dtype) for _ in range(2))
    copy_s = _median_seconds(lambda: dst.copy_(src), sync, reps)
    moved = 2 * numel * src.element_size()  # a copy reads and writes every byte
    return {"measured_tflops": 2 * gemm_size ** 3 / gemm_s / 1e12, "measured_bandwidth_gbps": moved / copy_s / 1e9,
            "dtype": dtype_name, "gemm_dtype": dtype_name, "matmul": matmul, "gemm_size": gemm_size,
            "copy_mib": copy_mib, "device": torch.cuda.get_device_name(0) if gpu else "cpu"}


def _call_and_send(send: Any, function: Callable[..., Any], args: tuple) -> None:
    try:
        outcome = (True, function(*args))
    except BaseException as exc:  # noqa: BLE001 (raised again in the caller's process)
        outcome = (False, exc)
    send.send(outcome)
    send.close()


def run_apart(function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)` in a spawned process of its own, its result or its exception handed
    back. For a benchmark that loads vLLM's kernels (its oneDNN matmul, its TP communicator):
    loaded into the driver they stay until it exits, and the exit then prints nanobind's leak
    report (hundreds of lines) after the report's last line. Not a pool: a pool's workers are
    daemons, and the engine-path all-reduce starts rank processes of its own."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_call_and_send, args=(send, function, args), name=f"hostsweep-{function.__name__}")
    child.start()
    send.close()
    try:
        ok, value = receive.recv()
    except EOFError:
        child.join()
        raise RuntimeError(f"{function.__name__} ended its process without a result (exit {child.exitcode})") from None
    finally:
        receive.close()
    child.join()
    if not ok:
        raise value
    return value


def run_on_sku(function: Callable[..., Any], accelerator_type: Optional[str], gpus: int,
               address: Optional[str], *args: Any, apart: bool = False) -> Any:
    """Run `function(*args)` here (in a process of its own with `apart`: run_apart), or as a
    Ray task on a node of the SKU when `address` is set."""
    if address is None:
        return run_apart(function, *args) if apart else function(*args)
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
