"""Preflight: the checks that look at the world before Ray or vLLM start, each a one-line
ConfigError within seconds (the CLI exits 2).

config.validation has already checked the config itself; these ask whether the things it
names exist and answer: the Ray cluster, the tracking store, the run directory, the
checkpoint (a packaged model's built here), this machine's GPUs, whether another sweep already measures here, and (once the
grid is built) whether its engines fit the node's memory.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import socket
import tempfile
from pathlib import Path
from typing import IO, Optional
from urllib.parse import urlsplit

import psutil

from hostsweep.config.grid import Cell, group_by_engine, rounds_partners, runnable
from hostsweep.config.machine import local_sku_name
from hostsweep.config.memory import GIB, live_together, memory_plan
from hostsweep.config.resolve import Study
from hostsweep.config.schema import ConfigError
from hostsweep.engines.packaged import PackagedModelError, is_built, packaged_checkpoint
from hostsweep.record.store import check_store_answers, check_writable_folder
from hostsweep.run.cluster import InfeasiblePlan, check_address_answers

log = logging.getLogger(__name__)

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
HUB_TIMEOUT_S = 3.0
# One local-cluster sweep per machine at a time (ray.exclusive): engines sharing cores
# would change what each measures.
MACHINE_LOCK = Path(tempfile.gettempdir()) / "hostsweep-local-cluster.lock"


def check_run_dir(run_dir: Path) -> None:
    check_writable_folder(run_dir, "hydra.run.dir")
    probe = run_dir / ".hostsweep-write-probe"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"hydra.run.dir={run_dir}: cannot write there ({exc.strerror or exc})") from None


def _hub_reachable(timeout_s: float) -> Optional[str]:
    """None if the model hub answers; else why not."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return "HF_HUB_OFFLINE is set"
    endpoint = urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        with socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=timeout_s):
            return None
    except OSError as exc:
        return f"{endpoint.hostname} does not answer: {exc.strerror or exc}"


def _hub_cached(hub_id: str) -> bool:
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    return (home / "hub" / f"models--{hub_id.replace('/', '--')}").is_dir()


def check_checkpoint(path: Optional[str]) -> None:
    """A local checkpoint is a folder with a config.json; a hub id needs the hub (or its cache)."""
    if not path:
        return
    local = Path(path).expanduser()
    looks_local = path.startswith(("/", ".", "~")) or local.exists()
    if looks_local:
        if not (local / "config.json").is_file():
            what = "does not exist" if not local.exists() else "has no config.json"
            raise ConfigError(f"model.path={path} {what}; give a checkpoint folder (with config.json) or a hub id")
        return
    if not HUB_ID.fullmatch(path):
        raise ConfigError(f"model.path={path} is neither a folder nor a hub id (org/name)")
    if _hub_cached(path):
        return
    why = _hub_reachable(HUB_TIMEOUT_S)
    if why:
        raise ConfigError(f"model.path={path} is a hub id and this machine has no hub access ({why}); "
                          "download it where there is and give model.path=<folder>")


def check_local_gpus(study: Study) -> None:
    """Without ray.address the sweep runs here: every SKU it names must be this machine's."""
    if study.config.ray.address:
        return
    here = local_sku_name()
    for sku in study.skus:
        if sku.accelerator_type is not None and sku.name != here:
            raise ConfigError(
                f"sku={sku.name} needs {sku.accelerator_type} GPUs but this machine has none "
                f"(it is a {here} machine) and ray.address is not set; join a cluster that has them "
                "with ray.address=auto or ray.address=ray://<head>:10001")


def kill_leftovers(previous: dict) -> int:
    """Kill the Ray processes a killed sweep left running (its driver cannot stop them after
    kill -9; Ray's own take minutes to notice). Only processes still matching the pid and
    start time recorded in the lock are touched. Returns how many were killed."""
    killed = 0
    for pid, started in previous.get("daemons", []):
        try:
            proc = psutil.Process(pid)
            if f"{proc.create_time():.2f}" == started:
                proc.kill()
                killed += 1
        except psutil.Error:
            pass
    return killed


def record_cluster(lock: Optional[IO[str]], pids: list[int]) -> None:
    """Note the local cluster's processes in the machine lock, for kill_leftovers."""
    if lock is None:
        return
    daemons = []
    for pid in pids:
        try:
            daemons.append([pid, f"{psutil.Process(pid).create_time():.2f}"])
        except psutil.Error:
            pass
    lock.seek(0)
    info = json.loads(lock.read() or "{}")
    lock.seek(0)
    lock.truncate()
    lock.write(json.dumps({**info, "daemons": daemons}))
    lock.flush()


def lock_machine(study: Study, run_dir: Path) -> Optional[IO[str]]:
    """The machine-wide lock of a local-cluster sweep (held until the returned file is
    closed, or the process dies); ConfigError naming the sweep that holds it. Processes
    a killed previous holder left are killed."""
    cfg = study.config
    if cfg.ray.address or not cfg.ray.exclusive:
        return None
    handle = MACHINE_LOCK.open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "{}"
        handle.close()
        info = json.loads(holder) if holder.startswith("{") else {}
        raise ConfigError(
            f"another sweep (pid {info.get('pid', '?')}, study {info.get('study', '?')}, run dir "
            f"{info.get('run_dir', '?')}) is measuring on this machine; wait for it, or set ray.exclusive=false "
            "to measure beside it (both sweeps' timings would suffer)") from None
    handle.seek(0)
    try:
        previous = json.loads(handle.read() or "{}")
    except ValueError:
        previous = {}
    killed = kill_leftovers(previous)
    if killed:
        log.warning("killed %d Ray process(es) left running by a killed sweep (pid %s)", killed, previous.get("pid"))
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({"pid": os.getpid(), "study": cfg.study, "run_dir": str(run_dir)}))
    handle.flush()
    return handle


def preflight(study: Study, run_dir: Path) -> Optional[IO[str]]:
    """Every check that can refuse the sweep before Ray starts; returns the machine lock."""
    cfg = study.config
    check_run_dir(run_dir)
    for model in study.models:
        if model.source == "checkpoint":
            check_checkpoint(model.path)
    check_local_gpus(study)
    if cfg.ray.address:
        check_address_answers(cfg.ray.address)
    check_store_answers(cfg.tracking.uri)
    if not cfg.ray.address and cfg.engine.name == "vllm":
        build_packaged_models(study)
    return lock_machine(study, run_dir)


def build_packaged_models(study: Study) -> None:
    """A packaged model's checkpoint built here before Ray starts, on a local cluster (whose
    node is this machine), so a package that cannot be fetched or read is one line now, not
    an engine failure later; a joined cluster's workers build it on their own nodes."""
    for model in study.models:
        if model.source != "package" or model.path is None or is_built(model.path):
            continue
        log.info("model %s: building its checkpoint from %s (once per machine, about a minute)", model.name, model.path)
        try:
            packaged_checkpoint(model.path)
        except PackagedModelError as exc:
            raise ConfigError(f"model={model.name}: {exc}") from None


def check_memory(study: Study, grid: list[Cell]) -> None:
    """The plan's memory line (config/memory.py), and InfeasiblePlan in one line where the
    engines do not fit, before Ray or an engine starts. A local cluster's node is this machine
    (its free memory now); a joined cluster's nodes are not known yet, so only the GPU check runs."""
    cells = runnable(grid)
    specs = [spec for spec in group_by_engine(cells) if spec.engine == "vllm"]
    if not specs:
        return
    cfg = study.config
    free = None if cfg.ray.address else psutil.virtual_memory().available / GIB
    plan = memory_plan(live_together(specs, rounds_partners(cells)), free,
                       {sku.name: sku.device_memory_gib for sku in study.skus}, cfg.engine.gpu_memory_utilization)
    log.info("%s", plan.line)
    if plan.refusal is not None:
        raise InfeasiblePlan(plan.refusal)
