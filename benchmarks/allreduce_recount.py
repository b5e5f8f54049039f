"""The in-situ all-reduce of a run's kept traces counted both ways: gloo's `c10d::allreduce_`
op alone (its enqueue: how hostsweep counted it before) and to the end of its reduction on
gloo's thread (measure/traces.totals, now), per profiled pair and rank, per step and per op.

    python benchmarks/allreduce_recount.py RUN_DIR/journal.jsonl

The run must have kept its traces (`split.keep_traces=true`), at TP > 1.
"""
from __future__ import annotations

import argparse
import base64
import gzip
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hostsweep.measure.traces import GLOO_ALLREDUCE_OP, totals  # noqa: E402

TRACE_NAME = re.compile(r"p(\d+)_.*_T(\d+)_rank(\d+)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("journal", type=Path, help="a run's journal.jsonl (split.keep_traces=true)")
    args = parser.parse_args()
    for line in args.journal.read_text().splitlines():
        result = json.loads(line).get("result") or {}
        counts: dict[tuple[int, int, int], tuple[float, float, int]] = {}
        for name, blob in (result.get("traces") or {}).items():
            if not (match := TRACE_NAME.match(name)):
                continue
            events = json.loads(gzip.decompress(base64.b64decode(blob)))["traceEvents"]
            enqueue = sum(e["dur"] for e in events if e.get("name") == GLOO_ALLREDUCE_OP and e.get("cat") == "cpu_op")
            total = totals({"traceEvents": events})
            pair, steps, rank = (int(g) for g in match.groups())
            counts[(pair, rank, steps)] = (enqueue, total.allreduce_us, total.allreduce_count)
        for pair, rank, steps in sorted(k for k in counts if k[2] > 1):
            enqueue, full, calls = counts[(pair, rank, steps)]
            enqueue1, full1, calls1 = counts[(pair, rank, 1)]
            per_step = (calls - calls1) / (steps - 1)
            before, after = (enqueue - enqueue1) / (steps - 1) / 1e3, (full - full1) / (steps - 1) / 1e3
            print(f"{result.get('key', '?')} pair {pair} rank {rank}: enqueue only {before:.2f} ms a step "
                  f"({before / per_step:.2f} an op); to the end of gloo's run {after:.2f} ms a step "
                  f"({after / per_step:.2f} an op); {per_step:.1f} all-reduces a step")


if __name__ == "__main__":
    main()
