"""A simulated engine for orchestration tests and dry runs: it sleeps, it does not infer.

Its wall time is a fixed overhead plus a per-step cost linear in batch and context,
so differencing recovers `step_s` and tests know the answer. Everything it produces
is tagged engine=fake; it is never the default.
"""
from __future__ import annotations

import time
from pathlib import Path

from hostsweep.grid import EngineSpec
from hostsweep.provenance import cpu_model_name


class FakeEngine:
    def __init__(self, spec: EngineSpec, workdir: Path) -> None:
        self.spec = spec
        self.overhead_s = 0.002
        self.step_s = 0.0005

    def step_seconds(self, batch: int, ctx: int) -> float:
        return self.step_s * (1.0 + 0.1 * (batch - 1)) * (1.0 + ctx / 4096)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[int]:
        step = self.step_seconds(len(prompts), len(prompts[0]))
        time.sleep(self.overhead_s + step * max_tokens)
        return [max_tokens] * len(prompts)

    def vocab_size(self) -> int:
        return 1000

    def describe(self) -> dict[str, str]:
        return {"vllm_version": "fake", "torch_version": "fake", "device_name": cpu_model_name()}

    def close(self) -> None:
        pass
