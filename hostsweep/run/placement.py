"""Tensor-parallel placement on one GPU node: the placement group the driver reserves for
a TP-k engine, and how the worker inside it hands those k GPUs to vLLM's ranks.

The group is k bundles of one GPU each, STRICT_PACK (all on one node). The worker actor
runs in bundle 0 and holds no GPU itself, so every GPU stays with its bundle. Then,
by engine.tp_executor:

- "mp" (the default, and vLLM's own single-node default; the seeds do not name their
  executor, so presumably theirs too): the worker asks each bundle which GPU it holds
  (one zero-CPU probe task per bundle) and exposes exactly those to vLLM's
  multiprocessing ranks through CUDA_VISIBLE_DEVICES, rank i on bundle i's GPU.
- "ray" (vLLM's documented pattern for an engine inside a Ray actor): the worker drops
  CUDA_VISIBLE_DEVICES and vLLM's Ray executor starts rank i in bundle i. It finds the
  group because the worker's child tasks are captured by it and, since
  vllm-project/vllm#14705, vLLM hands it on to its spawned EngineCore process. Its ranks
  talk through Ray, so the host time it measures is not the mp executor's.
"""
from __future__ import annotations

from typing import MutableMapping, Optional

ACCELERATOR_PREFIX = "accelerator_type:"
# Seconds a probe may wait for its bundle's GPU: the bundles are reserved for this worker,
# so a wait this long means the group is not what this module built.
PROBE_TIMEOUT_S = 60.0


def placement_bundles(tp: int, accelerator_type: str) -> list[dict[str, float]]:
    """k one-GPU bundles of the SKU; bundle 0 also holds the worker's CPU."""
    sku = {f"{ACCELERATOR_PREFIX}{accelerator_type}": 0.001}
    return [{"CPU": 1.0, "GPU": 1.0, **sku}] + [{"GPU": 1.0, **sku} for _ in range(tp - 1)]


def _bundle_gpu_ids() -> list[str]:
    import ray

    return [str(gpu) for gpu in ray.get_gpu_ids()]


def bundle_gpu_ids() -> Optional[list[str]]:
    """The GPU each bundle of this worker's placement group holds, in bundle order; None
    outside a placement group (a plain process, or a single-GPU worker)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if not ray.is_initialized():
        return None
    group = ray.util.get_current_placement_group()
    if group is None:
        return None
    probe = ray.remote(num_cpus=0, num_gpus=1)(_bundle_gpu_ids)
    refs = [
        probe.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i))
        .remote()
        for i in range(len(group.bundle_specs))
    ]
    try:
        per_bundle = ray.get(refs, timeout=PROBE_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(
            f"a bundle of this worker's placement group gave no GPU within {PROBE_TIMEOUT_S:.0f} s: "
            "is another task holding it?"
        ) from None
    return [gpu for ids in per_bundle for gpu in ids]


def hand_gpus_to_ranks(tp_executor: str, environ: MutableMapping[str, str]) -> Optional[list[str]]:
    """Make the placement group's GPUs the engine's (see the module docstring); returns
    them, for the record, or None outside a placement group, where nothing changes."""
    gpus = bundle_gpu_ids()
    if gpus is None:
        return None
    if tp_executor == "mp":
        environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    else:
        environ.pop("CUDA_VISIBLE_DEVICES", None)
    return gpus


def ray_placement(tp_gpus: Optional[list[str]] = None) -> dict[str, str]:
    """The Ray node and the GPU ids the engine was given ('none' outside Ray): the worker's
    own, or for TP-k the GPUs of its placement group's bundles."""
    try:
        import ray
    except ImportError:
        return {"ray_node_id": "none", "ray_gpu_ids": "none"}
    if not ray.is_initialized():
        return {"ray_node_id": "none", "ray_gpu_ids": "none"}
    context = ray.get_runtime_context()
    gpus = tp_gpus if tp_gpus is not None else context.get_accelerator_ids().get("GPU", [])
    return {"ray_node_id": context.get_node_id(), "ray_gpu_ids": ",".join(map(str, gpus)) or "none"}
