"""Which RUNNING runs of a study belong to a live sweep: heartbeats, owners, claims.

A sweep's parent run carries `heartbeat` (epoch seconds, touched every
tracking.heartbeat_s) and `owner` (host:pid:process start time). Each cell it is about
to measure is claimed by a RUNNING child run, so a second sweep of the same study skips
it. A RUNNING run is stale when its sweep has no heartbeat, has not touched it for
tracking.stale_after_s, has ended, or runs on this host under a pid that is gone: its
claims are void and it is marked KILLED with the reason. These functions decide; the
tracker reads and writes the runs (liveruns.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping, Optional

import psutil

from hostsweep.config.machine import hostname

HEARTBEAT_TAG = "heartbeat"
OWNER_TAG = "owner"
PARENT_TAG = "mlflow.parentRunId"
KILLED_REASON_TAG = "killed_reason"
# A sweep's batched claims: tags claims.00000, claims.00001, ... on its parent run, each
# "<epoch ms when written>\n<cell key>\n<cell key>...".
CLAIMS_TAG = "claims."
# Parent runs of the sweeps running in this process (a multirun runs several in turn): a
# sweep of this process that is not in here has ended, whatever its heartbeat says.
LIVE_HERE: set[str] = set()


def this_owner() -> str:
    """host:pid:start time of this process: a pid alone may be reused."""
    return f"{hostname()}:{os.getpid()}:{psutil.Process().create_time():.0f}"


def owner_gone(owner: str, sweep_run_id: str = "") -> Optional[str]:
    """Why the sweep named by an owner tag is certainly gone (same host only), or None."""
    if owner == this_owner():
        return None if sweep_run_id in LIVE_HERE else "its sweep ended in this process without closing it"
    host, _, rest = owner.partition(":")
    pid, _, started = rest.partition(":")
    if host != hostname() or not pid.isdigit():
        return None
    try:
        alive = f"{psutil.Process(int(pid)).create_time():.0f}" == started
    except psutil.Error:
        alive = False
    return None if alive else f"its driver (pid {pid} on {host}) is gone"


@dataclass(frozen=True)
class RunView:
    """What staleness needs of an MLflow run."""

    run_id: str
    status: str
    tags: Mapping[str, str]
    start_time: int = 0


def sweep_stale(sweep: Optional[RunView], now: float, stale_after_s: float) -> Optional[str]:
    """Why the sweep that owns a run is no longer running, or None while it is live."""
    if sweep is None:
        return "its sweep's run is gone"
    if sweep.status != "RUNNING":
        return f"its sweep ended ({sweep.status}) without closing it"
    beat = sweep.tags.get(HEARTBEAT_TAG)
    if beat is None:
        return "its sweep never sent a heartbeat (an earlier hostsweep, or it died at once)"
    gone = owner_gone(sweep.tags.get(OWNER_TAG, ""), sweep.run_id)
    if gone:
        return gone
    age = now - float(beat)
    if age > stale_after_s:
        return f"no heartbeat for {age:.0f} s (tracking.stale_after_s={stale_after_s:.0f})"
    return None


def stale_reason(run: RunView, runs: Mapping[str, RunView], now: float, stale_after_s: float) -> Optional[str]:
    """Why a RUNNING run (a sweep's parent, or a cell run claimed by one) is stale, or None."""
    sweep = run if PARENT_TAG not in run.tags else runs.get(run.tags[PARENT_TAG])
    return sweep_stale(sweep, now, stale_after_s)


def claim_winner(claims: list[RunView]) -> RunView:
    """Of several live claims on one cell, the earliest (ties by run id): every sweep that
    sees the same claims picks the same one."""
    return min(claims, key=lambda r: (r.start_time, r.run_id))


def claim_batches(keys: Iterable[str], first: int, tags_per_batch: int,
                  value_limit: int) -> Iterator[list[tuple[str, list[str]]]]:
    """The claims.<n> tags (name, keys) for `keys`, numbered from `first`, each value (the
    time stamp line and the keys, newline separated) within value_limit characters, in
    batches of at most tags_per_batch tags. Holds one batch of keys at a time."""
    batch: list[tuple[str, list[str]]] = []
    chunk: list[str] = []
    size = 14  # "<13-digit epoch ms>\n"
    number = first
    for key in keys:
        if chunk and size + len(key) + 1 > value_limit:
            batch.append((f"{CLAIMS_TAG}{number:05d}", chunk))
            number, chunk, size = number + 1, [], 14
            if len(batch) == tags_per_batch:
                yield batch
                batch = []
        chunk.append(key)
        size += len(key) + 1
    if chunk:
        batch.append((f"{CLAIMS_TAG}{number:05d}", chunk))
    if batch:
        yield batch


def parse_claims(tags: Mapping[str, str]) -> Iterator[tuple[int, str]]:
    """(claim time in epoch ms, cell key) for every key in a sweep's claims.<n> tags."""
    for name, value in tags.items():
        if name.startswith(CLAIMS_TAG):
            stamp, _, keys = value.partition("\n")
            claimed_at = int(stamp) if stamp.isdigit() else 0
            for key in keys.split("\n"):
                if key:
                    yield claimed_at, key
