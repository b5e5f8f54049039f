"""benchmarks/gpu_check.py without a GPU: SKU detection, its datasheet against conf/sku, and
the trace checks on synthesized torch-profiler traces of an eager and a graph-replayed loop."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gpu_check = load_gpu_check()


@pytest.mark.parametrize("name,sku", [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", "h100"), ("NVIDIA H200", "h200"),
    ("NVIDIA A100-SXM4-80GB", None), ("NVIDIA GH200 480GB", None),
])
def test_sku_detection_from_the_device_name(name, sku):
    assert gpu_check.detect_sku(name) == sku


def test_the_datasheet_is_the_shipped_skus():
    for sku, sheet in gpu_check.DATASHEET.items():
        shipped = yaml.safe_load((REPO / "conf" / "sku" / f"{sku}.yaml").read_text())
        assert {k: float(shipped[k]) for k in sheet} == sheet


def kernel(ts, dur=10.0):
    return {"ph": "X", "cat": "kernel", "name": "gemm", "ts": ts, "dur": dur, "pid": 0, "tid": 7}


def api(name, ts):
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": 3.0, "pid": 1, "tid": 1}


def loop_trace(steps, kernels, graph, gap_us):
    """`steps` steps of `kernels` 10 µs kernels; eager launches each, graph launches once."""
    events, clock = [], 0.0
    for _ in range(steps):
        if graph:
            events.append(api("cudaGraphLaunch", clock))
        for _ in range(kernels):
            if not graph:
                events.append(api("cudaLaunchKernel", clock))
            events.append(kernel(clock + 1.0))
            clock += 10.0 + gap_us
    return {"traceEvents": events}


def split(graph, T=33, kernels=24, gap_us=15.0, event_ms=None):
    totals = gpu_check.totals
    short, long = totals(loop_trace(1, kernels, graph, gap_us)), totals(loop_trace(T, kernels, graph, gap_us))
    return gpu_check.loop_split(short, long, T, event_ms if event_ms is not None else kernels * (10 + gap_us) / 1e3)


def test_synthesized_eager_and_graph_loops_pass_every_trace_check():
    eager, graph = split(graph=False), split(graph=True, gap_us=1.0)
    assert (eager.kernels_per_step, eager.launches_per_step) == (24, 24)
    assert (graph.kernels_per_step, graph.launches_per_step) == (24, 1)
    assert eager.kernel_ms == pytest.approx(0.24) and eager.kernel_union_ms == pytest.approx(0.24)
    failed = [name for name, ok, _ in gpu_check.trace_checks(eager, graph) if not ok]
    assert failed == []


def test_a_graph_loop_that_launches_every_kernel_fails_its_check():
    eager, graph = split(graph=False), split(graph=False, gap_us=1.0)
    failed = [name for name, ok, _ in gpu_check.trace_checks(eager, graph) if not ok]
    assert failed == ["graph: one launch per step"]


def test_kernel_time_above_the_event_time_is_caught():
    eager, graph = split(graph=False, event_ms=0.1), split(graph=True, gap_us=1.0, event_ms=0.05)
    failed = {name for name, ok, _ in gpu_check.trace_checks(eager, graph) if not ok}
    assert failed == {"kernel sum fits in event time (eager)", "kernel sum fits in event time (graph)"}


def test_roofs_are_judged_against_the_datasheet():
    ok = gpu_check.roof_checks("h100", {"peak_bf16_tflops": 700.0, "mem_bandwidth_gbps": 2900.0})
    assert all(passed for _, passed, _ in ok)
    wrong_sku = gpu_check.roof_checks("h100", {"peak_bf16_tflops": 700.0, "mem_bandwidth_gbps": 4500.0})
    assert [passed for _, passed, _ in wrong_sku] == [True, False]


def test_the_script_needs_only_torch_and_the_stdlib_trace_parser(tmp_path):
    for name in ("vllm", "ray", "mlflow", "hydra", "omegaconf", "numpy", "pandas"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('{name} is not on a bare GPU box')\n")
    code = (f"import importlib.util; s = importlib.util.spec_from_file_location('g', {str(SCRIPT)!r}); "
            "m = importlib.util.module_from_spec(s); import sys; sys.modules['g'] = m; s.loader.exec_module(m); "
            "print(m.detect_sku('NVIDIA H200'))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0 and proc.stdout.strip() == "h200", proc.stderr[-2000:]


def test_host_phases_of_synthesized_cuda_loops_pass_and_a_graph_that_dispatches_fails():
    from hostsweep.measure.phases import phase_split, phase_totals

    def trace(steps: int, dispatch_us: float) -> dict:
        events, clock = [], 0.0
        for _ in range(steps):
            events += [
                {"ph": "X", "cat": "user_annotation", "name": "gpu_model_runner: forward", "pid": 1, "tid": 1,
                 "ts": clock, "dur": dispatch_us},
                {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": clock + 5, "dur": 300},
                {"ph": "X", "cat": "user_annotation", "name": "gpu_model_runner: sample", "pid": 1, "tid": 1,
                 "ts": clock + dispatch_us, "dur": 310 - dispatch_us},
            ]
            clock += 400
        return {"traceEvents": events}

    def split(dispatch_us: float):
        return phase_split(phase_totals(trace(1, dispatch_us)), phase_totals(trace(9, dispatch_us)), 9, 0.0)

    eager, graph = split(200.0), split(10.0)
    assert eager.host_ms["forward_dispatch"] == pytest.approx(0.2)
    assert all(ok for _, ok, _ in gpu_check.phase_checks(eager, graph))
    assert [ok for _, ok, _ in gpu_check.phase_checks(eager, eager)] == [True, True, False]


def test_the_canarys_gpu_kernel_is_judged_on_its_time_its_spread_and_its_rate():
    # 8 products of 2048^3 x 2 flop: 137 GFLOP, so 0.25 ms is 550 TFLOP/s (56 % of an H100's roof)
    steady = [0.25 * (1 + 0.002 * (k % 5)) for k in range(50)]
    assert all(ok for _, ok, _ in gpu_check.canary_checks("h100", steady))
    jittery = [0.25 if k % 2 else 0.40 for k in range(50)]  # a shared or clock-capped device
    assert [ok for _, ok, _ in gpu_check.canary_checks("h100", jittery)] == [True, False, True]
    too_slow = [1.5] * 50  # 9 % of the roof and over a millisecond
    assert [ok for _, ok, _ in gpu_check.canary_checks("h100", too_slow)] == [False, True, False]
    assert len(gpu_check.canary_checks(None, steady)) == 2  # an unknown device has no roof to read
