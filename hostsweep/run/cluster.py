"""Ray: connect to a cluster or start a local one, read its nodes, check a plan fits it.

A Ray request for a resource no node has waits forever, so every plan is checked
against the live nodes before any actor is created.
"""
from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass
from typing import Iterable

from hostsweep.config.grid import EngineSpec
from hostsweep.config.schema import ConfigError
from hostsweep.run.hygiene import (
    WORKER_AFFINITY_ENV, can_leave_sched_idle, daemons_to_idle, descendant_pids, idle_process,
)
from hostsweep.run.placement import ACCELERATOR_PREFIX

log = logging.getLogger(__name__)


class InfeasiblePlan(ConfigError):
    """The cluster has no node that can host some engine spec."""


@dataclass(frozen=True)
class NodeInventory:
    node_id: str
    cpus: float
    gpus: float
    accelerator_types: tuple[str, ...]


def connect(address: str | None, confine_daemons: bool = False, idle_daemons: bool = False) -> bool:
    """Join the cluster at `address`, or start a local one; True if we started it.

    Local cluster only, so Ray's own processes take as little as possible from the
    engines measured beside them:
    confine_daemons: Ray's daemons start pinned to the last core, away from the cores vLLM
    binds its compute threads to; workers get every core back (WORKER_AFFINITY_ENV)
    before their engine starts.
    idle_daemons: the daemons run under SCHED_IDLE, only when a core has nothing else
    to do (the raylet only where its workers may leave that policy: daemons_to_idle).
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
    before = set(descendant_pids(os.getpid()))  # not Ray's: e.g. an engine started here
    try:
        # address="local": always a new cluster. Without it ray.init joins the cluster named in
        # /tmp/ray/ray_current_cluster, which a `ray start` (or a test cluster) may have left
        # behind long dead: the sweep then waits on its GCS forever.
        ray.init(address="local", include_dashboard=False, logging_level=logging.WARNING, log_to_driver=True)
    finally:
        os.sched_setaffinity(0, cores)
    if idle_daemons:
        for pid in daemons_to_idle(set(descendant_pids(os.getpid())) - before, can_leave_sched_idle()):
            idle_process(pid)
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


def disconnect(started_here: bool) -> None:
    import ray

    if started_here and ray.is_initialized():
        ray.shutdown()
