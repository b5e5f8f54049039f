"""The plan's memory line and its refusal (config/memory.py): engines living at once on a
node against its free memory, and a GPU engine's weights against vLLM's share of the GPU."""
from __future__ import annotations

import json

import pytest

from hostsweep.config.grid import build_cells, group_by_engine, rounds_partners, runnable
from hostsweep.config.memory import (ENGINE_CORE_GIB, GIB, RANK_RUNTIME_GIB, WORKER_GIB, engine_memory, live_together,
                                     memory_plan)
from hostsweep.config.shapes import parameter_count
from tests.conftest import compose_typed


def plan_of(overrides: list[str], free_gib, gpu_share: float = 0.9):
    study = compose_typed(overrides)
    cells = runnable(build_cells(study))
    groups = live_together(list(group_by_engine(cells)), rounds_partners(cells))
    return memory_plan(groups, free_gib, {s.name: s.device_memory_gib for s in study.skus}, gpu_share)


def test_a_cpu_engine_holds_its_weights_kv_cache_and_processes_in_host_ram():
    spec = next(iter(group_by_engine(build_cells(compose_typed(["+sku=cpu", "engine.dtype=float32",
                                                                "engine.cpu_kvcache_gib=3"])))))
    memory = engine_memory(spec)
    weights = parameter_count(json.loads(spec.shape_json)) * 4 / GIB
    assert memory.weights_gib == pytest.approx(weights) and memory.kv_gib == 3 and memory.gpus == 0
    assert memory.host_gib == pytest.approx(weights + 3 + RANK_RUNTIME_GIB + ENGINE_CORE_GIB)


def test_paired_rounds_count_both_engines_of_the_shared_worker_and_refuse_a_node_too_small():
    args = ["+sku=cpu", "pair.enabled=true", "engine.cpu_kvcache_gib=2"]
    roomy = plan_of(args, free_gib=64.0)
    assert "at most 2 engines (paired rounds) at once" in roomy.line and roomy.refusal is None
    one = engine_memory(next(iter(group_by_engine(build_cells(compose_typed(args)))))).host_gib
    assert f"about {2 * one + WORKER_GIB:.1f} GiB" in roomy.line and "of 64.0 GiB free" in roomy.line
    tight = plan_of(args, free_gib=2 * one)
    assert tight.refusal is not None and "do not fit the node's memory" in tight.refusal
    assert "engine.cpu_kvcache_gib (now 2)" in tight.refusal and "\n" not in tight.refusal


def test_an_unpaired_study_holds_one_engine_at_a_time_and_an_unknown_node_is_not_judged():
    plan = plan_of(["+sku=cpu", "engine.cpu_kvcache_gib=1"], free_gib=None)
    assert "at most 1 engine at once" in plan.line and "free" not in plan.line and plan.refusal is None


def test_a_gpu_engine_whose_weights_leave_no_kv_cache_is_refused_and_more_ranks_fit():
    refused = plan_of(["+sku=h100", "model=llama-3.1-70b", "tp=[1]"], free_gib=None)
    assert refused.refusal is not None and "no room for a KV cache" in refused.refusal
    assert "llama-3.1-70b" in refused.refusal and "raise tp" in refused.refusal
    assert plan_of(["+sku=h100", "model=llama-3.1-70b", "tp=[4]"], free_gib=None).refusal is None


def test_the_fake_engine_holds_nothing_worth_stating():
    spec = next(iter(group_by_engine(build_cells(compose_typed(["+sku=cpu", "engine.name=fake"])))))
    assert engine_memory(spec).host_gib == 0
