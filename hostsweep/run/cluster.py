"""Ray: connect to a cluster or start a local one, read its nodes, check a plan fits it.

A Ray request for a resource no node has waits forever, so every plan is checked
against the live nodes before any actor is created.
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional

import psutil

from hostsweep.config.grid import EngineSpec
from hostsweep.config.schema import ConfigError
from hostsweep.run.hygiene import (
    WORKER_AFFINITY_ENV, daemons_to_idle, descendant_pids, idle_process,
)
from hostsweep.run.placement import ACCELERATOR_PREFIX
from hostsweep.run import netprobe, reaper
from hostsweep.run.leftovers import mark_session

log = logging.getLogger(__name__)


class InfeasiblePlan(ConfigError):
    """The cluster has no node that can host some engine spec."""


@dataclass(frozen=True)
class NodeInventory:
    node_id: str
    cpus: float
    gpus: float
    accelerator_types: tuple[str, ...]


# Ray's own record of the cluster `ray start` last started here (what address=auto joins).
RAY_CURRENT_CLUSTER = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
CONNECT_TIMEOUT_S = 3.0


def resolve_address(address: str) -> tuple[str, int]:
    """host and port behind ray.address: `auto` (RAY_ADDRESS, else the cluster `ray start`
    last started here), `ray://host:port` or `host:port`; ConfigError if there is none."""
    given = address
    if address == "auto":
        address = os.environ.get("RAY_ADDRESS") or \
            (RAY_CURRENT_CLUSTER.read_text().strip() if RAY_CURRENT_CLUSTER.is_file() else "")
        if not address:
            raise ConfigError("ray.address=auto but no Ray cluster was started on this machine (`ray start --head`, "
                              "or `ray up ray_cluster.yaml` then run on the head) and RAY_ADDRESS is unset")
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"ray.address={given} is not host:port, ray://host:port or auto")
    return host.strip("[]"), int(port)


def check_address_answers(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """ConfigError within about timeout_s unless a Ray cluster's gRPC server answers at
    ray.address (run/netprobe.py): Ray itself would retry 'Failed to connect to GCS' for
    minutes against a port that accepts and never answers. Under RAY_USE_TLS the
    cleartext handshake cannot be asked, so only the connection is."""
    host, port = resolve_address(address)
    what = f"ray.address={address}"
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        netprobe.check_listening(host, port, timeout_s, what)
    else:
        netprobe.check_grpc_answers(host, port, timeout_s, what)


def _loopback_only() -> None:
    """Make a local cluster listen on 127.0.0.1 only. Ray binds its servers to the node IP
    and replaces 127.0.0.1 by the routable one unless clusters are "disabled", the mode
    it uses on macOS/Windows; the flag is read at import and by the daemons it starts."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray._private.ray_constants as ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def connect(address: str | None, confine_daemons: bool = False, idle_daemons: bool = False,
            log_to_driver: bool = True, connect_timeout_s: float = 60.0) -> bool:
    """Join the cluster at `address`, or start a local one; True if we started it.

    log_to_driver: Ray forwards its workers' output (vLLM's, here) to this console; off
    when the workers write their own log files (run/worklog.py).
    connect_timeout_s: joining `address`, how long ray.init may take (ray.connect_timeout_s).

    A local cluster listens on loopback only, with no dashboard. Local cluster only, so
    Ray's own processes take as little as possible from the engines measured beside them:
    confine_daemons: Ray's daemons start pinned to the last core, away from the cores vLLM
    binds its compute threads to; workers get every core back (WORKER_AFFINITY_ENV)
    before their engine starts.
    idle_daemons: the daemons run under SCHED_IDLE, only when a core has nothing else
    to do (all but the raylet, whose workers would inherit it: daemons_to_idle).
    """
    import ray

    if ray.is_initialized():
        return False
    # ray.init replaces the driver's SIGTERM handler with sys.exit; the program's own
    # (stop like Ctrl-C, __main__) must stay.
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        return _init(ray, address, confine_daemons, idle_daemons, log_to_driver, connect_timeout_s)
    finally:
        if sigterm is not None:
            signal.signal(signal.SIGTERM, sigterm)


def _join(ray, address: str, log_to_driver: bool, timeout_s: float) -> None:  # noqa: ANN001
    """ray.init(address) within timeout_s, its failure (after its own retries) as one line.

    ray.init blocks in Ray's C++ GCS client, where a stop signal's Python handler cannot
    run and no timeout of its own bounds the retries: it runs on a thread of its own while
    this (main) thread waits in short joins, so Ctrl-C and SIGTERM still stop the sweep and
    the wait ends at timeout_s (the thread is a daemon: the process exits without it)."""
    outcome: dict[str, BaseException] = {}

    def attempt() -> None:
        try:
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=log_to_driver)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            outcome["error"] = exc

    # Ray's C++ GCS client warns at every retry ("Failed to connect to GCS ... within 5
    # seconds"); preflight's gRPC probe has already refused a port that never answers, so a
    # retry here is news (another Ray's GCS, one still starting). RAY_BACKEND_LOG_LEVEL is
    # left to the user: set, Ray announces it on the console of every process it starts,
    # and in os.environ it would reach every engine and child this driver starts.
    thread = threading.Thread(target=attempt, name="ray-connect", daemon=True)
    with _quiet(SIGTERM_NOTICE_LOGGER):
        thread.start()
        deadline = time.monotonic() + timeout_s
        while thread.is_alive() and time.monotonic() < deadline:
            thread.join(0.2)
    if thread.is_alive():
        raise ConfigError(f"ray.address={address}: Ray did not connect within {timeout_s:.0f} s "
                          "(ray.connect_timeout_s); is the cluster healthy and its version this one's?")
    exc = outcome.get("error")
    if isinstance(exc, (ConnectionError, RuntimeError)):
        cause = f"{exc}; {exc.__cause__}" if exc.__cause__ else str(exc)
        hint = (" (the cluster wants a token: set RAY_AUTH_MODE=token, with the token in ~/.ray/auth_token "
                "or RAY_AUTH_TOKEN)") if "auth" in cause.lower() else ""
        raise ConfigError(f"ray.address={address}: could not join the cluster: "
                          f"{str(exc).strip().splitlines()[0]}{hint}") from None
    if exc is not None:
        raise exc


# ray.init off the main thread warns that it set no SIGTERM handler: the sweep keeps its own.
SIGTERM_NOTICE_LOGGER = "ray._private.worker"


@contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    """A logger's warnings held back (errors still shown) while the block runs."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


# Ray warns on every local start that it turned token authentication on by default; a
# loopback-only cluster of this sweep's own is not news to its user.
TOKEN_NOTICE_LOGGER = "ray._private.authentication.authentication_token_setup"


def _init(ray, address: str | None, confine_daemons: bool, idle_daemons: bool,  # noqa: ANN001
          log_to_driver: bool, connect_timeout_s: float) -> bool:
    if address:
        _join(ray, address, log_to_driver, connect_timeout_s)
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
    _loopback_only()
    _reclaim_leftovers()
    global _watchdog
    marker = reaper.marker_of(os.getpid())
    # Every process of the cluster inherits the marker from ray.init's daemons; the driver
    # itself and what it starts later (not the cluster's) do not.
    os.environ[reaper.MARKER_ENV] = marker
    _watchdog = reaper.start_watchdog(marker)
    # Not Ray's: e.g. an engine started here, and the watchdog (never idled: it must run
    # when the engines take every core).
    before = set(descendant_pids(os.getpid()))
    try:
        # "local": always a new cluster. Without an address ray.init joins the cluster named
        # by RAY_ADDRESS or /tmp/ray/ray_current_cluster (hanging if that one is dead).
        with _quiet(TOKEN_NOTICE_LOGGER):
            ray.init(address="local", include_dashboard=False, logging_level=logging.WARNING,
                     log_to_driver=log_to_driver)
    except BaseException:
        _stop_watchdog()
        raise
    finally:
        os.environ.pop(reaper.MARKER_ENV, None)
        os.sched_setaffinity(0, cores)
    global _session_dir
    _session_dir = ray._private.worker._global_node.get_session_dir_path()
    mark_session(_session_dir, marker)
    if idle_daemons:
        for pid in daemons_to_idle(set(descendant_pids(os.getpid())) - before):
            idle_process(pid)
    return True


# The watchdog of the local cluster this driver started (run/reaper.py): it kills what is
# left of the cluster when the driver dies, or once disconnect has shut it down.
_watchdog = None
# The Ray session folder of the local cluster this driver started: removed at a normal end,
# so the next sweep finds nothing of this one to reclaim.
_session_dir: Optional[str] = None


def _stop_watchdog() -> None:
    global _watchdog
    reaper.stop_watchdog(_watchdog)
    _watchdog = None


def _reclaim_leftovers() -> None:
    """What killed sweeps left on this machine (their watchdog killed too), before ours starts.
    A sweep that ended normally leaves nothing (disconnect), so anything here was killed."""
    reclaimed = reaper.reclaim_leftovers()
    if any(reclaimed.values()):
        log.info("reclaimed what killed or crashed sweeps left: %s",
                 ", ".join(f"{n} {what}" for what, n in reclaimed.items() if n))


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

    global _session_dir
    if started_here and ray.is_initialized():
        stop_autoscaler_monitor()
        ray.shutdown()
    if started_here:
        _stop_watchdog()
        if _session_dir is not None:  # Ray's own sockets and logs (the sweep's logs are in its run folder)
            shutil.rmtree(_session_dir, ignore_errors=True)
            latest = Path(_session_dir).parent / "session_latest"
            if latest.is_symlink() and not latest.exists():
                latest.unlink(missing_ok=True)
            _session_dir = None


# The script of the autoscaler monitor a local cluster runs (a child of the driver).
AUTOSCALER_MONITOR = "autoscaler/_private/monitor.py"


def stop_autoscaler_monitor() -> list[int]:
    """SIGKILL the autoscaler monitor of the local cluster this driver started; its pids.

    ray.shutdown stops the GCS before the monitor, whose SIGTERM handler then reports its
    own end to the gone GCS until Ray SIGKILLs it 1 s later: 1.0 s of the 1.4 s ray.shutdown
    takes here. A one-machine cluster has nothing to autoscale and the monitor keeps nothing,
    so it goes first (ray.init offers no way to start without it, unlike `ray start
    --no-monitor`)."""
    killed = []
    for child in psutil.Process().children():
        try:
            if any(part.endswith(AUTOSCALER_MONITOR) for part in child.cmdline()):
                child.kill()
                killed.append(child.pid)
        except psutil.Error:
            pass
    return killed
