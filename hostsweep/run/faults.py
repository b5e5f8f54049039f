"""What can go wrong with a cell besides its own error, and how long a cell may take.

The dispatcher's vocabulary: a worker hands back a CellResult, or its worker was lost
(process killed, node gone, engine dead), or Ray could not run the call. The per-cell
timeout is derived from the work a cell does, so it is never off and never tight.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Union

from hostsweep.config.grid import Cell
from hostsweep.config.schema import FaultsConfig
from hostsweep.measure.results import CellResult, MeasureOptions
from hostsweep.run.pyspy import ATTACH_GRACE_S


class EngineDied(RuntimeError):
    """Raised by a worker whose engine process is gone: the cell is retried on a new worker."""


@dataclass(frozen=True)
class WorkerLost:
    """The worker can measure no more: its process died, its node was lost, its engine died.
    `at_start`: it never got its engine running, so retrying would fail the same way."""

    reason: str
    at_start: bool = False


@dataclass(frozen=True)
class CallFailed:
    """Ray could not run or return the call (not a worker death): the cell fails."""

    reason: str


Outcome = Union[CellResult, WorkerLost, CallFailed]

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# An exception line, also behind a log prefix: "(Worker pid=7) ERROR ... ValueError: no block size".
_RAISED = re.compile(r"(?:^|[\s\]])(?:[A-Za-z_][\w]*\.)*([A-Za-z_]\w*(?:Error|Exception)): (.+)$")
# Ray's wrappers around the error a worker raised: never the cause.
_WRAPPERS = ("RayTaskError", "RayActorError", "ActorDiedError")


# pydantic's "1 validation error for CacheConfig" names the field and what it wants only on
# the lines below it (vLLM's configs are pydantic dataclasses); those lines end at its link.
_VALIDATION = re.compile(r"\d+ validation errors? for \w+$")
_VALIDATION_END = "For further information"
VALIDATION_DETAIL_CHARS = 400


def first_exception(text: str) -> Optional[str]:
    """The first exception line of `text` ('ValueError: ...'): in a chained traceback, and
    in a log where a failing process prints its error before its parent reports it, the
    root cause comes first. A pydantic validation error keeps its field and complaint."""
    lines = _ANSI.sub("", text).splitlines()
    for at, line in enumerate(lines):
        match = _RAISED.search(line.rstrip())
        if match and not match.group(1).startswith(_WRAPPERS):
            message = match.group(2).strip()
            if _VALIDATION.search(message):
                message = validation_detail(message, lines[at + 1:at + 20])
            return f"{match.group(1)}: {message}"
    return None


def validation_detail(message: str, below: list[str]) -> str:
    """'1 validation error for CacheConfig: cache_dtype='fp3': Input should be ...': the field
    and the value given first, since a console line is cut at a few hundred characters and
    the allowed values can be a long list."""
    detail: list[str] = []
    for line in below:
        text = line.strip()
        if not text or text.startswith(_VALIDATION_END):
            break
        complaint = _PYDANTIC_CONTEXT.search(text)
        if complaint and detail:  # the complaint of the field named on the line before
            field = detail.pop()
            value = _PYDANTIC_INPUT.search(complaint.group(1))
            detail.append(f"{field}={value.group(1)}" if value else field)
            text = text[:complaint.start()].strip()
        detail.append(text)
    return ": ".join([message, *detail])[:VALIDATION_DETAIL_CHARS]


_PYDANTIC_CONTEXT = re.compile(r"\[(type=[^\]]*)\]$")
_PYDANTIC_INPUT = re.compile(r"input_value=(.*?)(?:, input_type=|$)")


def root_cause(text: str) -> str:
    """first_exception of `text`, else its first line: 'RuntimeError: ...' rather than Ray's
    'The actor died because of an error raised in its creation task'."""
    lines = _ANSI.sub("", text).strip().splitlines()
    return first_exception(text) or (lines[0] if lines else "")


def decode_steps(cell: Cell, options: MeasureOptions) -> int:
    """Every decode step the worker runs for a cell (a generate of t tokens is t steps, plus
    one for its prefill): the timed pairs, the profiled pairs, the linearity sweep."""
    pair = 1 + cell.T + 2  # T=1 and T generates, each with its prefill
    # the group's warm-up may take up to measure.warmup_max_rounds rounds (measure/warmup.py)
    steps = (max(cell.warmups, options.measure.warmup_max_rounds) + cell.reps) * pair
    if options.split.enabled:
        steps += options.split.reps * pair
    lin_T = options.linearity_T
    if lin_T:
        per_t = options.linearity.reps + (1 if options.split.enabled else 0)
        steps += per_t * sum(t + 1 for t in lin_T)
    return steps


@dataclass(frozen=True)
class FaultPolicy:
    """How long cells and engine starts may take, and how often a lost cell is retried."""

    cell_timeout_s: Optional[float] = None  # None: derived from the cell (timeout_for)
    timeout_base_s: float = 600.0
    timeout_per_step_s: float = 0.25
    engine_start_timeout_s: float = 1800.0
    max_retries: int = 1
    poll_s: float = 2.0

    @classmethod
    def of(cls, faults: FaultsConfig, poll_s: float = 2.0) -> "FaultPolicy":
        return cls(faults.cell_timeout_s, faults.timeout_base_s, faults.timeout_per_step_s,
                   faults.engine_start_timeout_s, faults.max_retries, poll_s)

    def timeout_for(self, cell: Cell, options: MeasureOptions, companions: tuple[Cell, ...] = ()) -> float:
        """Seconds a cell may run once its engine is ready: the configured value, or a
        base plus a generous allowance per decode step (py-spy's sampling time on top).
        With companions (timed with the cell in interleaved rounds) their work counts too."""
        if self.cell_timeout_s is not None:
            return self.cell_timeout_s * (1 + len(companions))
        steps = decode_steps(cell, options) + sum(decode_steps(c, options) for c in companions)
        pyspy_s = 3 * options.pyspy_seconds + ATTACH_GRACE_S if options.pyspy_seconds > 0 else 0.0
        return self.timeout_base_s + self.timeout_per_step_s * steps + pyspy_s
