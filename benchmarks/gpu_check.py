"""What can be checked on a bare H100/H200 machine with only torch (no vLLM, Ray, MLflow, Hydra):

  1. SKU detection: the device name and compute capability map to a shipped SKU (h100, h200);
  2. roofs: achieved bf16 GEMM FLOP/s and copy bandwidth against that SKU's datasheet;
  3. the CUDA path of hostsweep's trace parser (hostsweep/measure/traces.py, stdlib only) on
     real torch-profiler traces of a small decode loop (batch 1, a few layers), eager and
     replayed as one CUDA graph per step: kernel time per step against CUDA-event time per
     step, and kernels and host launches per step, differenced exactly like a cell's split
     ((T-step trace - 1-step trace) / (T - 1));
  4. the CUDA path of the host phases (hostsweep/measure/phases.py) on the same loops with
     vLLM's scope names around each step's forward and its wait for the output (`sample`):
     phases found, nothing subtracted from a host scope on a GPU, and the CUDA graph's
     forward dispatch below eager's;
  5. the speed canary's GPU kernel (hostsweep/run/canary.py, stdlib only until torch is
     loaded) timed as a worker times it beside every pair: under a millisecond, its
     timings within a few percent of each other, and its FLOP rate a sane share of the
     SKU's datasheet roof.

    python benchmarks/gpu_check.py [--steps 64] [--out gpu_check.json]

It prints one line per check (PASS/FAIL and the numbers) and exits 1 if any failed. Run it
from a checkout (it puts the checkout on sys.path for hostsweep.measure.traces). The parsing
and checking functions are pure and tested on synthesized traces (tests/unit/test_gpu_check.py).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hostsweep.measure.phases import PhaseSplit, phase_split, phase_totals  # noqa: E402  (stdlib only)
from hostsweep.measure.traces import TraceTotals, load_trace, totals  # noqa: E402  (stdlib only)
from hostsweep.run.canary import GPU_MATMUL_REPEATS, GPU_MATMUL_SIZE  # noqa: E402  (stdlib only)

# Datasheet roofs, the values of conf/sku/<name>.yaml (a unit test keeps them equal):
# dense bf16 TFLOP/s and memory bandwidth GB/s, and the compute capability.
DATASHEET = {
    "h100": {"peak_bf16_tflops": 989.0, "mem_bandwidth_gbps": 3350.0, "compute_capability": 9.0},
    "h200": {"peak_bf16_tflops": 989.0, "mem_bandwidth_gbps": 4800.0, "compute_capability": 9.0},
}
# An achieved roof outside this fraction of the datasheet means a wrong SKU, a throttled or
# shared device, or a broken benchmark (dense bf16 GEMMs reach ~60-80 % on Hopper).
ROOF_FRACTION = (0.3, 1.05)


def detect_sku(device_name: str) -> Optional[str]:
    """'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA H200' -> 'h200'; None for anything else
    (a GH200's GPU has other memory and bandwidth than either)."""
    match = re.search(r"\bh(100|200)\b", device_name.lower())
    return f"h{match.group(1)}" if match else None


@dataclass(frozen=True)
class LoopSplit:
    """One decode loop's per-step figures from a profiled 1-step / T-step pair."""

    kernel_source: str
    kernel_ms: float  # kernel time per step (sum)
    kernel_union_ms: float
    kernels_per_step: float
    launches_per_step: float
    event_ms: float  # CUDA-event time per step, unprofiled


def loop_split(short: TraceTotals, long: TraceTotals, T: int, event_ms: float) -> LoopSplit:
    """Difference two traces the way a cell's split does."""
    def per_step(a: float, b: float) -> float:
        return (b - a) / (T - 1)

    return LoopSplit(long.kernel_source, per_step(short.kernel_sum_us, long.kernel_sum_us) / 1e3,
                     per_step(short.kernel_union_us, long.kernel_union_us) / 1e3,
                     per_step(short.kernel_count, long.kernel_count),
                     per_step(short.launch_count, long.launch_count), event_ms)


def trace_checks(eager: LoopSplit, graph: LoopSplit) -> list[tuple[str, bool, str]]:
    """What a correct CUDA trace path must show on the two loops."""
    def near(a: float, b: float, rel: float) -> bool:
        return abs(a - b) <= rel * max(abs(b), 1e-9)

    return [
        ("trace source is cuda", eager.kernel_source == graph.kernel_source == "cuda",
         f"{eager.kernel_source}, {graph.kernel_source}"),
        ("eager: one host launch per kernel", near(eager.launches_per_step, eager.kernels_per_step, 0.1),
         f"{eager.launches_per_step:.1f} launches, {eager.kernels_per_step:.1f} kernels per step"),
        ("graph: one launch per step", graph.launches_per_step <= 1.5,
         f"{graph.launches_per_step:.2f} launches per step"),
        ("graph replays the same kernels", near(graph.kernels_per_step, eager.kernels_per_step, 0.1),
         f"{graph.kernels_per_step:.1f} vs {eager.kernels_per_step:.1f} kernels per step"),
        ("kernel sum fits in event time (eager)", eager.kernel_ms <= eager.event_ms * 1.05,
         f"{eager.kernel_ms:.4f} ms kernels vs {eager.event_ms:.4f} ms event"),
        ("kernel sum fits in event time (graph)", graph.kernel_ms <= graph.event_ms * 1.05,
         f"{graph.kernel_ms:.4f} ms kernels vs {graph.event_ms:.4f} ms event"),
        ("graph step is shorter than eager", graph.event_ms < eager.event_ms,
         f"{graph.event_ms:.4f} vs {eager.event_ms:.4f} ms per step"),
    ]


def phase_checks(eager: PhaseSplit, graph: PhaseSplit) -> list[tuple[str, bool, str]]:
    """What the host phases must show on the two scoped loops (ms per step)."""
    found = {"forward_dispatch", "sample"}
    return [
        ("phases read from the cuda traces", found <= set(eager.host_ms) and found <= set(graph.host_ms),
         f"eager {sorted(eager.host_ms)}, graph {sorted(graph.host_ms)}"),
        ("no device time inside host scopes", eager.forward_compute_ms == graph.forward_compute_ms == 0,
         f"{eager.forward_compute_ms}, {graph.forward_compute_ms}"),
        ("graph removes forward dispatch", graph.host_ms.get("forward_dispatch", 1e9) < eager.host_ms.get("forward_dispatch", 0),
         f"{graph.host_ms.get('forward_dispatch', float('nan')):.4f} vs "
         f"{eager.host_ms.get('forward_dispatch', float('nan')):.4f} ms per step"),
    ]


def canary_checks(sku: Optional[str], timings_ms: list[float]) -> list[tuple[str, bool, str]]:
    """The canary's GPU kernel as a worker would see it: each timing under 1 ms, their
    spread (IQR over the median) under 5 %, and, on a known SKU, a FLOP rate between 20 %
    and 100 % of its dense bf16 roof (fp16 runs at the same rate on H100 and H200)."""
    ordered = sorted(timings_ms)
    n = len(ordered)
    median = ordered[n // 2]
    spread = (ordered[(3 * n) // 4] - ordered[n // 4]) / median * 100.0 if median > 0 else float("inf")
    checks = [("canary GPU kernel under 1 ms", 0.0 < max(ordered) < 1.0,
               f"median {median:.3f} ms, max {max(ordered):.3f} ms over {n} timings"),
              ("canary GPU kernel steady", spread < 5.0, f"IQR {spread:.1f} % of the median")]
    if sku is not None and median > 0:
        tflops = 2 * GPU_MATMUL_SIZE ** 3 * GPU_MATMUL_REPEATS / (median * 1e-3) / 1e12
        share = tflops / DATASHEET[sku]["peak_bf16_tflops"]
        checks.append(("canary GPU kernel rate", 0.2 <= share <= 1.0,
                       f"{tflops:.0f} TFLOP/s = {share:.0%} of the {sku} datasheet"))
    return checks


def canary_timings(times: int = 50) -> list[float]:
    """The worker's canary, made after torch is loaded, timed as beside every pair."""
    from hostsweep.run.canary import Canary

    canary = Canary()
    return [float(canary.time_gpu_ms()) for _ in range(times)]  # type: ignore[arg-type]


def roof_checks(sku: str, measured: dict[str, float]) -> list[tuple[str, bool, str]]:
    sheet = DATASHEET[sku]
    checks = []
    for what, sheet_key, unit in (("gemm", "peak_bf16_tflops", "TFLOP/s"), ("copy", "mem_bandwidth_gbps", "GB/s")):
        fraction = measured[sheet_key] / sheet[sheet_key]
        ok = ROOF_FRACTION[0] <= fraction <= ROOF_FRACTION[1]
        checks.append((f"{what} roof vs datasheet", ok,
                       f"{measured[sheet_key]:.0f} of {sheet[sheet_key]:.0f} {unit} ({fraction:.0%})"))
    return checks


def event_timed_roofs(torch: Any, size: int = 8192, copy_mib: int = 1024, reps: int = 10) -> dict[str, float]:
    """Dense bf16 GEMM FLOP/s and device copy bandwidth (a copy reads and writes each byte),
    timed with CUDA events, to hold against the datasheet (calibrate/microbench.measure_roofs
    measures the roofs the TP model uses)."""
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    src = torch.empty(copy_mib * 2 ** 20 // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    gemm_s = _event_seconds(torch, lambda: torch.mm(a, b), reps)
    copy_s = _event_seconds(torch, lambda: dst.copy_(src), reps)
    return {"peak_bf16_tflops": 2 * size ** 3 / gemm_s / 1e12,
            "mem_bandwidth_gbps": 2 * src.numel() * src.element_size() / copy_s / 1e9}


def _event_seconds(torch: Any, action: Callable[[], Any], reps: int) -> float:
    """Median CUDA-event time of one action, after a warm-up."""
    action()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        action()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def decode_step(torch: Any, layers: int = 8, hidden: int = 2048) -> Callable[[], Any]:
    """One batch-1 'decode step': per layer a norm, a QKV-sized and an output projection and a
    gated MLP, on a static input (so it can be captured as a CUDA graph)."""
    nn = torch.nn
    blocks = nn.ModuleList(nn.ModuleDict({
        "norm": nn.LayerNorm(hidden), "qkv": nn.Linear(hidden, 3 * hidden, bias=False),
        "out": nn.Linear(hidden, hidden, bias=False), "up": nn.Linear(hidden, 8 * hidden, bias=False),
        "down": nn.Linear(4 * hidden, hidden, bias=False)}) for _ in range(layers)).cuda().to(torch.bfloat16)
    x = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)

    @torch.no_grad()
    def step() -> Any:
        h = x
        for blk in blocks:
            q, _, _ = blk["qkv"](blk["norm"](h)).chunk(3, dim=-1)
            h = h + blk["out"](q)
            gate, up = blk["up"](h).chunk(2, dim=-1)
            h = h + blk["down"](torch.nn.functional.silu(gate) * up)
        return h

    return step


def graphed(torch: Any, step: Callable[[], Any]) -> Callable[[], Any]:
    """The same step captured once as a CUDA graph and replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def profile_loop(torch: Any, step: Callable[[], Any], steps: int, folder: Path, name: str) -> TraceTotals:
    """Parse the chrome trace of `steps` steps through hostsweep's trace parser."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    path = folder / f"{name}_{steps}.json"
    prof.export_chrome_trace(str(path))
    return totals(load_trace(path))


def run_loop(torch: Any, step: Callable[[], Any], T: int, folder: Path, name: str) -> LoopSplit:
    for _ in range(5):
        step()
    event_ms = _event_seconds(torch, lambda: [step() for _ in range(T)], 5) * 1e3 / T
    return loop_split(profile_loop(torch, step, 1, folder, name), profile_loop(torch, step, T, folder, name),
                      T, event_ms)


def scoped(torch: Any, step: Callable[[], Any]) -> Callable[[], Any]:
    """The step inside vLLM's scope names: its forward, then the wait for its output."""
    from torch.profiler import record_function

    def run() -> None:
        with record_function("gpu_model_runner: forward"):
            step()
        with record_function("gpu_model_runner: sample"):
            torch.cuda.current_stream().synchronize()

    return run


def phase_loop(torch: Any, step: Callable[[], Any], T: int, folder: Path, name: str) -> PhaseSplit:
    """Host phases per step of the scoped loop, differenced like a cell's."""
    run = scoped(torch, step)
    for _ in range(3):
        run()
    traces = []
    for steps in (1, T):
        profile_loop(torch, run, steps, folder, f"phases_{name}")
        traces.append(phase_totals(load_trace(folder / f"phases_{name}_{steps}.json")))
    return phase_split(traces[0], traces[1], T, host_ms=0.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=64, help="T: decode steps in the long profiled loop")
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"), help="where to write the results")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; run it on an H100 or H200 machine")
        return 2
    name = torch.cuda.get_device_name(0)
    capability = float("%d.%d" % torch.cuda.get_device_capability(0))
    sku = detect_sku(name)
    checks = [("sku detected", sku is not None, f"{name!r} (compute capability {capability}) -> {sku}")]
    report: dict[str, Any] = {"device_name": name, "compute_capability": capability, "sku": sku,
                              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    if sku is not None:
        checks.append(("compute capability", capability == DATASHEET[sku]["compute_capability"], f"{capability}"))
        report["roofs"] = event_timed_roofs(torch)
        checks += roof_checks(sku, report["roofs"])
    with tempfile.TemporaryDirectory() as folder:
        step = decode_step(torch)
        eager = run_loop(torch, step, args.steps, Path(folder), "eager")
        replay = graphed(torch, step)
        graph = run_loop(torch, replay, args.steps, Path(folder), "graph")
        phases = (phase_loop(torch, step, args.steps, Path(folder), "eager"),
                  phase_loop(torch, replay, args.steps, Path(folder), "graph"))
    report.update(eager=asdict(eager), graph=asdict(graph),
                  phases={"eager": phases[0].host_ms, "graph": phases[1].host_ms})
    checks += trace_checks(eager, graph)
    checks += phase_checks(*phases)
    report["canary_gpu_ms"] = canary_timings()
    checks += canary_checks(sku, report["canary_gpu_ms"])
    report["checks"] = [{"check": c, "ok": ok, "detail": d} for c, ok, d in checks]
    for check, ok, detail in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {check}: {detail}")
    args.out.write_text(json.dumps(report, indent=2))
    print(f"results: {args.out}")
    return 0 if all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
