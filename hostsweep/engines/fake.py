"""A simulated engine for orchestration tests and dry runs: it sleeps, it does not infer.

Its wall time is a fixed overhead plus a per-step cost linear in batch and context,
and its "profiler" writes synthetic chrome traces in which a known share of every
step (`device_share`) is compute ops, so differencing and the split have known
answers. Everything it produces is tagged engine=fake; it is never the default.
HOSTSWEEP_FAKE_TIME_SCALE (environment, inherited by Ray workers) scales every sleep:
0 answers instantly, for benchmarks of the harness itself (benchmarks/sweep_scale.py).
HOSTSWEEP_FAKE_SLOWDOWN plants a regression with a known answer (for stage=diff's tests):
"b2-ctx32=1.5,b1-ctx16=1.2" makes those cells' steps 1.5 and 1.2 times as long ("*": all).
HOSTSWEEP_FAKE_WARMUP plants an engine that warms up with a known curve: "1.2:8" makes the
engine's first long generate's steps 1.2 times as long, the excess falling linearly to none
by its 8th (for the group warm-up's tests).
While its profiler runs, the host part of every step costs `profiler_host_cost` times as
much, in the sleep and in the traces alike, and the compute ops do not: a real profiler
records every host op, so a profiled step is never faster than a timed one (the split's
profiled_faster check would otherwise fire at random on a fake whose profiler is free).

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
    stats = {"num_spec_steps": 0, "num_draft_tokens": 0, "num_accepted_draft_tokens": 0, "num_spec_tokens": k}
    if not k:  # a token a step from the last one: no copy of the prompt (a batch of long ones is most of a fake cell)
        last, out = prompt[-1], []
        for _ in range(max(1, max_tokens)):
            last = next_token(last)
            out.append(last)
        return out[:max_tokens], max(1, max_tokens), stats
    text = list(prompt) + [next_token(prompt[-1])]  # the prefill emits the first token
    steps = 1
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
    starts_processes = False  # it sleeps in the worker's own process
    overhead_s = 0.002
    step_s = 0.0005
    device_share = 0.4
    prefill_device_us = 300.0
    verify_cost = 0.25  # a cycle verifying k drafts costs (1 + verify_cost * k) steps
    # Within the CPU build's measured profiler overhead (profiled / timed step 1.2-1.4):
    # 1.5 on the host's 0.6 of a step makes a profiled step 1.3 times a timed one.
    profiler_host_cost = 1.5
    # The host phases of a cycle, as shares of it (the rest of the worker's time is compute,
    # device_share): the EngineCore's and the worker's, with the worker's busy span and the
    # EngineCore's step inside a cycle. Known answers per step: each phase's share x cycle,
    # other_worker 0.05, engine_worker_ipc 0.05, other_engine_loop 0.1 (all host: 0.6).
    phase_shares = {"schedule": 0.05, "preprocess": 0.1, "forward_dispatch": 0.05, "sample": 0.1,
                    "bookkeep": 0.05, "update_from_output": 0.05}
    # The front-end's output processing per step, beside the cycle: overlapped by the next
    # cycle while it is shorter than one (with the debug delay in it, it may not be).
    frontend_share = 0.08

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
        factor, _, count = os.environ.get("HOSTSWEEP_FAKE_WARMUP", "1:1").partition(":")
        self.warmup_excess, self.warmup_generates, self.long_generates = float(factor) - 1.0, int(count or 1), 0
        phase, _, ms = spec.debug_delay.partition(":")
        self.delay_phase, delay_s = (phase, float(ms) / 1e3) if spec.debug_delay else ("", 0.0)
        in_frontend = self.delay_phase == "frontend_process_outputs"
        self.delay_s, self.frontend_delay_s = (0.0, delay_s) if in_frontend else (delay_s, 0.0)

    def step_seconds(self, batch: int, ctx: int) -> float:
        planted = self.slowdown.get(f"b{batch}-ctx{ctx}", self.slowdown.get("*", 1.0))
        return self.step_s * (1.0 + 0.1 * (batch - 1)) * (1.0 + ctx / 4096) * planted * self.warming()

    def warming(self) -> float:
        """The planted warm-up curve's factor for the current long generate (1: warm)."""
        left = max(0.0, 1.0 - self.long_generates / self.warmup_generates)
        return 1.0 + self.warmup_excess * left

    def cycle_seconds(self, batch: int, ctx: int) -> float:
        """One engine step, the debug delay (debug.delay_ms) included."""
        return self.step_seconds(batch, ctx) * (1.0 + self.verify_cost * self.k) + self.delay_s

    def device_seconds(self, cycle_s: float) -> float:
        """The compute ops' share of an unprofiled cycle (the debug delay is host time)."""
        return (cycle_s - self.delay_s) * self.device_share

    def profiled_cycle_seconds(self, cycle_s: float) -> float:
        """A cycle under the profiler: its host ops profiler_host_cost times as long. The
        debug delay is a wait, not ops the profiler records: it is not stretched."""
        host_ops = max(0.0, cycle_s - self.delay_s - self.device_seconds(cycle_s))  # none where a test plants device > step
        return cycle_s + host_ops * (self.profiler_host_cost - 1.0)

    def frontend_seconds(self, cycle_s: float) -> float:
        """The front-end's work on one step's outputs (the debug delay included when it is there)."""
        return self.frontend_share * (cycle_s - self.delay_s) + self.frontend_delay_s

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[int]:
        decoded = [decode(p, max_tokens, self.k) for p in prompts]
        steps = max(d[1] for d in decoded)  # a batch steps until its longest request is done
        cycle = self.cycle_seconds(len(prompts), len(prompts[0]))
        if self._profiling is not None:
            self._recorded.append((steps, len(prompts), len(prompts[0]), cycle))
        # The front-end is not profiled: its work stays, the engine's cycle may stretch.
        front, cycle = self.frontend_seconds(cycle), self.engine_cycle_seconds(cycle)
        # A front-end slower than the engine falls behind by the excess every step.
        behind = max(0.0, front - cycle) * (steps - 1)
        if self.time_scale > 0:
            time.sleep((self.overhead_s + cycle * steps + behind) * self.time_scale)
        self._last = [(text, stats) for text, _, stats in decoded]
        self.long_generates += max_tokens > 1
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
        worker, core, front = self.synthetic_events()
        for rank in range(self.spec.tp):
            path = self.trace_dir / f"{prefix}_rank{rank}.0.pt.trace.json.gz"
            with gzip.open(path, "wt") as handle:
                json.dump({"traceEvents": worker}, handle)
            paths.append(path)
        (self.trace_dir / f"{prefix}_enginecore.json").write_text(json.dumps({"traceEvents": core}))
        (self.trace_dir / f"{prefix}_frontend.json").write_text(json.dumps({"traceEvents": front}))
        self._profiling = None
        return paths

    def engine_core_trace(self, prefix: str) -> Optional[Path]:
        """The EngineCore's step intervals of the last profiled generate (as vllm_plugin writes them)."""
        path = self.trace_dir / f"{prefix}_enginecore.json"
        return path if path.exists() else None

    def frontend_trace(self, prefix: str) -> Optional[Path]:
        """The front-end's output-processing intervals (as vllm_plugin writes them)."""
        path = self.trace_dir / f"{prefix}_frontend.json"
        return path if path.exists() else None

    def engine_cycle_seconds(self, cycle_s: float) -> float:
        """The cycle as it runs now: stretched while the profiler records."""
        return self.profiled_cycle_seconds(cycle_s) if self._profiling is not None else cycle_s

    def _shares(self, cycle_s: float) -> dict[str, float]:
        """Each host phase of a profiled cycle in us; the delayed phase (debug.) holds the delay."""
        base = (cycle_s - self.delay_s) * self.profiler_host_cost  # the delay is not scaled with the shares
        shares = {name: share * base * 1e6 for name, share in self.phase_shares.items()}
        target = "forward_dispatch" if self.delay_phase == "forward" else self.delay_phase
        if target in shares:
            shares[target] += self.delay_s * 1e6
        return shares

    def synthetic_events(self) -> tuple[list[dict[str, object]], list[dict[str, object]], list[dict[str, object]]]:
        """The worker's trace, the EngineCore's and the front-end's: a prefill op, then per
        cycle the phases in the order vLLM runs them, the forward scope enclosing a compute op
        (with a nested one and a view) of device_share of the cycle; the front-end processes
        each step's outputs once the step is over and it is done with the previous ones."""
        worker: list[dict[str, object]] = []
        core: list[dict[str, object]] = []
        front: list[dict[str, object]] = []
        clock = 0.0

        def op(name: str, start: float, dur: float, cat: str = "cpu_op", into: list = worker,
               tid: object = 1) -> None:
            into.append({"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": start, "dur": dur})

        def scope(name: str, start: float, dur: float, into: list = worker, tid: object = 1) -> float:
            op(name, start, dur, "user_annotation", into, tid)
            return start + dur

        for steps, batch, ctx, cycle_s in self._recorded:
            op("aten::addmm", clock, self.prefill_device_us)
            clock += self.prefill_device_us + 50.0
            # The timed cycle's compute ops, and its host phases as the profiler stretched them.
            device_us, host = self.device_seconds(cycle_s) * 1e6, self.profiler_host_cost
            cycle_us = self.profiled_cycle_seconds(cycle_s) * 1e6
            ph = self._shares(cycle_s)
            # The cycle: [other_engine_loop | schedule | ipc/2 | worker busy | ipc/2 | update]
            base_us = (cycle_s - self.delay_s) * 1e6 * host
            gap_us, half_ipc_us, other_worker_us = 0.1 * base_us, 0.025 * base_us, 0.05 * base_us
            front_us, front_free, front_start = self.frontend_seconds(cycle_s) * 1e6, 0.0, None
            for _ in range(steps):
                step_start = clock + gap_us
                t = scope("hostsweep: schedule", step_start, ph["schedule"], core, "phases") + half_ipc_us
                busy_start = t
                t = scope("gpu_model_runner: preprocess", t, ph["preprocess"])
                forward_end = scope("gpu_model_runner: forward", t, ph["forward_dispatch"] + device_us)
                op("aten::linear", t + 1.0, device_us)
                op("aten::addmm", t + 2.0, device_us - 2.0)  # nested: counted once
                op("aten::view", t + device_us + 1.5, 0.4)  # metadata: not compute
                t = scope("gpu_model_runner: sample", forward_end, ph["sample"])
                t = scope("gpu_model_runner: bookkeep", t, ph["bookkeep"]) + other_worker_us
                scope("hostsweep span: worker_busy", busy_start, t - busy_start)
                t = scope("hostsweep: update_from_output", t + half_ipc_us, ph["update_from_output"], core, "phases")
                scope("hostsweep span: engine_step", step_start, t - step_start, core, "step")
                start = max(t + half_ipc_us, front_free)
                front_start = start if front_start is None else front_start
                front_free = scope("hostsweep: frontend_process_outputs", start, front_us, front, "phases")
                clock += cycle_us
            scope("hostsweep span: engine_loop", clock - steps * cycle_us, steps * cycle_us, core, "loop")
            scope("hostsweep span: frontend_loop", front_start, front_free - front_start, front, "loop")
        return worker, core, front

    def vocab_size(self) -> int:
        return 64 * RING

    def describe(self) -> dict[str, str]:
        return {"vllm_version": "fake", "torch_version": "fake", "device_name": cpu_model_name()}

    def close(self) -> None:
        pass
