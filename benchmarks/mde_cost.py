"""What a paired-rounds diff spends on its MDEs: every rounds cell's MDE is its own sign test's
power, simulated (compare/stats.sign_mde_pct, 1000 draws, a bisection on the shift), so the
cost grows with the cells. Prints, for 12 and 40 rounds, with and without the instance
floor, the seconds one cell's MDE takes (median of `cells` cells drawn with heavy-tailed
rounds) and what a diff of 16, 256 and 1024 cells would spend on them, beside the seconds
the same cells' sign tests take (stats.widened_sign_pvalues) as the yardstick.

    .venv/bin/python benchmarks/mde_cost.py [cells]
"""
from __future__ import annotations

import sys
import time

import numpy as np

from hostsweep.compare.options import DiffOptions
from hostsweep.compare.stats import sign_mde_pct, widened_sign_pvalues

ALPHA, THRESHOLD = 0.05, 5.0
GRIDS = (16, 256, 1024)


def per_cell_seconds(rounds: int, variance: float, cells: int, rng: np.random.Generator) -> tuple[float, float]:
    """(median seconds of one cell's MDE, median seconds of its three sign tests)."""
    mde_s, test_s = [], []
    for _ in range(cells):
        d = 0.03 * rng.standard_t(3, rounds)  # rounds with a heavy tail, as the VM's are
        start = time.perf_counter()
        sign_mde_pct(d, variance, ALPHA / 16, THRESHOLD)
        mde_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        widened_sign_pvalues(d, THRESHOLD, 0.0, variance)
        test_s.append(time.perf_counter() - start)
    return float(np.median(mde_s)), float(np.median(test_s))


def main(cells: int = 30) -> None:
    rng = np.random.default_rng(0)
    floor = DiffOptions(instance_floor_pct=1.5).instance_var
    print(f"{'rounds':>6} {'floor':>5} {'MDE s/cell':>10} {'tests s/cell':>12} {'ratio':>6} "
          + " ".join(f"{f'{n} cells s':>13}" for n in GRIDS))
    for rounds in (12, 40):
        for variance in (0.0, floor):
            mde, test = per_cell_seconds(rounds, variance, cells, rng)
            print(f"{rounds:>6} {'1.5%' if variance else 'none':>5} {mde:>10.4f} {test:>12.5f} {mde / test:>6.0f} "
                  + " ".join(f"{mde * n:>13.1f}" for n in GRIDS))


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:2]))
