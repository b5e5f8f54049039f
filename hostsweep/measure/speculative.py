"""Speculative decoding through the host lens: acceptance and cycles from vLLM's per-request
counts (pure).

A cell's step_ms is per output token whatever the mode: the protocol divides the differenced
wall time by the T - 1 tokens each request emitted, not by engine steps. With speculation one
engine step (a draft-verify cycle) emits 1 + accepted tokens per request, so

    cycles = (T - 1) - accepted          tokens_per_cycle = (T - 1) / cycles
    cycle_ms = step_ms * tokens_per_cycle   host_cycle_ms = host_ms * tokens_per_cycle

`accepted` counts the draft tokens the verifier kept. The last cycle of a request may accept
tokens past max_tokens that are then dropped, so cycles can be undercounted by at most one
cycle's worth of accepted tokens; never fewer cycles than verify steps are counted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np


@dataclass(frozen=True)
class SpecResult:
    num_speculative_tokens: int  # k, draft tokens proposed per cycle at most
    acceptance_rate: float  # accepted / drafted tokens
    accepted_per_cycle: float  # accepted draft tokens per verify step that had a draft
    drafts: float  # verify steps with a draft, per request and T-token generate
    draft_tokens: float  # drafted tokens, per request and T-token generate
    accepted: float  # accepted draft tokens, per request and T-token generate
    cycles: float  # engine steps after the prefill, per request and T-token generate
    tokens_per_cycle: float  # output tokens one cycle emits per request


def request_cycles(T: int, accepted: float, drafts: float) -> float:
    """Engine steps after the prefill for one request that emitted T tokens."""
    return max(float(T - 1) - accepted, drafts, 1.0)


def spec_summary(generates: Sequence[Sequence[dict[str, Any]]], T: int) -> Optional[SpecResult]:
    """Acceptance over T-token generates, each a list of vLLM's per-request counts
    (`RequestSpecDecodeMetrics.to_dict()`: num_spec_steps, num_draft_tokens,
    num_accepted_draft_tokens, num_spec_tokens). None when there are none."""
    requests = [r for generate in generates for r in generate]
    if not requests:
        return None
    drafts = np.array([r["num_spec_steps"] for r in requests], float)
    drafted = np.array([r["num_draft_tokens"] for r in requests], float)
    accepted = np.array([r["num_accepted_draft_tokens"] for r in requests], float)
    cycles = np.array([request_cycles(T, a, d) for a, d in zip(accepted, drafts)])
    return SpecResult(
        num_speculative_tokens=int(requests[0]["num_spec_tokens"]),
        acceptance_rate=float(accepted.sum() / drafted.sum()) if drafted.sum() else 0.0,
        accepted_per_cycle=float(accepted.sum() / drafts.sum()) if drafts.sum() else 0.0,
        drafts=float(drafts.mean()),
        draft_tokens=float(drafted.mean()),
        accepted=float(accepted.mean()),
        cycles=float(cycles.mean()),
        tokens_per_cycle=float((T - 1) / cycles.mean()),
    )


def spec_metrics(spec: SpecResult, step_ms: float, host_ms: Optional[float]) -> dict[str, float]:
    """The per-cell figures a speculative cell logs (MLflow metrics, cell-table columns)."""
    metrics = {
        "spec_acceptance_rate": spec.acceptance_rate,
        "spec_accepted_per_cycle": spec.accepted_per_cycle,
        "spec_drafts": spec.drafts,
        "spec_cycles": spec.cycles,
        "spec_tokens_per_cycle": spec.tokens_per_cycle,
        "spec_cycle_ms": step_ms * spec.tokens_per_cycle,
        "spec_num_tokens": float(spec.num_speculative_tokens),
    }
    if host_ms is not None:
        metrics["spec_host_cycle_ms"] = host_ms * spec.tokens_per_cycle
    return metrics
