"""The round journal: each timed pair of a cell on disk as soon as it is measured.

A cell's timed pairs are measured over many rounds shared with its group (measure/
protocol.interleaved_rounds), and the cell is reported only once all of them are done. So
that a killed sweep loses at most the pair in progress, the worker appends every timed pair
to a file of the cell's own (written through to the OS between generates), and a rerun's
worker on the same node continues the cell from there: it times only the pairs still
missing. The file is removed once the worker hands the cell's result over (the driver
journals it at once, fsynced). The pairs are not fsynced: a killed process leaves what it
wrote in the OS's cache, and only a crash of the OS itself loses them, which costs pairs
measured again, never a wrong result (a cell is reported only with all its pairs). An fsync
per pair was the largest cost of an instant cell, twice as much as timing it.

Pairs are only resumed by an engine of the same kind: the file starts with the cell's key
and where its pairs were measured (host, device, vLLM and torch versions); a file that
differs is ignored and replaced.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Mapping, Optional, Sequence

from hostsweep.measure.protocol import Contention, RepTiming

log = logging.getLogger(__name__)

# The folder, under a study's pending folder (record/journal.pending_folder), of its cells' pairs.
ROUNDS_FOLDER = "rounds"
# What must match for pairs measured by another engine start to be continued.
FINGERPRINT_KEYS = ("hostname", "device_name", "vllm_version", "torch_version")


def fingerprint(host: Mapping[str, str]) -> dict[str, str]:
    return {k: str(host.get(k, "")) for k in FINGERPRINT_KEYS}


def _decode(line: str) -> RepTiming:
    data = json.loads(line)
    contention = data.get("contention")
    return RepTiming(**{**data, "contention": None if contention is None else Contention(**contention)})


class RoundJournal:
    """One JSON-lines file per cell under `folder`: a header, then one timed pair a line."""

    def __init__(self, folder: Path, host: Mapping[str, str]) -> None:
        self.folder = folder
        self.print = fingerprint(host)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._handles: dict[str, object] = {}

    def path(self, key: str) -> Path:
        return self.folder / f"{hashlib.sha1(key.encode()).hexdigest()[:16]}.jsonl"

    def resume(self, key: str) -> tuple[RepTiming, ...]:
        """The pairs an earlier run measured of this cell (none when there are none or they
        were measured elsewhere); a torn last line, from a kill mid-write, is dropped."""
        path = self.path(key)
        if not path.is_file():
            return ()
        lines = path.read_text().splitlines()
        try:
            header = json.loads(lines[0]) if lines else {}
        except json.JSONDecodeError:
            header = {}
        if header.get("key") != key or header.get("where") != self.print:
            log.info("%s: timed pairs left by another engine kind are not continued (%s)", key, path)
            return ()
        pairs = []
        for line in lines[1:]:
            try:
                pairs.append(_decode(line))
            except (json.JSONDecodeError, TypeError):
                break  # torn: the pair being written when the sweep was killed
        return tuple(pairs)

    def start(self, key: str, pairs: Sequence[RepTiming]) -> None:
        """Begin the cell's file anew with the pairs it continues from."""
        self.close(key)
        # A kill while the header is written leaves a torn header, which resume ignores.
        handle = self.path(key).open("w")
        handle.write("".join(json.dumps(row) + "\n" for row in
                             [{"key": key, "where": self.print}, *(asdict(p) for p in pairs)]))
        handle.flush()
        self._handles[key] = handle

    def append(self, key: str, pair: RepTiming) -> None:
        handle = self._handles[key]
        handle.write(json.dumps(asdict(pair)) + "\n")  # type: ignore[attr-defined]
        handle.flush()  # type: ignore[attr-defined]

    def close(self, key: str) -> None:
        handle = self._handles.pop(key, None)
        if handle is not None:
            handle.close()  # type: ignore[attr-defined]

    def done(self, key: str) -> None:
        """The cell's result is handed over: its pairs travel with it."""
        self.close(key)
        self.path(key).unlink(missing_ok=True)


def round_journal(folder: Optional[str], host: Mapping[str, str]) -> Optional[RoundJournal]:
    return RoundJournal(Path(folder), host) if folder else None
