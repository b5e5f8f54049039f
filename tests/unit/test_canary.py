"""The speed canary's parts: the host workload always, the GPU kernel only where the worker
sees a CUDA device, timed with CUDA events and recorded apart. The CUDA path runs here on a
hand-written fake torch whose events count the kernels launched between them."""
from __future__ import annotations

import sys
import types

import pandas as pd
import pytest

from hostsweep.run.canary import GPU_MATMUL_REPEATS, GPU_MATMUL_SIZE, Canary

KERNEL_MS = 0.05  # what one fake GPU product "takes"


def fake_torch(cuda_available: bool = True, driver_error: bool = False) -> types.SimpleNamespace:
    launched = {"gpu": 0, "cpu": 0}
    allocated = []

    class Tensor:
        def __init__(self, device: str) -> None:
            self.device = device

    def ones(shape, dtype=None, device="cpu"):
        allocated.append((tuple(shape), dtype, device))
        return Tensor(device)

    def mm(a, b):
        assert a.device == b.device
        launched["gpu" if a.device == "cuda" else "cpu"] += 1

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing
            self.at = None

        def record(self) -> None:
            self.at = launched["gpu"]

        def synchronize(self) -> None:
            assert self.at is not None

        def elapsed_time(self, end: "Event") -> float:
            return (end.at - self.at) * KERNEL_MS

    def is_available() -> bool:
        if driver_error:
            raise RuntimeError("no driver")
        return cuda_available

    cuda = types.SimpleNamespace(is_available=is_available, device_count=lambda: 1, Event=Event)
    return types.SimpleNamespace(ones=ones, mm=mm, cuda=cuda, float16="float16", launched=launched,
                                 allocated=allocated)


def test_a_cuda_worker_times_the_fixed_gpu_kernel_apart_from_the_host_canary(monkeypatch):
    torch = fake_torch()
    monkeypatch.setitem(sys.modules, "torch", torch)
    canary = Canary()
    assert canary.parts == "python+torch+cuda"
    assert torch.launched["gpu"] == 0 and not [a for a in torch.allocated if a[2] == "cuda"]  # nothing before a pair
    assert canary.time_gpu_ms() == pytest.approx(GPU_MATMUL_REPEATS * KERNEL_MS)
    gpu_tensors = [a for a in torch.allocated if a[2] == "cuda"]
    assert gpu_tensors == [((GPU_MATMUL_SIZE, GPU_MATMUL_SIZE), "float16", "cuda")] * 2
    assert torch.launched["gpu"] == 2 * GPU_MATMUL_REPEATS  # the first timing, which allocated, is not returned
    canary.time_gpu_ms()
    assert len([a for a in torch.allocated if a[2] == "cuda"]) == 2  # allocated once
    assert canary.time_ms() > 0


@pytest.mark.parametrize("torch", [fake_torch(cuda_available=False), fake_torch(driver_error=True), None],
                         ids=["cpu-build", "driver-error", "no-torch"])
def test_without_a_cuda_device_there_is_no_gpu_kernel(monkeypatch, torch):
    monkeypatch.setitem(sys.modules, "torch", torch)
    canary = Canary()
    assert canary.time_gpu_ms() is None
    assert canary.parts == ("python" if torch is None else "python+torch")


def test_the_gpu_kernel_is_recorded_per_pair_per_cell_and_per_sku(tmp_path):
    from hostsweep.measure.results import CellResult, cell_metrics
    from hostsweep.record.artifacts import _timing_rows
    from hostsweep.record.journal import decode_timings
    from hostsweep.report.fit_report import host_speed_table
    from tests.unit.test_periods import fresh_groups, pairs_of
    import dataclasses

    new_group = fresh_groups()
    group = new_group()
    timings = [tuple(dataclasses.replace(p, canary_ms=1.5, gpu_canary_ms=0.40 + 0.01 * k) for k, p in
                     enumerate(pairs_of([5.0 * (c + 1)] * 12))) for c in range(3)]
    group.take_period(timings)
    assert group.verdicts[0].design.gpu_canary_ms == pytest.approx(0.455)
    result = CellResult(key=group.cells[0].key, params=group.cells[0].params(), status="FINISHED",
                        measurement=group.summaries[0], error=None, stability=group.verdicts[0])
    assert cell_metrics(result)["gpu_canary_ms"] == pytest.approx(0.455, abs=1e-3)
    rows = _timing_rows(timings[0])
    assert [r["gpu_canary_ms"] for r in rows][:2] == pytest.approx([0.40, 0.41])
    assert decode_timings([dataclasses.asdict(p) for p in timings[0]])[3].gpu_canary_ms == pytest.approx(0.43)
    cells = pd.DataFrame({"sku": ["h100", "h100", "cpu"], "canary_ms": [1.5, 1.7, 2.0],
                          "canary_shift_pct": [3.0, 4.0, 5.0], "gpu_canary_ms": [0.40, 0.44, None]})
    table = host_speed_table(cells).set_index("sku")
    assert table.loc["h100", "gpu_kernel_ms_median"] == pytest.approx(0.42)
    assert pd.isna(table.loc["cpu", "gpu_kernel_ms_median"])
    assert "gpu_kernel_ms_median" not in host_speed_table(cells.drop(columns="gpu_canary_ms"))

