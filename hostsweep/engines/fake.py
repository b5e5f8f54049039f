"""A simulated engine for orchestration tests and dry runs: it sleeps, it does not infer.

Its wall time is a fixed overhead plus a per-step cost linear in batch and context,
and its "profiler" writes synthetic chrome traces in which a known share of every
step (`device_share`) is compute ops, so differencing and the split have known
answers. Everything it produces is tagged engine=fake; it is never the default.
"""
from __future__ import annotations

import gzip
import json
import time
from pathlib import Path
from typing import Optional

from hostsweep.config.grid import EngineSpec
from hostsweep.config.machine import cpu_model_name


class FakeEngine:
    overhead_s = 0.002
    step_s = 0.0005
    device_share = 0.4
    prefill_device_us = 300.0

    def __init__(self, spec: EngineSpec, workdir: Path) -> None:
        self.spec = spec
        self.trace_dir = workdir / "traces"
        self._profiling: Optional[str] = None
        self._recorded: list[tuple[int, int, int]] = []

    def step_seconds(self, batch: int, ctx: int) -> float:
        return self.step_s * (1.0 + 0.1 * (batch - 1)) * (1.0 + ctx / 4096)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[int]:
        step = self.step_seconds(len(prompts), len(prompts[0]))
        time.sleep(self.overhead_s + step * max_tokens)
        if self._profiling is not None:
            self._recorded.append((max_tokens, len(prompts), len(prompts[0])))
        return [max_tokens] * len(prompts)

    def start_profile(self, prefix: str) -> None:
        self._profiling, self._recorded = prefix, []

    def stop_profile(self, prefix: str) -> list[Path]:
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        paths = []
        for rank in range(self.spec.tp):
            path = self.trace_dir / f"{prefix}_rank{rank}.0.pt.trace.json.gz"
            with gzip.open(path, "wt") as handle:
                json.dump({"traceEvents": self.synthetic_events()}, handle)
            paths.append(path)
        self._profiling = None
        return paths

    def synthetic_events(self) -> list[dict[str, object]]:
        """A prefill op, then per step: a compute op enclosing a nested one, and a view."""
        events: list[dict[str, object]] = []
        clock = 0.0

        def op(name: str, start: float, dur: float) -> None:
            events.append({"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 1,
                           "ts": start, "dur": dur})

        for tokens, batch, ctx in self._recorded:
            op("aten::addmm", clock, self.prefill_device_us)
            clock += self.prefill_device_us + 50.0
            device_us = self.step_seconds(batch, ctx) * self.device_share * 1e6
            for _ in range(tokens):
                op("aten::linear", clock, device_us)
                op("aten::addmm", clock + 1.0, device_us - 2.0)  # nested: counted once
                op("aten::view", clock + device_us + 5.0, 3.0)  # metadata: not compute
                clock += self.step_seconds(batch, ctx) * 1e6
        return events

    def vocab_size(self) -> int:
        return 1000

    def describe(self) -> dict[str, str]:
        return {"vllm_version": "fake", "torch_version": "fake", "device_name": cpu_model_name()}

    def close(self) -> None:
        pass
