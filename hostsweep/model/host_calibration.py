"""H(N) calibrated from the measured host residual of single-device (TP-1) cells: a line
bounded >= 0 over the batches it is applied to, with a bootstrap CI, unstable cells left
out (pure).

The microbenchmarks that measure the other fixed terms on a device (roofs, all-reduce)
are in the calibrate package.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import pandas as pd

from hostsweep.measure.unstable import Exclusion, exclude_unstable
from hostsweep.model.fit import HostFit
from hostsweep.model.hostline import BoundedLine, fit_bounded_line


def _line_text(s0_ms: float, s1_ms: float) -> str:
    return f"{s0_ms:.3f} {'−' if s1_ms < 0 else '+'} {abs(s1_ms):.4f}·(N−1) ms"


@dataclass(frozen=True)
class HostLineCalibration:
    """H(N) fitted to TP-1 host_ms: the bounded line with its CI, the cells it was fitted
    to (with the fitted value beside each) and the unstable cells it left out."""

    line: BoundedLine
    table: pd.DataFrame
    exclusion: Exclusion

    @property
    def fit(self) -> HostFit:
        return self.line.host

    def values(self) -> dict[str, float]:
        """What a calibration records: s0/s1 and their 95% CIs (ms), and the bound's range."""
        line = self.line
        return {"s0_ms": line.s0_ms, "s1_ms": line.s1_ms, "s0_ci_low_ms": line.s0_ci_ms[0],
                "s0_ci_high_ms": line.s0_ci_ms[1], "s1_ci_low_ms": line.s1_ci_ms[0],
                "s1_ci_high_ms": line.s1_ci_ms[1], "bounded_to_batch": line.high,
                "unbounded_s0_ms": line.unbounded_s0_ms, "unbounded_s1_ms": line.unbounded_s1_ms}

    def describe(self) -> str:
        line = self.line
        ci = (f"s0 95% CI [{line.s0_ci_ms[0]:.3f}, {line.s0_ci_ms[1]:.3f}], s1 [{line.s1_ci_ms[0]:.4f}, "
              f"{line.s1_ci_ms[1]:.4f}] (residual bootstrap over {line.cells} cells)" if line.resamples
              else f"no CI ({line.cells} cells leave no residual)")
        text = f"H(N) = {_line_text(line.s0_ms, line.s1_ms)}, {ci}; bounded H >= 0 for N = 1..{line.high:g}"
        if line.at_bound:
            text += (f"; {', '.join(line.at_bound)} held at 0 (unbounded: "
                     f"{_line_text(line.unbounded_s0_ms, line.unbounded_s1_ms)})")
        if self.exclusion.count:
            text += f"; {self.exclusion.count} unstable TP-1 cell(s) left out"
        return text


def calibrate_host(cells: pd.DataFrame, served: Optional[np.ndarray] = None, exclude: bool = True,
                   resamples: int = 2000, seed: int = 0) -> HostLineCalibration:
    """H(N) = s0 + s1·(N−1) fitted to host_ms of the single-device cells (one row per cell),
    >= 0 from N = 1 to the largest batch in `served` (the cells it is applied to), with a
    bootstrap CI, and without the cells flagged unstable (unless `exclude` is false)."""
    single = cells[(cells["tp"] == 1) & cells["host_ms"].notna()]
    single, exclusion = exclude_unstable(single, exclude)
    if single["batch"].nunique() < 2:
        left = f" ({exclusion.count} unstable cell(s) left out: fit.exclude_unstable=false keeps them)" \
            if exclusion.count else ""
        raise ValueError(f"H(N) needs tp=1 cells with a host split (host_ms) at two or more batch sizes{left}")
    line = fit_bounded_line(single["batch"].to_numpy(float), single["host_ms"].to_numpy(float), served,
                            resamples, seed)
    table = single[[c for c in ("sku", "model", "batch", "ctx", "host_ms", "run_id") if c in single]].copy()
    table["fitted_host_ms"] = line.at_batches_ms(table["batch"].to_numpy(float))
    return HostLineCalibration(line, table, exclusion)
