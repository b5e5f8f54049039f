"""A simulated engine for orchestration tests and dry runs: it sleeps, it does not infer.

Its wall time is a fixed overhead plus a per-step cost linear in batch and context,
and its "profiler" writes synthetic chrome traces in which a known share of every
step (`device_share`) is compute ops, so differencing and the split have known
answers. Everything it produces is tagged engine=fake; it is never the default.
HOSTSWEEP_FAKE_TIME_SCALE (environment, inherited by Ray workers) scales every sleep:
0 answers instantly, for benchmarks of the harness itself (benchmarks/sweep_scale.py).
HOSTSWEEP_FAKE_SLOWDOWN plants a regression with a known answer (for stage=diff's tests):
"b2-ctx32=1.5,b1-ctx16=1.2" makes those cells' steps 1.5 and 1.2 times as long ("*": all).

Its "model" writes the next token of a 16-token ring (token c is followed by the next one
in its block of 16), so its own text repeats every 16 tokens and random prompts do not.
With `speculative_config` in its engine arguments it runs a real n-gram proposer over
that text: each engine step (cycle) verifies up to k drafted tokens, costs
`verify_cost * k` more, and emits the accepted ones plus one.
"""
from __future__ import annotations

import gzip
import json
import os
import time
from pathlib import Path
from typing import Optional

from hostsweep.config.grid import EngineSpec
from hostsweep.config.machine import cpu_model_name


RING = 16


def next_token(token: int) -> int:
    """The fake model: the next token in the ring of 16 that `token` belongs to."""
    return token - token % RING + (token + 1) % RING


def ngram_draft(tokens: list[int], k: int, n_max: int = 4, n_min: int = 2) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the text's last n tokens."""
    for n in range(n_max, n_min - 1, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + k]
    return []


def decode(prompt: list[int], max_tokens: int, k: int) -> tuple[list[int], int, dict[str, int]]:
    """The fake model's greedy text, its engine steps (prefill included) and, with k drafted
    tokens per cycle, the per-request counts vLLM reports (RequestSpecDecodeMetrics)."""
    text = list(prompt) + [next_token(prompt[-1])]  # the prefill emits the first token
    steps, stats = 1, {"num_spec_steps": 0, "num_draft_tokens": 0, "num_accepted_draft_tokens": 0,
                       "num_spec_tokens": k}
    while len(text) - len(prompt) < max_tokens:
        draft = ngram_draft(text, k) if k else []
        accepted = 0
        for token in draft:
            if token != next_token(text[-1]):
                break
            text.append(token)
            accepted += 1
        text.append(next_token(text[-1]))  # the verifier's own token
        steps += 1
        if draft:
            stats["num_spec_steps"] += 1
            stats["num_draft_tokens"] += len(draft)
            stats["num_accepted_draft_tokens"] += accepted
    return text[len(prompt):len(prompt) + max_tokens], steps, stats


def planted_slowdowns(text: str) -> dict[str, float]:
    """HOSTSWEEP_FAKE_SLOWDOWN's value as {"b2-ctx32": 1.5, "*": 1.1}."""
    pairs = (item.split("=", 1) for item in text.replace(" ", "").split(",") if item)
    return {cell: float(factor) for cell, factor in pairs}


class FakeEngine:
    overhead_s = 0.002
    step_s = 0.0005
    device_share = 0.4
    prefill_device_us = 300.0
    verify_cost = 0.25  # a cycle verifying k drafts costs (1 + verify_cost * k) steps

    def __init__(self, spec: EngineSpec, workdir: Path) -> None:
        self.spec = spec
        self.trace_dir = workdir / "traces"
        self._profiling: Optional[str] = None
        self._recorded: list[tuple[int, int, int, float]] = []
        speculative = spec.engine_args.get("speculative_config") or {}
        self.k = int(speculative.get("num_speculative_tokens", 0))
        self._last: list[tuple[list[int], dict[str, int]]] = []
        self.time_scale = float(os.environ.get("HOSTSWEEP_FAKE_TIME_SCALE", "1"))
        self.slowdown = planted_slowdowns(os.environ.get("HOSTSWEEP_FAKE_SLOWDOWN", ""))

    def step_seconds(self, batch: int, ctx: int) -> float:
        planted = self.slowdown.get(f"b{batch}-ctx{ctx}", self.slowdown.get("*", 1.0))
        return self.step_s * (1.0 + 0.1 * (batch - 1)) * (1.0 + ctx / 4096) * planted

    def cycle_seconds(self, batch: int, ctx: int) -> float:
        return self.step_seconds(batch, ctx) * (1.0 + self.verify_cost * self.k)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[int]:
        decoded = [decode(p, max_tokens, self.k) for p in prompts]
        steps = max(d[1] for d in decoded)  # a batch steps until its longest request is done
        cycle = self.cycle_seconds(len(prompts), len(prompts[0]))
        if self.time_scale > 0:
            time.sleep((self.overhead_s + cycle * steps) * self.time_scale)
        if self._profiling is not None:
            self._recorded.append((steps, len(prompts), len(prompts[0]), cycle))
        self._last = [(text, stats) for text, _, stats in decoded]
        return [len(text) for text, _ in self._last]

    def last_tokens(self) -> list[list[int]]:
        return [text for text, _ in self._last]

    def spec_stats(self) -> Optional[list[dict[str, int]]]:
        return [dict(stats) for _, stats in self._last] if self.k else None

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

        for steps, batch, ctx, cycle_s in self._recorded:
            op("aten::addmm", clock, self.prefill_device_us)
            clock += self.prefill_device_us + 50.0
            device_us = cycle_s * self.device_share * 1e6
            for _ in range(steps):
                op("aten::linear", clock, device_us)
                op("aten::addmm", clock + 1.0, device_us - 2.0)  # nested: counted once
                op("aten::view", clock + device_us + 5.0, 3.0)  # metadata: not compute
                clock += cycle_s * 1e6
        return events

    def vocab_size(self) -> int:
        return 64 * RING

    def describe(self) -> dict[str, str]:
        return {"vllm_version": "fake", "torch_version": "fake", "device_name": cpu_model_name()}

    def close(self) -> None:
        pass
