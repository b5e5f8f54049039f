"""Is the engine alive? The worker watches the processes its engine started.

vLLM runs the model in an EngineCore process (and TP ranks below it). When one dies, the
engine's client may log "engine core exited unexpectedly" and then block in generate
forever, so the worker cannot wait for an error: it records the engine's processes right
after the engine starts and answers `fault()` from another thread. Its direct children
are waited on with WNOWAIT (the status is read, the process left for vLLM to reap), which
gives the exit code or signal; when vLLM reaps first, the exit code comes from the
multiprocessing handle that started the process. Deeper processes are only seen to be gone.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from typing import Iterable, Optional

import psutil

log = logging.getLogger(__name__)

# vLLM names its processes (setproctitle): VLLM::EngineCore, VLLM::Worker, VLLM::Worker_TP1...
ENGINE_PROCESS_PREFIXES = ("VLLM::",)
# multiprocessing's resource tracker is started beside the engine but serves the worker.
NOT_ENGINE = ("multiprocessing.resource_tracker",)


def process_title(proc: psutil.Process) -> str:
    """The name a process gave itself: vLLM's title (VLLM::EngineCore, set by setproctitle)
    from its kernel name or its command line, whichever shows it, else psutil's name. Each
    alone has missed it in clean-clone CI runs: the command line still the interpreter's
    path, or the kernel's name still `python`. Raises psutil.Error for a process gone."""
    name = proc.name()
    if name.startswith(ENGINE_PROCESS_PREFIXES):
        return name
    try:
        command = proc.cmdline()
    except psutil.Error:
        return name
    first = command[0].strip() if command else ""
    return first if first.startswith(ENGINE_PROCESS_PREFIXES) else name


def process_label(proc: psutil.Process) -> str:
    """process_title, or "?" for a process already gone."""
    try:
        return process_title(proc)
    except psutil.Error:
        return "?"


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def engine_processes(worker_pid: int, before: Iterable[int]) -> list[psutil.Process]:
    """The processes an engine started below the worker: the named vLLM ones where there
    are any, else the worker's new direct children (less multiprocessing's helpers)."""
    known = set(before)
    try:
        new = [p for p in psutil.Process(worker_pid).children(recursive=True) if p.pid not in known]
    except psutil.Error:
        return []
    named = [p for p in new if process_label(p).startswith(ENGINE_PROCESS_PREFIXES)]
    if named:
        return named
    return [p for p in new if p.ppid() == worker_pid and not any(n in _cmdline(p) for n in NOT_ENGINE)]


def describe_exit(code: int, status: int) -> str:
    """'killed by signal 9 (SIGKILL)' or 'exited with code 1', from waitid's si_code/si_status."""
    if code in (os.CLD_KILLED, os.CLD_DUMPED):
        try:
            name = signal.Signals(status).name
        except ValueError:
            name = "unknown"
        return f"killed by signal {status} ({name})"
    return f"exited with code {status}"


class EngineWatch:
    """The engine's processes, and why the first of them that died is gone."""

    def __init__(self, processes: list[psutil.Process]) -> None:
        self.processes = {p.pid: (p, process_label(p)) for p in processes}
        self.exits: dict[int, str] = {}
        # The handles multiprocessing keeps of the children it started (vLLM's EngineCore):
        # their exitcode survives the reaping that races the waiters below.
        self.handles = {child.pid: child for child in multiprocessing.active_children() if child.pid in self.processes}
        self.closing = False
        own = os.getpid()
        for proc in processes:
            if proc.ppid() == own:
                threading.Thread(target=self._wait, args=(proc.pid,), daemon=True,
                                 name=f"engine-watch-{proc.pid}").start()

    def _wait(self, pid: int) -> None:
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:  # reaped by someone else first: _exitcode may still know
            return
        if info is not None:
            self.exits[pid] = describe_exit(info.si_code, info.si_status)

    def _alive(self, proc: psutil.Process) -> bool:
        try:
            return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def fault(self) -> Optional[str]:
        """None while every engine process lives (or the engine is being closed on
        purpose); else which one died and how."""
        if self.closing:
            return None
        for pid, (proc, name) in self.processes.items():
            if pid not in self.exits and self._alive(proc):
                continue
            if pid not in self.exits:
                time.sleep(0.2)  # a direct child's waiter may be about to record its status
            return f"{name} (pid {pid}) {self.exits.get(pid) or self._exitcode(pid) or 'is gone'}"
        return None

    def _exitcode(self, pid: int) -> Optional[str]:
        """How a child multiprocessing started ended, from its handle (negative: a signal)."""
        handle = self.handles.get(pid)
        code = handle.exitcode if handle is not None else None
        if code is None:
            return None
        return describe_exit(os.CLD_KILLED, -code) if code < 0 else describe_exit(os.CLD_EXITED, code)

    def wait_gone(self, timeout_s: float) -> list[str]:
        """Wait until every engine process has exited (a process's memory, a GPU's included,
        is freed before it is a zombie), at most timeout_s; SIGKILL the ones still there and
        return their names. Polled, never waited on: vLLM reaps its own children."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not any(self._alive(proc) for proc, _ in self.processes.values()):
                return []
            time.sleep(0.01)
        left = [f"{name} (pid {proc.pid})" for proc, name in self.processes.values() if self._alive(proc)]
        self.kill()
        return left

    def kill(self) -> None:
        """SIGKILL whatever is left of the engine (the worker is being replaced)."""
        self.closing = True
        for proc, name in self.processes.values():
            try:
                proc.kill()
            except psutil.Error:
                pass
