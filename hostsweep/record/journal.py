"""The run directory's journal: every measured cell, written before MLflow hears of it.

`journal.jsonl` is append-only JSON lines: a "measured" entry holds everything needed to
log the cell to MLflow again (its result, tags and the MLflow run that claims it); a
"logged" entry follows once MLflow has it. While its sweep runs the journal is locked
(flock, released by the kernel even on kill -9). A pointer under the pending folder
names every journal that may hold unlogged cells, so the next sweep of the same
experiment (or the same store) finds and uploads them before it measures anything.
"""
from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import logging
import os
import threading
import uuid
from dataclasses import asdict
from io import StringIO
from pathlib import Path
from typing import IO, Iterator, Optional

import pandas as pd

from hostsweep.config.schema import ConfigError
from hostsweep.measure.protocol import CellMeasurement, Contention, RepTiming
from hostsweep.measure.results import CellResult
from hostsweep.measure.speculative import SpecResult
from hostsweep.measure.phases import PhaseSplit
from hostsweep.measure.split import LinearityResult, SplitResult
from hostsweep.measure.periods import DesignRecord
from hostsweep.measure.stability import ContentionSummary, Stability
from hostsweep.run.rounds import ROUNDS_FOLDER

log = logging.getLogger(__name__)

JOURNAL_FILE = "journal.jsonl"


def encode_result(result: CellResult) -> dict[str, object]:
    """A CellResult as JSON-ready data (traces base64, thread states as a split frame)."""
    data = asdict(result)
    data["traces"] = {name: base64.b64encode(blob).decode() for name, blob in result.traces.items()}
    data["thread_states"] = None if result.thread_states is None else result.thread_states.to_json(orient="split")
    return data


def decode_result(data: dict) -> CellResult:
    """The CellResult encode_result wrote."""
    m = data["measurement"]
    measurement = None if m is None else CellMeasurement(**{**m, "reps": decode_timings(m["reps"])})
    sp = data["split"]
    split = None if sp is None else SplitResult(**{**sp, "per_rank_device_ms": tuple(sp["per_rank_device_ms"]),
                                                   "top_ops": tuple(tuple(op) for op in sp["top_ops"]),
                                                   "phases": decode_phases(sp.get("phases")),
                                                   "implausible": tuple(sp.get("implausible", ())),
                                                   "per_rank_allreduce_ms": tuple(sp.get("per_rank_allreduce_ms", ())),
                                                   **{k: _pair(sp.get(k)) for k in SPLIT_CIS}})
    lin = data["linearity"]
    linearity = None if lin is None else LinearityResult(**{**lin, **{k: tuple(lin[k]) for k in
                                                                       ("tokens", "wall_ms", "kernel_ms")}})
    states = data["thread_states"]
    spec = data.get("spec")
    return CellResult(
        key=data["key"], params=data["params"], status=data["status"], measurement=measurement, error=data["error"],
        host=data["host"], duration_s=data["duration_s"], split=split, linearity=linearity,
        traces={name: base64.b64decode(blob) for name, blob in data["traces"].items()},
        thread_states=None if states is None else pd.read_json(StringIO(states), orient="split"),
        spec=None if spec is None else SpecResult(**spec),
        attempt=data.get("attempt", 1), retry_reasons=tuple(data.get("retry_reasons", ())),
        stability=decode_stability(data.get("stability")),
        earlier_timings=tuple(decode_timings(reps) for reps in data.get("earlier_timings", ())),
    )


SPLIT_CIS = ("device_ci", "host_ci", "host_frac_ci", "profiled_step_ci", "allreduce_insitu_ci")


def _pair(value: Optional[list]) -> Optional[tuple]:
    return None if value is None else tuple(value)


def decode_phases(data: Optional[dict]) -> Optional[PhaseSplit]:
    if data is None:
        return None
    return PhaseSplit(**{**data, "ci_ms": {name: tuple(ci) for name, ci in data.get("ci_ms", {}).items()},
                         "forward_compute_ci": _pair(data.get("forward_compute_ci"))})


def decode_timings(reps: list[dict]) -> tuple[RepTiming, ...]:
    """Timed pairs as encode_result wrote them (entries before contention records had none)."""
    return tuple(RepTiming(**{**r, "contention": None if r.get("contention") is None else Contention(**r["contention"])})
                 for r in reps)


def decode_stability(data: Optional[dict]) -> Optional[Stability]:
    if data is None:
        return None
    contention = data.get("contention")
    design = data.get("design")
    # journals written before the annotations kept machine_speed and replicate among the reasons
    flags = (*data["reasons"], *data.get("annotations", ()))
    verdict = Stability((), data["attempts"],
                        None if contention is None else ContentionSummary(**contention), data.get("replicate_step_ms"),
                        tuple(data.get("start_medians_ms", ())),
                        None if design is None else DesignRecord(**{**design, **{
                            key: tuple(design.get(key, ())) for key in ("period_medians_ms", "remeasured_for")}}))
    for flag in flags:
        verdict = verdict.with_reason(flag)
    return verdict


def pending_folder(root: Path, tracking_uri: str, experiment: str) -> Path:
    """Where pointers to journals with unlogged cells of one experiment in one store live."""
    store = hashlib.sha1(tracking_uri.encode()).hexdigest()[:10]
    return root / f"{experiment}-{store}"


def read_entries(path: Path) -> list[dict]:
    """The journal's entries; a line cut short by a crash mid-write is skipped."""
    entries = []
    for line in path.read_text().splitlines():
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("%s: skipping a truncated line", path)
    return entries


def unlogged(entries: list[dict]) -> list[dict]:
    """The "measured" entries no "logged" entry follows."""
    logged = {e["entry"] for e in entries if e["event"] == "logged"}
    return [e for e in entries if e["event"] == "measured" and e["entry"] not in logged]


def _torn(path: Path) -> bool:
    """Whether the file's last line was cut short (it does not end in a newline)."""
    with path.open("rb") as raw:
        if raw.seek(0, os.SEEK_END) == 0:
            return False
        raw.seek(-1, os.SEEK_END)
        return raw.read(1) != b"\n"


def _lock(handle: IO[str]) -> bool:
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


class Journal:
    """A locked journal file: this sweep's own (`Journal.create`), or one an earlier sweep
    left with unlogged cells (`Journal.orphans`), being uploaded."""

    def __init__(self, path: Path, handle: IO[str], pointer: Path) -> None:
        self.path, self.handle, self.pointer = path, handle, pointer
        self.lock = threading.Lock()  # measured (driver loop) and logged (uploader) interleave
        # Measured entries written, and how many of them the last fsync covered (sync).
        self.sync_lock = threading.Lock()
        self.written = self.synced = 0

    @classmethod
    def create(cls, path: Path, pending: Path) -> "Journal":
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = path.open("a+")
        if not _lock(handle):
            handle.close()
            raise ConfigError(f"hydra.run.dir={path.parent} is in use by another running sweep; "
                              "give each sweep its own run directory")
        if _torn(path):  # an earlier sweep here died mid-line: the next entry starts a line of its own
            handle.write("\n")
            handle.flush()
        pending.mkdir(parents=True, exist_ok=True)
        pointer = pending / f"{uuid.uuid4().hex}.json"
        pointer.write_text(json.dumps({"journal": str(path.resolve()), "pid": os.getpid()}))
        return cls(path, handle, pointer)

    @classmethod
    def orphans(cls, pending: Path, own: Optional["Journal"] = None) -> Iterator["Journal"]:
        """Each journal under `pending` that no live sweep holds; stale pointers removed.
        A pointer to `own` (this sweep's journal, which an earlier sweep in the same run
        directory left) is stale too: own's pointer covers the file, and own uploads it."""
        mine = own.path.resolve() if own is not None else None
        for pointer in sorted(pending.glob("*.json")) if pending.is_dir() else []:
            try:
                path = Path(json.loads(pointer.read_text())["journal"])
            except (OSError, ValueError, KeyError):
                continue
            if not path.is_file() or (path == mine and pointer != own.pointer):  # type: ignore[union-attr]
                pointer.unlink(missing_ok=True)
                continue
            if path == mine:
                continue
            handle = path.open("a+")
            if not _lock(handle):  # its sweep is still running
                handle.close()
                continue
            yield cls(path, handle, pointer)

    def _append(self, entry: dict, measured: bool) -> None:
        """Written through to the OS at once (a killed process loses nothing); on disk, for an
        OS crash, only at the next sync()."""
        with self.lock:
            self.handle.write(json.dumps(entry) + "\n")
            self.handle.flush()
            if measured:
                self.written += 1

    def sync(self) -> None:
        """Put every measured entry written so far on disk (one fsync for all of them). Called
        before MLflow is asked for a batch of cells, so MLflow never has a cell its journal
        could lose; an fsync per cell on the driver's loop paced a sweep of fast cells."""
        with self.sync_lock:
            written = self.written  # each of these entries is flushed: the fsync covers it
            if self.synced >= written:
                return
            os.fsync(self.handle.fileno())
            self.synced = written

    def measured(self, result: CellResult, run_id: Optional[str], tags: dict[str, str],
                 planned_run_id: Optional[str] = None) -> str:
        """The cell's entry id. `planned_run_id`: the run it will be written into (a
        database store), which an upload after a crash writes it into too."""
        entry = uuid.uuid4().hex
        self._append({"event": "measured", "entry": entry, "run_id": run_id, "tags": tags,
                      "result": encode_result(result), "planned_run_id": planned_run_id}, measured=True)
        return entry

    def logged(self, entry: str, run_id: str) -> None:
        """MLflow has the entry's cell. Never fsynced: an OS crash that loses it only makes
        the next sweep find the cell's run by its entry tag (SweepTracker.upload) instead of
        skipping it."""
        self._append({"event": "logged", "entry": entry, "run_id": run_id}, measured=False)

    def unlogged(self) -> list[dict]:
        return unlogged(read_entries(self.path))

    def close(self) -> int:
        """Unlock; drop the pointer when MLflow has every cell. Returns the unlogged count."""
        self.sync()
        left = len(self.unlogged())
        if left == 0:
            self.pointer.unlink(missing_ok=True)
            # the study's pending folder and its workers' round files, when nothing is left in
            # them (rmdir refuses a folder that is not empty: a running sweep's stay)
            for folder in (self.pointer.parent / ROUNDS_FOLDER, self.pointer.parent):
                try:
                    folder.rmdir()
                except OSError:
                    pass
        self.handle.close()
        return left
