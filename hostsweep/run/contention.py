"""The contention record of a timed pair: what the rest of the machine did meanwhile.

Foreign CPU is the machine's busy CPU time over the pair (/proc/stat) minus what this
sweep's own processes used (psutil): the engine's process tree (the worker, its EngineCore
and ranks) and the sweep's Ray daemons and driver. What remains is a neighbour: another
user's job, a build, a test suite. Steal time is the hypervisor running other guests. The
probe reads counters only between generates, never inside a timed one.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import psutil

from hostsweep.measure.protocol import Contention

# /proc/stat's cpu line: user nice system idle iowait irq softirq steal guest guest_nice.
# Busy is what a process or the kernel ran on a CPU; guest time is already inside user.
_BUSY_FIELDS, _STEAL_FIELD = (0, 1, 2, 5, 6), 7


def _proc_stat_ticks() -> Optional[tuple[float, float]]:
    """(busy, steal) CPU seconds of the whole machine since boot; None without /proc/stat."""
    try:
        first = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    ticks = [float(v) for v in first[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    steal = ticks[_STEAL_FIELD] if len(ticks) > _STEAL_FIELD else 0.0
    return sum(ticks[i] for i in _BUSY_FIELDS if i < len(ticks)) / hz, steal / hz


def _cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for proc in processes:
        try:
            times = proc.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue  # gone meanwhile: its time left the machine's total with it
        total += times.user + times.system
    return total


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def sweep_root_pid() -> int:
    """The process whose tree is this sweep. A Ray worker's parent is the raylet, started
    by the driver of a local cluster (whose tree holds the GCS, the dashboard and the
    driver's own threads) or by `ray start` on a real cluster (then re-parented to init:
    the raylet's tree is the sweep's part of the node). Outside Ray: the worker's own tree."""
    me = psutil.Process()
    try:
        parent = me.parent()
        if parent is None or "raylet" not in parent.name():
            return me.pid
        driver = parent.parent()
    except psutil.Error:
        return me.pid
    return driver.pid if driver is not None and driver.pid > 1 else parent.pid


@dataclass
class _Mark:
    wall: float
    busy_s: float
    steal_s: float
    engine_s: float
    own_s: float


class ContentionProbe:
    """Marks the start of a pair and measures the contention at its end."""

    def __init__(self, engine_root: int, sweep_root: int) -> None:
        self.engine_root, self.sweep_root = engine_root, sweep_root
        self.cpus = psutil.cpu_count() or 1
        self.available = _proc_stat_ticks() is not None
        self._engine: list[psutil.Process] = []
        self._others: list[psutil.Process] = []
        self.refresh()

    def refresh(self) -> None:
        """Find the processes again (an engine may have started ranks, Ray a new daemon):
        once per round, since walking the process table costs milliseconds."""
        self._engine = _tree(self.engine_root)
        engine_pids = {p.pid for p in self._engine}
        self._others = [p for p in _tree(self.sweep_root) if p.pid not in engine_pids]

    def mark(self) -> Optional[_Mark]:
        stat = _proc_stat_ticks()
        if stat is None:
            return None
        engine = _cpu_seconds(self._engine)
        return _Mark(time.monotonic(), stat[0], stat[1], engine, engine + _cpu_seconds(self._others))

    def since(self, start: Optional[_Mark]) -> Optional[Contention]:
        end = self.mark()
        if start is None or end is None:
            return None
        capacity = max(end.wall - start.wall, 1e-6) * self.cpus
        foreign = (end.busy_s - start.busy_s) - (end.own_s - start.own_s)
        # Counters tick at 100 Hz: over a short pair the difference can dip below zero.
        return Contention(
            foreign_cpu_frac=min(1.0, max(0.0, foreign / capacity)),
            engine_cpu_frac=min(1.0, max(0.0, (end.engine_s - start.engine_s) / capacity)),
            steal_frac=min(1.0, max(0.0, (end.steal_s - start.steal_s) / capacity)),
            load1=os.getloadavg()[0],
        )
