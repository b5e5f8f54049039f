"""The tables a cell run carries as artifacts: its raw timings, its top ops, its linearity
sweep (CSV text, pure pandas)."""
from __future__ import annotations

from dataclasses import asdict
from typing import Sequence

import pandas as pd

from hostsweep.measure.protocol import RepTiming
from hostsweep.measure.results import CellResult


def _timing_rows(reps: Sequence[RepTiming]) -> list[dict[str, object]]:
    """One row per timed pair: its walls and step, the round it ran in, and its contention
    record (empty where the machine could not be observed)."""
    rows = []
    for r in reps:
        row: dict[str, object] = {"rep": r.rep, "t1_first": r.t1_first, "wall_1_ms": r.wall_1_s * 1e3,
                                  "wall_T_ms": r.wall_T_s * 1e3, "step_ms": r.step_s * 1e3, "round": r.round}
        row.update(asdict(r.contention) if r.contention is not None else {})
        rows.append(row)
    return rows


def timings_table(result: CellResult) -> str:
    """The raw per-rep timings of a cell as CSV (the reported attempt's)."""
    assert result.measurement is not None
    return pd.DataFrame(_timing_rows(result.measurement.reps)).to_csv(index=False)


def earlier_timings_table(result: CellResult) -> str:
    """The timed pairs of the attempts a re-measure replaced, with their attempt number."""
    frames = [pd.DataFrame(_timing_rows(reps)).assign(attempt=n) for n, reps in enumerate(result.earlier_timings, 1)]
    return pd.concat(frames).to_csv(index=False)


def top_ops_table(result: CellResult) -> str:
    """Ops/kernels by time per decode step, from the differenced profiled pair."""
    assert result.split is not None
    frame = pd.DataFrame(result.split.top_ops, columns=["op", "ms_per_step"])
    frame["share_of_device"] = frame["ms_per_step"] / result.split.device_ms
    return frame.to_csv(index=False)


def linearity_table(result: CellResult) -> str:
    assert result.linearity is not None
    lin = result.linearity
    frame = pd.DataFrame({"T": lin.tokens, "wall_ms": lin.wall_ms})
    if lin.kernel_ms:
        frame["kernel_ms"] = lin.kernel_ms
    return frame.to_csv(index=False)
