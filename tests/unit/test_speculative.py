"""Acceptance and cycles from vLLM's per-request speculative-decoding counts."""
from __future__ import annotations

import pytest

from hostsweep.measure.speculative import spec_metrics, spec_summary


def request(steps, drafted, accepted, k=4):
    return {"num_spec_steps": steps, "num_draft_tokens": drafted, "num_accepted_draft_tokens": accepted,
            "num_spec_tokens": k}


def test_cycles_come_from_tokens_emitted_not_from_steps_counted():
    # T=33: 32 tokens after the prefill; 6 verify steps accepted 4+4+4+4+2+2 = 20, so 12 cycles
    # emitted them (6 with a draft accepted, 6 without a draft).
    (summary) = spec_summary([[request(6, 24, 20)]], T=33)
    assert summary.cycles == 12 and summary.tokens_per_cycle == pytest.approx(32 / 12)
    assert summary.acceptance_rate == pytest.approx(20 / 24)
    assert summary.accepted_per_cycle == pytest.approx(20 / 6)


def test_counts_average_over_requests_and_generates():
    summary = spec_summary([[request(8, 32, 32), request(0, 0, 0)], [request(8, 32, 32), request(0, 0, 0)]], T=33)
    assert summary.drafts == 4 and summary.accepted == 16 and summary.acceptance_rate == 1.0
    assert summary.cycles == pytest.approx((8 + 32) / 2)  # all accepted: its 8 verify steps; none: 32


def test_a_last_cycle_accepting_past_max_tokens_never_counts_fewer_cycles_than_verify_steps():
    summary = spec_summary([[request(7, 28, 28)]], T=17)  # 16 tokens wanted, 28 accepted: 7 steps ran
    assert summary.cycles == 7


def test_per_cycle_figures_scale_the_per_token_ones():
    summary = spec_summary([[request(4, 16, 16)]], T=21)  # 20 tokens in 4 cycles
    metrics = spec_metrics(summary, step_ms=1.0, host_ms=0.25)
    assert metrics["spec_tokens_per_cycle"] == 5.0
    assert metrics["spec_cycle_ms"] == 5.0 and metrics["spec_host_cycle_ms"] == 1.25
    assert "spec_host_cycle_ms" not in spec_metrics(summary, 1.0, None)


def test_no_counts_no_summary():
    assert spec_summary([], T=33) is None
