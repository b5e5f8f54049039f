"""How much memory a study's engines hold at once on a node, and whether it fits (pure).

A CPU engine's worker reserves its whole CPU node (run/actors.cpu_engine_cpus), so a node
holds one worker at a time: one engine, or two in paired rounds (side b's engine starts in
side a's worker). Its RAM is the weights (split over the TP ranks), the KV cache
(VLLM_CPU_KVCACHE_SPACE, `engine.cpu_kvcache_gib`, which each rank's process allocates) and
what the processes hold beyond both. A GPU engine's weights and KV cache live in the GPU's
memory, of which vLLM claims `engine.gpu_memory_utilization` (two engines sharing a GPU in
paired rounds are checked in config/pairing.py); its weights must leave room for a KV cache.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Optional

from hostsweep.config.grid import EngineSpec
from hostsweep.config.shapes import parameter_count

GIB = 2 ** 30
# Resident memory an engine's processes hold beyond their weights and KV cache, read from the
# process table while a paired sweep of tiny-llama ran (vllm-cpu 0.32.0, float32, 1 GiB KV
# cache): each rank (VLLM::Worker, 2.06 GiB) 1.0 GiB beyond its KV cache and weights, the
# EngineCore process 0.75 GiB, the sweep's worker (ray::SweepWorker) 0.78 GiB. Resident sizes
# count the shared libraries in every process, so the sum errs high; another release or model
# holds somewhat more or less, hence FIT_SHARE.
RANK_RUNTIME_GIB = 1.0
ENGINE_CORE_GIB = 0.75
WORKER_GIB = 0.8
# A node is said not to fit when the engines' estimate passes this share of its free memory.
FIT_SHARE = 0.9
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "auto": 2}


@dataclass(frozen=True)
class EngineMemory:
    """One engine's memory: where its weights and KV cache live (host RAM or each GPU) and
    what its processes add in host RAM; None where not known (a checkpoint without a shape)."""

    label: str
    weights_gib: Optional[float]  # all ranks together
    kv_gib: float  # all ranks together, on the CPU build; 0 on a GPU (vLLM's share of its memory)
    runtime_gib: float  # host RAM of its processes beyond weights and KV cache
    gpus: int  # 0 on the CPU build

    @property
    def host_gib(self) -> float:
        """Host RAM: everything on the CPU build, the processes alone on GPUs."""
        return self.runtime_gib + (0.0 if self.gpus else self.kv_gib + (self.weights_gib or 0.0))


def engine_memory(spec: EngineSpec) -> EngineMemory:
    if spec.engine != "vllm":  # the fake engine holds nothing worth stating
        return EngineMemory(spec.label, 0.0, 0.0, 0.0, 0)
    ranks = max(1, spec.tp)
    weights = None
    if spec.shape_json is not None:
        weights = parameter_count(json.loads(spec.shape_json)) * DTYPE_BYTES.get(spec.dtype, 2) / GIB
    gpus = ranks if spec.accelerator_type is not None else 0
    kv = 0.0 if gpus else spec.cpu_kvcache_gib * ranks
    return EngineMemory(spec.label, weights, kv, RANK_RUNTIME_GIB * ranks + ENGINE_CORE_GIB, gpus)


def live_together(specs: Iterable[EngineSpec], rounds_partner: Mapping[EngineSpec, EngineSpec]) -> list[tuple[EngineSpec, ...]]:
    """The engines a worker holds at once: a spec alone, or side a with its paired-rounds
    partner (whose own entry is then folded into side a's)."""
    partners = set(rounds_partner.values())
    return [(spec, rounds_partner[spec]) if spec in rounds_partner else (spec,)
            for spec in specs if spec not in partners]


@dataclass(frozen=True)
class MemoryPlan:
    line: str  # what the console's plan says
    refusal: Optional[str]  # why the engines do not fit, in one line; None when they do


def memory_plan(groups: list[tuple[EngineSpec, ...]], node_free_gib: Optional[float],
                gpu_memory_gib: Mapping[str, Optional[float]], gpu_share: float) -> MemoryPlan:
    """The largest group of engines living at once on a CPU node against the node's free
    memory (`node_free_gib`, None: not known), and every GPU engine's weights per GPU
    against vLLM's share of that GPU's memory (`gpu_memory_gib` by SKU, `gpu_share` =
    engine.gpu_memory_utilization)."""
    if not groups:
        return MemoryPlan("memory: no engines to start", None)
    sized = [(group, [engine_memory(spec) for spec in group]) for group in groups]
    group, memories = max(sized, key=lambda item: sum(m.host_gib for m in item[1]))
    host = sum(m.host_gib for m in memories) + WORKER_GIB
    together = " + ".join(_describe(m) for m in memories)
    held = "1 engine" if len(group) == 1 else f"{len(group)} engines (paired rounds)"
    line = f"memory: at most {held} at once on a node, about {host:.1f} GiB of host RAM ({together}, worker {WORKER_GIB:g})"
    refusal = None
    if node_free_gib is not None:
        line += f" of {node_free_gib:.1f} GiB free"
        if host > FIT_SHARE * node_free_gib:
            refusal = (f"the engines do not fit the node's memory: {held} of {group[0].label} need about {host:.1f} "
                       f"GiB, the node has {node_free_gib:.1f} GiB free: lower engine.cpu_kvcache_gib (now "
                       f"{group[0].cpu_kvcache_gib}), measure fewer engines at once (pair.design=starts), or use a "
                       "larger node")
    for group, memories in sized:
        for spec, memory in zip(group, memories):
            device = gpu_memory_gib.get(spec.sku)
            if memory.gpus and memory.weights_gib is not None and device:
                per_gpu = memory.weights_gib / memory.gpus
                if per_gpu >= gpu_share * device and refusal is None:
                    refusal = (f"{spec.label}: its weights take {per_gpu:.1f} GiB a GPU, more than vLLM's "
                               f"{gpu_share:g} x {device:g} GiB (engine.gpu_memory_utilization): no room for a "
                               f"KV cache; raise tp or the utilization")
    return MemoryPlan(line, refusal)


def _describe(memory: EngineMemory) -> str:
    weights = "weights ?" if memory.weights_gib is None else f"weights {memory.weights_gib:.2f}"
    where = f" on {memory.gpus} GPU(s)" if memory.gpus else f", KV {memory.kv_gib:g}"
    return f"{weights}{where}, processes {memory.runtime_gib:.2f}"
