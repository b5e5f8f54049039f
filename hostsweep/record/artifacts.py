"""The tables a cell run carries as artifacts: its raw timings, its top ops, its linearity
sweep, as CSV text. Written with the csv module: a cell's tables are a few rows, and
building a DataFrame to print them cost an instant cell more than recording it."""
from __future__ import annotations

import csv
import io
from dataclasses import asdict
from typing import Mapping, Sequence

from hostsweep.measure.protocol import RepTiming
from hostsweep.measure.results import CellResult


def csv_text(rows: Sequence[Mapping[str, object]]) -> str:
    """Rows as CSV with a header: the columns in the order they first appear, a value a row
    lacks left empty (as pandas' to_csv of the same rows, which read_csv reads back)."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    out = io.StringIO()
    writer = csv.DictWriter(out, columns, restval="", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def _timing_rows(reps: Sequence[RepTiming]) -> list[dict[str, object]]:
    """One row per timed pair: its walls and step, the engine start (replicate), period and
    round it ran in, the speed canary timed beside it (and its GPU kernel's time, where the
    worker has a CUDA device; empty otherwise), its paired round (pair.design=rounds: the
    partner cell's pair of the same round has the same id), and its contention record (empty where
    the machine could not be observed). The diff reads `replicate` back to resample engine
    starts, then pairs within each (compare/cellwise.py)."""
    rows = []
    for r in reps:
        row: dict[str, object] = {"rep": r.rep, "t1_first": r.t1_first, "wall_1_ms": r.wall_1_s * 1e3,
                                  "wall_T_ms": r.wall_T_s * 1e3, "step_ms": r.step_s * 1e3, "round": r.round,
                                  "replicate": r.replicate, "period": r.period,
                                  "canary_ms": "" if r.canary_ms is None else r.canary_ms,
                                  "gpu_canary_ms": "" if r.gpu_canary_ms is None else r.gpu_canary_ms,
                                  "pair_round": r.pair_round}
        row.update(asdict(r.contention) if r.contention is not None else {})
        rows.append(row)
    return rows


def timings_table(result: CellResult) -> str:
    """The raw per-rep timings of a cell as CSV (the reported attempt's)."""
    assert result.measurement is not None
    return csv_text(_timing_rows(result.measurement.reps))


def earlier_timings_table(result: CellResult) -> str:
    """The timed pairs of the attempts a re-measure replaced, with their attempt number."""
    return csv_text([{**row, "attempt": n} for n, reps in enumerate(result.earlier_timings, 1)
                     for row in _timing_rows(reps)])


def top_ops_table(result: CellResult) -> str:
    """Ops/kernels by time per decode step, from the differenced profiled pair."""
    assert result.split is not None
    return csv_text([{"op": op, "ms_per_step": ms, "share_of_device": ms / result.split.device_ms}
                     for op, ms in result.split.top_ops])


def linearity_table(result: CellResult) -> str:
    assert result.linearity is not None
    lin = result.linearity
    kernel = lin.kernel_ms or [None] * len(lin.tokens)
    return csv_text([{"T": t, "wall_ms": wall, **({"kernel_ms": k} if lin.kernel_ms else {})}
                     for t, wall, k in zip(lin.tokens, lin.wall_ms, kernel)])
