"""py-spy thread-state view of the engine process tree (the host-exposed-latency
paper [1], §2.4, README.md#references), parsed (pure).

Two py-spy recordings run side by side over the same generates: one with --idle (every
thread, every sample) and one without (only samples where the thread was running). Per
process and thread, active_frac = active samples / all samples; the leaf frames of the
idle samples say what the thread was waiting in (socket poll, queue, sched_yield…).
This is a thread-state distribution, not a critical-path apportionment of the step.
"""
from __future__ import annotations

import re
from collections import Counter

import pandas as pd

_PROCESS = re.compile(r'^process (\d+):"(.*)"$')
_THREAD = re.compile(r"^thread \((\d+)\): ?(.*)$")


def parse_raw(text: str) -> Counter:
    """Sample counts per (pid, process command, thread, leaf frame) of py-spy raw output."""
    counts: Counter = Counter()
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        pid, command, thread, frames = "?", "?", "?", []
        for segment in stack.split(";"):
            if (m := _PROCESS.match(segment)):
                pid, command = m.group(1), m.group(2).split()[0] if m.group(2) else "?"
            elif (m := _THREAD.match(segment)):
                thread = m.group(2) or m.group(1)
            else:
                frames.append(segment)
        leaf = frames[-1].split(" (")[0] if frames else "?"
        counts[(pid, command, thread, leaf)] += int(count)
    return counts


def label_process(text: str, pid: int, command: str) -> str:
    """A recording of one process (py-spy without --subprocesses has no process frame) with
    the frame --subprocesses would have put first, so recordings of several processes parse
    as one."""
    name = (command.split() or ["?"])[0].replace(";", "_").replace('"', "")
    return "".join(f'process {pid}:"{name}";{line}\n' for line in text.splitlines() if line.strip())


def thread_states(all_samples: str, active_samples: str) -> pd.DataFrame:
    """One row per (process, thread): samples, active share, and the top idle leaf."""
    every, active = parse_raw(all_samples), parse_raw(active_samples)
    rows: dict[tuple[str, str, str], dict] = {}
    for (pid, command, thread, leaf), n in every.items():
        row = rows.setdefault((pid, command, thread), {"samples": 0, "active": 0, "idle_leaves": Counter()})
        row["samples"] += n
    for (pid, command, thread, leaf), n in active.items():
        if (pid, command, thread) in rows:
            rows[(pid, command, thread)]["active"] += n
    for (pid, command, thread, leaf), n in every.items():
        rows[(pid, command, thread)]["idle_leaves"][leaf] += max(0, n - active.get((pid, command, thread, leaf), 0))
    records = []
    for (pid, command, thread), row in rows.items():
        active_n = min(row["active"], row["samples"])
        top = row["idle_leaves"].most_common(1)
        records.append({"pid": pid, "process": command, "thread": thread, "samples": row["samples"],
                        "active_frac": active_n / row["samples"] if row["samples"] else 0.0,
                        "top_idle_leaf": top[0][0] if top and top[0][1] > 0 else ""})
    columns = ["pid", "process", "thread", "samples", "active_frac", "top_idle_leaf"]
    return pd.DataFrame(records, columns=columns).sort_values("samples", ascending=False, ignore_index=True)


def idle_fraction(table: pd.DataFrame) -> float:
    """Share of all thread samples in the tree that were idle (waiting)."""
    total = table["samples"].sum()
    return float((table["samples"] * (1 - table["active_frac"])).sum() / total) if total else float("nan")
