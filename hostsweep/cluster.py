"""Ray: connect or start a cluster, check the plan fits it, run workers, stream results.

A Ray request for a resource no node has waits forever, so every plan is checked
against the live nodes before any actor is created.
"""
from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass
from typing import Iterable

from hostsweep.config import ConfigError
from hostsweep.grid import EngineSpec
from hostsweep.worker import WORKER_AFFINITY_ENV, SweepWorker

log = logging.getLogger(__name__)

ACCELERATOR_PREFIX = "accelerator_type:"


class InfeasiblePlan(ConfigError):
    """The cluster has no node that can host some engine spec."""


@dataclass(frozen=True)
class NodeInventory:
    node_id: str
    cpus: float
    gpus: float
    accelerator_types: tuple[str, ...]


def connect(address: str | None, confine_daemons: bool = False) -> bool:
    """Join the cluster at `address`, or start a local one; True if we started it.

    confine_daemons (local cluster only): Ray's daemons start pinned to the last core,
    away from the cores vLLM binds its compute threads to; workers get every core back
    (WORKER_AFFINITY_ENV) before their engine starts.
    """
    import ray

    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True)
        return False
    # Ray runs workers at niceness 15 by default; the engines they start inherit it.
    os.environ.setdefault("RAY_worker_niceness", "0")
    # No idle pre-started workers polling beside the engine: a sweep starts one actor
    # per engine spec and nothing else.
    os.environ.setdefault("RAY_enable_worker_prestart", "0")
    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
    cores = sorted(os.sched_getaffinity(0))
    if confine_daemons and len(cores) > 1:
        os.environ[WORKER_AFFINITY_ENV] = ",".join(map(str, cores))
        os.sched_setaffinity(0, cores[-1:])  # the daemons ray.init starts inherit this
    try:
        ray.init(include_dashboard=False, logging_level=logging.WARNING, log_to_driver=True)
    finally:
        os.sched_setaffinity(0, cores)
    return True


def live_nodes() -> list[NodeInventory]:
    import ray

    nodes = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        res = node.get("Resources", {})
        types = tuple(sorted(k[len(ACCELERATOR_PREFIX):] for k in res if k.startswith(ACCELERATOR_PREFIX)))
        nodes.append(NodeInventory(node["NodeID"], res.get("CPU", 0.0), res.get("GPU", 0.0), types))
    return nodes


def describe_inventory(nodes: Iterable[NodeInventory]) -> str:
    """'H100 x8 (2 nodes), CPU-only (1 node)' — what the cluster really has."""
    kinds = Counter()
    for node in nodes:
        label = "/".join(node.accelerator_types) + f" x{int(node.gpus)}" if node.accelerator_types else "CPU-only"
        kinds[label] += 1
    if not kinds:
        return "no live nodes"
    return ", ".join(f"{label} ({n} node{'s' if n > 1 else ''})" for label, n in sorted(kinds.items()))


def node_offers(node: NodeInventory, accelerator_type: str | None, gpus: int) -> bool:
    """Whether one node has a CPU, `gpus` GPUs and (if given) the accelerator type."""
    if accelerator_type is not None and accelerator_type not in node.accelerator_types:
        return False
    return node.cpus >= 1 and node.gpus >= gpus


def node_fits(spec: EngineSpec, node: NodeInventory) -> bool:
    return node_offers(node, spec.accelerator_type, spec.tp if spec.accelerator_type else 0)


def check_feasible(specs: Iterable[EngineSpec], nodes: list[NodeInventory]) -> None:
    """Raise InfeasiblePlan naming what the cluster has if any spec fits no node."""
    for spec in specs:
        if not any(node_fits(spec, node) for node in nodes):
            need = f"accelerator_type {spec.accelerator_type} with >= {spec.tp} GPUs on one node" \
                if spec.accelerator_type else "a node with a CPU"
            raise InfeasiblePlan(
                f"sku={spec.sku} tp={spec.tp} needs {need}; the cluster has: {describe_inventory(nodes)}"
            )


def cpu_engine_cpus(nodes: list[NodeInventory]) -> int:
    """CPUs a CPU-engine worker reserves: a whole CPU node, so no two CPU engines (or
    anything else Ray schedules) share its cores while it measures."""
    cpu_nodes = [n.cpus for n in nodes if not n.accelerator_types] or [n.cpus for n in nodes]
    return max(1, int(max(cpu_nodes, default=1)))


def actor_options(spec: EngineSpec, cpu_cpus: int = 1) -> dict[str, object]:
    """Ray scheduling options pinning a single-device worker to its SKU."""
    if spec.accelerator_type is None:
        return {"num_cpus": cpu_cpus, "num_gpus": 0}
    return {"num_cpus": 1, "num_gpus": spec.tp, "accelerator_type": spec.accelerator_type}


def placement_bundles(spec: EngineSpec) -> list[dict[str, float]]:
    """TP-k on GPUs: one bundle holding the worker's CPU and k GPUs of the SKU (STRICT_PACK).

    One bundle, not k: vLLM V1 runs its executor in an EngineCore subprocess, which loses
    the actor's placement-group context, so its Ray executor cannot place ranks on sibling
    bundles (vllm-project/vllm#30016). The worker holds all k GPUs (Ray sets
    CUDA_VISIBLE_DEVICES to them) and vLLM's multiprocessing executor runs the ranks.
    """
    return [{"CPU": 1.0, "GPU": float(spec.tp), f"{ACCELERATOR_PREFIX}{spec.accelerator_type}": 0.001}]


# Placement groups outlive their actors; a replaced worker must give its GPUs back.
_placement_groups: dict[str, object] = {}


def release_worker(actor: object) -> None:
    """Kill a worker and free its placement group, if it has one."""
    import ray
    from ray.util.placement_group import remove_placement_group

    ray.kill(actor)
    group = _placement_groups.pop(actor._actor_id.hex(), None)
    if group is not None:
        remove_placement_group(group)


def new_worker(spec: EngineSpec) -> object:
    """Start one worker actor for `spec`, pinned to a node of its SKU."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    remote_worker = ray.remote(SweepWorker)
    if spec.accelerator_type is not None and spec.tp > 1:
        group = placement_group(placement_bundles(spec), strategy="STRICT_PACK")
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0,
                                                    placement_group_capture_child_tasks=True)
        actor = remote_worker.options(num_cpus=1, num_gpus=spec.tp, scheduling_strategy=strategy).remote(spec)
        _placement_groups[actor._actor_id.hex()] = group
        return actor
    return remote_worker.options(**actor_options(spec, cpu_engine_cpus(live_nodes()))).remote(spec)


def stop_workers(actors: list[object]) -> None:
    """Close engines cleanly (their EngineCore subprocesses exit), then end the actors."""
    import ray

    try:
        ray.get([actor.close.remote() for actor in actors], timeout=60)
    except ray.exceptions.GetTimeoutError:  # a subclass of RayError: test it first
        log.warning("workers took over 60 s to close; killing them")
    except ray.exceptions.RayError as exc:
        log.warning("a worker did not close cleanly: %s", exc)
    for actor in actors:
        release_worker(actor)


def disconnect(started_here: bool) -> None:
    import ray

    if started_here and ray.is_initialized():
        ray.shutdown()
