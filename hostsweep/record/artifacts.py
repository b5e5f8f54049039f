"""The tables a cell run carries as artifacts: its raw timings, its top ops, its linearity
sweep (CSV text, pure pandas)."""
from __future__ import annotations

import pandas as pd

from hostsweep.measure.results import CellResult


def timings_table(result: CellResult) -> str:
    """The raw per-rep timings of a cell as CSV."""
    assert result.measurement is not None
    rows = [
        {"rep": r.rep, "t1_first": r.t1_first, "wall_1_ms": r.wall_1_s * 1e3,
         "wall_T_ms": r.wall_T_s * 1e3, "step_ms": r.step_s * 1e3}
        for r in result.measurement.reps
    ]
    return pd.DataFrame(rows).to_csv(index=False)


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
