"""The sides of paired rounds as the worker that coordinates the rounds sees them.

A side is an engine whose cells take part in the rounds. It lives in the coordinating
worker (both engines in one process, today's paired rounds: worker_side), or in a partner
worker on the same node (another Python, so another vLLM release, or another TP degree:
remote_side), which prepares, times and keeps its own pairs in its own process: a call to it
costs a Ray round trip, which never enters a timing. The coordinator only says which pair
to time when (worker._measure_paired_group), so both kinds give the same rounds.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from hostsweep.config.grid import Cell, EngineSpec
from hostsweep.measure.group import TimedCell
from hostsweep.measure.protocol import RepTiming
from hostsweep.measure.results import MeasureOptions
from hostsweep.run.faults import EngineDied


class WorkerSide:
    """A side whose engine a SweepWorker holds, reached through `call(method name, *args)`
    (and `watch(...)`, which answers while a pair is being timed): the coordinating worker
    itself or a partner worker."""

    def __init__(self, call: Callable[..., Any], watch: Optional[Callable[..., Any]] = None,
                 end: Optional[Callable[[], None]] = None) -> None:
        self._call, self._watch, self._end = call, watch or call, end

    def prepare(self, spec: EngineSpec, cells: Sequence[Cell], options: MeasureOptions) -> None:
        self._call("side_prepare", spec, list(cells), options)

    def new_round(self) -> None:
        self._call("side_new_round")

    def time(self, spec: EngineSpec, key: str, k: int, t1_first: bool, round_id: str, r: int) -> RepTiming:
        return self._call("side_time", spec, key, k, t1_first, round_id, r)

    def finish(self, spec: EngineSpec) -> dict[str, TimedCell]:
        return self._call("side_finish", spec)

    def host(self) -> dict[str, str]:
        return self._call("host_info")

    def health(self) -> Optional[str]:
        """Why the side's engine is dead, or None (answered while a pair runs)."""
        try:
            return self._watch("engine_health")
        except EngineDied as exc:
            return str(exc)

    def end(self, abort: bool) -> None:
        """The side's engine closed (abort: killed at once) and, for a partner actor, the actor
        ended; a partner already gone is no error."""
        try:
            self._watch("abort") if abort else self._call("close")
        except EngineDied:
            pass
        if self._end is not None:
            self._end()


def worker_side(worker: Any) -> WorkerSide:
    """A side held by a SweepWorker in this process: the coordinating worker's own engines, or
    a partner worker in-process (the tests' fake backend). Its side_* methods raise
    EngineDied themselves when its engine is gone."""
    return WorkerSide(lambda name, *args: getattr(worker, name)(*args))


# How long a partner actor's watch methods (engine_health, abort) may take to answer.
WATCH_TIMEOUT_S = 5.0  # under the driver's wait for abort (actors.ABORT_TIMEOUT_S)


class ActorCall:
    """A partner worker actor's methods called and waited for; `watch=True` in its watch
    concurrency group, which answers while a pair is timed. A dead actor, or a partner whose
    engine died, is EngineDied: the driver retries the group with new workers."""

    def __init__(self, actor: Any, label: str, watch: bool = False) -> None:
        self.actor, self.label, self.watch = actor, label, watch

    def __call__(self, name: str, *args: Any) -> Any:
        import ray

        from hostsweep.run.actors import WATCH_GROUP

        method = getattr(self.actor, name)
        try:
            if self.watch:
                return ray.get(method.options(concurrency_group=WATCH_GROUP).remote(*args), timeout=WATCH_TIMEOUT_S)
            return ray.get(method.remote(*args))
        except ray.exceptions.GetTimeoutError:
            raise EngineDied(f"the partner worker for {self.label} did not answer in {WATCH_TIMEOUT_S:g} s") from None
        except ray.exceptions.RayActorError as exc:
            raise EngineDied(f"the partner worker for {self.label} is gone: {type(exc).__name__}") from None
        except ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, EngineDied):
                raise EngineDied(f"the partner worker for {self.label}: {exc.cause}") from None
            raise exc.cause from None


def remote_side(actor: Any, label: str) -> WorkerSide:
    def end() -> None:
        import ray

        ray.kill(actor)

    return WorkerSide(ActorCall(actor, label), ActorCall(actor, label, watch=True), end)


def needs_own_worker(spec: EngineSpec, partner: EngineSpec) -> bool:
    """Whether side b's engine must live in a worker of its own: another Python (another vLLM
    or torch release) or another TP degree cannot share side a's process."""
    return partner.python != spec.python or partner.tp != spec.tp


def partner_log(log_file: Optional[str]) -> Optional[str]:
    """The partner worker's log, beside the coordinating worker's."""
    if not log_file:
        return None
    path = Path(log_file)
    return str(path.with_name(f"{path.stem}.side-b{path.suffix}"))


def start_partner(partner: EngineSpec, workdir: Optional[str], log_file: Optional[str], as_actor: bool
                  ) -> tuple[Any, WorkerSide]:
    """Side b's worker, started on this worker's node, its engine running once this returns
    (its start's error raised here): a Ray actor owned by this one (it ends when this worker
    ends) under side b's Python (runtime_env), taking no CPUs of its own (the node's CPUs are
    the coordinating worker's, which times one engine at a time); in-process where this
    worker is (the tests' fake backend). Returns the worker and its side."""
    from hostsweep.run.worker import SweepWorker

    label = f"{partner.label}/{partner.side or 'b'}"
    if not as_actor:
        worker = SweepWorker(partner, workdir, log_file)
        return worker, worker_side(worker)
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from hostsweep.run.actors import WATCH_GROUP, side_env

    here = ray.get_runtime_context().get_node_id()
    actor = ray.remote(concurrency_groups={WATCH_GROUP: 1})(SweepWorker).options(
        num_cpus=0, num_gpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
        **side_env(partner)).remote(partner, None, log_file, own_process=True)
    side = remote_side(actor, label)
    side.host()  # waits for its engine; a failed start raises its error here
    return actor, side
