"""Ray: connect or start a cluster, check the plan fits it, run workers, stream results.

A Ray request for a resource no node has waits forever, so every plan is checked
against the live nodes before any actor is created.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Iterable

from hostsweep.config.schema import ConfigError
from hostsweep.config.grid import EngineSpec
from hostsweep.run.placement import ACCELERATOR_PREFIX, placement_bundles
from hostsweep.run.worker import WORKER_AFFINITY_ENV, SweepWorker

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
        ray.init(include_dashboard=False, logging_level=logging.WARNING, log_to_driver=True)
    finally:
        os.sched_setaffinity(0, cores)
    if idle_daemons:
        for pid in daemons_to_idle(set(descendant_pids(os.getpid())) - before, can_leave_sched_idle()):
            idle_process(pid)
    return True


def can_leave_sched_idle() -> bool:
    """Whether a process here may go back from SCHED_IDLE to the normal policy (root, or an
    RLIMIT_NICE that allows nice 0). Tried in a child: nothing here changes policy."""
    script = ("import os; os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0)); "
              "os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))")
    return subprocess.run([sys.executable, "-c", script], capture_output=True).returncode == 0


def process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as handle:
            return handle.read().strip()
    except OSError:
        return ""


def daemons_to_idle(pids: Iterable[int], workers_can_leave_idle: bool) -> list[int]:
    """The processes ray.init started, less the raylet unless its workers can leave
    SCHED_IDLE: the raylet starts them, a child keeps its parent's SCHED_IDLE, and a
    worker that cannot go back to the normal policy refuses to measure."""
    return sorted(pid for pid in pids if workers_can_leave_idle or process_name(pid) != "raylet")


def idle_process(pid: int) -> None:
    """SCHED_IDLE for every thread of `pid`: the policy is per thread, and the daemons'
    gRPC and event-loop threads already exist."""
    try:
        threads = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        return
    for tid in threads:
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except ProcessLookupError:
            pass
        except PermissionError as exc:
            log.warning("could not idle Ray process %d: %s", pid, exc)
            return


def descendant_pids(pid: int) -> list[int]:
    """Every process below `pid` (from /proc): here, the daemons ray.init started."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                # "pid (comm) state ppid ...": comm may hold spaces, so split after ")".
                ppid = int(handle.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, frontier = [], [pid]
    while frontier:
        below = children.get(frontier.pop(), [])
        found += below
        frontier += below
    return found


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
    """Ray scheduling options for a worker without a placement group: a CPU engine, or a
    single-GPU engine pinned to its SKU. (TP-k on GPUs: new_worker's placement group.)"""
    if spec.accelerator_type is None:
        return {"num_cpus": cpu_cpus, "num_gpus": 0}
    if spec.tp > 1:
        raise ValueError(f"{spec.label}: a TP-{spec.tp} GPU worker is placed through a placement group")
    return {"num_cpus": 1, "num_gpus": 1, "accelerator_type": spec.accelerator_type}


# Placement groups outlive their actors; a replaced worker must give its GPUs back.
_placement_groups: dict[str, object] = {}


def placement_group_of(actor: object) -> object | None:
    """The placement group new_worker reserved for this worker (TP-k on GPUs), else None."""
    return _placement_groups.get(actor._actor_id.hex())


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
        # k one-GPU bundles on one node; the worker sits in bundle 0 holding none of them
        # and hands them to vLLM's ranks (placement.py).
        group = placement_group(placement_bundles(spec.tp, spec.accelerator_type), strategy="STRICT_PACK")
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0,
                                                    placement_group_capture_child_tasks=True)
        actor = remote_worker.options(num_cpus=1, num_gpus=0, scheduling_strategy=strategy).remote(spec)
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
