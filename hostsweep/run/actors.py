"""Worker actors: where each goes (a CPU node, a GPU of its SKU, or a TP-k placement
group), starting and releasing them, and closing their engines at the end.

Each actor has a second thread, the "watch" concurrency group, so the driver can ask
whether its engine is alive (and have it killed) while a cell blocks the main one."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from hostsweep.config.grid import EngineSpec
from hostsweep.run.cluster import NodeInventory, live_nodes
from hostsweep.run.placement import placement_bundles
from hostsweep.run.worker import SweepWorker

log = logging.getLogger(__name__)

# The concurrency group of the worker methods that must answer while a cell runs
# (engine_health, phase, abort); cells run one at a time in the default group.
WATCH_GROUP = "watch"
# Seconds a worker gets to kill its engine and remove its scratch folder before its
# process is killed (then vLLM's processes notice their parent is gone and exit).
ABORT_TIMEOUT_S = 10.0


def cpu_engine_cpus(nodes: list[NodeInventory]) -> int:
    """CPUs a CPU-engine worker reserves: a whole CPU node, so no two CPU engines (or
    anything else Ray schedules) share its cores while it measures."""
    cpu_nodes = [n.cpus for n in nodes if not n.accelerator_types] or [n.cpus for n in nodes]
    return max(1, int(max(cpu_nodes, default=1)))


def actor_options(spec: EngineSpec, cpu_cpus: int = 1) -> dict[str, object]:
    """Ray scheduling options for a worker without a placement group: a CPU engine, or a
    single-GPU engine pinned to its SKU. (TP-k on GPUs: new_worker's placement group.)"""
    if spec.accelerator_type is None:
        return {"num_cpus": cpu_cpus, "num_gpus": 0, **side_env(spec)}
    if spec.tp > 1:
        raise ValueError(f"{spec.label}: a TP-{spec.tp} GPU worker is placed through a placement group")
    return {"num_cpus": 1, "num_gpus": 1, "accelerator_type": spec.accelerator_type, **side_env(spec)}


def side_env(spec: EngineSpec) -> dict[str, object]:
    """A paired study's side b under another environment's Python (pair.python): Ray starts
    its worker with that interpreter (runtime_env py_executable); {} for the driver's."""
    return {"runtime_env": {"py_executable": spec.python}} if spec.python else {}


@dataclass(frozen=True)
class WorkerHandle:
    """A worker actor and the placement group reserved for it (TP-k on GPUs), which
    outlives the actor and must be given back with it."""

    actor: Any
    placement_group: Optional[Any] = None


def release_worker(worker: WorkerHandle, engine_started: bool = True) -> None:
    """Kill a worker (its engine first, where it answers) and free its placement group.
    A worker still starting its engine cannot answer until it has: it is killed at once."""
    import ray
    from ray.util.placement_group import remove_placement_group

    if engine_started:
        try:
            ray.get(worker.actor.abort.options(concurrency_group=WATCH_GROUP).remote(), timeout=ABORT_TIMEOUT_S)
        except ray.exceptions.RayError:  # already dead, or wedged (GetTimeoutError is a RayError)
            pass
    ray.kill(worker.actor)
    if worker.placement_group is not None:
        remove_placement_group(worker.placement_group)


def new_worker(spec: EngineSpec, log_file: Optional[str] = None, partner: Optional[EngineSpec] = None,
               partner_first: bool = False) -> WorkerHandle:
    """Start one worker actor for `spec`, pinned to a node of its SKU, logging to `log_file`
    (run/worklog.py) when given; with `partner` (paired rounds: same SKU and TP, one Python)
    its engine starts in the same worker."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    remote_worker = ray.remote(concurrency_groups={WATCH_GROUP: 1})(SweepWorker)
    if spec.accelerator_type is not None and spec.tp > 1:
        # k one-GPU bundles on one node; the worker sits in bundle 0 holding none of them
        # and hands them to vLLM's ranks (placement.py).
        group = placement_group(placement_bundles(spec.tp, spec.accelerator_type), strategy="STRICT_PACK")
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0,
                                                    placement_group_capture_child_tasks=True)
        actor = remote_worker.options(num_cpus=1, num_gpus=0, scheduling_strategy=strategy, **side_env(spec)).remote(
            spec, None, log_file, own_process=True, partner=partner, partner_first=partner_first)
        return WorkerHandle(actor, group)
    options = actor_options(spec, cpu_engine_cpus(live_nodes()))
    return WorkerHandle(remote_worker.options(**options).remote(spec, None, log_file, own_process=True,
                                                                 partner=partner, partner_first=partner_first))


def ask_engines_to_close(workers: list[WorkerHandle]) -> object:
    """Ask the workers to close their engines cleanly (their EngineCore subprocesses exit);
    the answers to wait for in end_workers_once_closed."""
    return [worker.actor.close.remote() for worker in workers]


def end_workers_once_closed(workers: list[WorkerHandle], answers: object) -> None:
    """Wait (60 s at most) for the engines ask_engines_to_close asked to close, then end the actors."""
    import ray

    try:
        ray.get(answers, timeout=60)
    except ray.exceptions.GetTimeoutError:  # a subclass of RayError: test it first
        log.warning("workers took over 60 s to close; killing them")
    except ray.exceptions.RayError as exc:
        log.warning("a worker did not close cleanly: %s", exc)
    for worker in workers:
        release_worker(worker)
