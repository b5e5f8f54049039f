"""How long fitting and scoring the TP model takes on 100,000 cells (vectorized numpy):
prints cells per second for one global g with one form, and for the whole fit stage
(every form, held-out groups, bootstrap verdicts, falsification, shrink).

    .venv/bin/python benchmarks/fit_speed.py [n_cells]
"""
from __future__ import annotations

import sys
import time
from dataclasses import asdict
from itertools import product

import numpy as np
import pandas as pd

from hostsweep.model.inputs import in_regime, model_inputs
from hostsweep.model.study_fit import CalibrationTerms, FitOptions, fit_study
from hostsweep.config.options import load_model_shape, load_sku
from hostsweep.model.fit import AllReduceFit, HostFit, allreduce_s, sharded_compute_s
from hostsweep.model.hostforms import cell_terms, fit_form, fit_scale, predict_terms_s


def synthetic_cells(n: int) -> pd.DataFrame:
    models = ["llama-3.1-8b", "llama-3.1-70b", "qwen2.5-32b"]
    base = pd.DataFrame([{"sku": s, "model": m, "tp": k, "batch": b, "ctx": c, "step_ms": 0.0}
                         for s, m, k, b, c in product(["h100", "h200"], models, [1, 2, 4, 8],
                                                      [1, 2, 4, 8, 16], [512, 2048, 4096])])
    base["T"] = 33
    rows = base.sample(n, replace=True, random_state=0).reset_index(drop=True)
    cells = model_inputs(rows, {m: load_model_shape(m) for m in models},
                       {s: asdict(load_sku(s)) for s in ("h100", "h200")})
    ar, host = AllReduceFit(21.2e-6, 307e9), HostFit(16.9e-3, 0.2e-3)
    noise = np.random.default_rng(0).normal(0, 0.02, n)
    cells["step_ms"] = (0.3 * sharded_compute_s(cells) + allreduce_s(cells, ar) + host.time_s(cells["batch"])) * (1 + noise) * 1e3
    cells["step_ci_low_ms"], cells["step_ci_high_ms"] = cells["step_ms"] * (1 - 0.0392), cells["step_ms"] * (1 + 0.0392)
    return cells


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    ar, host = AllReduceFit(21.2e-6, 307e9), HostFit(16.9e-3, 0.2e-3)
    cells = synthetic_cells(n)
    start = time.perf_counter()
    regime = in_regime(cells)
    train = regime & (cells["tp"] == 2).to_numpy()
    terms = cell_terms(cells, ar, host)
    step = cells["step_ms"].to_numpy(float)
    g = fit_scale(terms.take(train), step[train]).g
    fitted = fit_form("free_constant", terms.take(train), step[train], g)
    predict_terms_s(fitted, terms)
    one = time.perf_counter() - start
    start = time.perf_counter()
    report = fit_study(cells, CalibrationTerms({"h100": ar, "h200": ar}, host), FitOptions("h100"))
    whole = time.perf_counter() - start
    print(f"{n} cells: regime + g + one form + predict {one:.3f} s ({n / one:,.0f} cells/s); "
          f"whole fit stage {whole:.3f} s ({n / whole:,.0f} cells/s); g = {g:.3f}, "
          f"verdict {report.verdict['verdict']}")


if __name__ == "__main__":
    main()
