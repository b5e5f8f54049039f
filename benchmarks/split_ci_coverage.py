"""How often the split's host_frac CI holds the truth, on synthetic cells with known truth.

Each simulated cell has `pairs` profiled pairs (device 2 ms per step with 20 % noise, normal
or lognormal) and 12 timed pairs (step 5 ms with 16 % noise) reported as hostsweep reports a
step: their median and its order-statistic CI. The truth is host_frac = 1 - 2/5 = 0.6.
Three intervals at 95 %:

  fieller      hostsweep's (measure/split_stats.py): Fieller's ratio interval, each error at
               its own t quantile
  welch        the same interval at one Welch-Satterthwaite degrees of freedom
  bootstrap    percentile bootstrap, jointly: host_frac draws = 1 - mean of resampled pairs'
               device / median of resampled timed steps

Run: .venv/bin/python benchmarks/split_ci_coverage.py [--cells 4000] [--resamples 500]
"""
from __future__ import annotations

import argparse

import numpy as np
from scipy import stats

from hostsweep.measure.intervals import median_ci_bounds
from hostsweep.measure.split_stats import fieller_ratio_ci, host_frac_ci_arrays

TRUTH, TIMED = 0.6, 12


def simulate(cells: int, pairs: int, noise: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    if noise == "normal":
        device = rng.normal(2.0, 0.4, (cells, pairs))
    else:
        device = 2.0 * rng.lognormal(-0.02, 0.2, (cells, pairs))
    return device, rng.normal(5.0, 0.8, (cells, TIMED))


def covered(low: np.ndarray, high: np.ndarray) -> float:
    return float(np.mean((low <= TRUTH) & (TRUTH <= high)))


def intervals(device: np.ndarray, steps: np.ndarray, resamples: int, rng: np.random.Generator) -> dict[str, float]:
    n = device.shape[1]
    step = np.median(steps, axis=1)
    low, high, _ = median_ci_bounds(steps, 0.95)
    step_se = (high - low) / 2 / stats.norm.ppf(0.975)
    d_mean, d_se = device.mean(axis=1), device.std(axis=1, ddof=1) / np.sqrt(n)
    out = {"fieller": covered(*host_frac_ci_arrays(d_mean, d_se, n - 1, step, step_se, TIMED - 1, 0.95))}
    a, b = np.square(d_se), np.square(d_mean / step * step_se)
    df = np.square(a + b) / (np.square(a) / (n - 1) + np.square(b) / (TIMED - 1))
    q = stats.t.ppf(0.975, df)
    r_low, r_high = fieller_ratio_ci(d_mean, d_se, step, step_se, q, q)
    out["welch"] = covered(1 - r_high, 1 - r_low)
    cells = device.shape[0]
    pick_d = rng.integers(0, n, (cells, resamples, n))
    pick_s = rng.integers(0, TIMED, (cells, resamples, TIMED))
    d_draws = np.take_along_axis(device[:, None, :], pick_d, axis=2).mean(axis=2)
    s_draws = np.median(np.take_along_axis(steps[:, None, :], pick_s, axis=2), axis=2)
    frac = 1 - d_draws / s_draws
    out["bootstrap"] = covered(np.quantile(frac, 0.025, axis=1), np.quantile(frac, 0.975, axis=1))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=4000)
    parser.add_argument("--resamples", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    print(f"coverage of the 95% host_frac CI over {args.cells} simulated cells (truth {TRUTH})")
    print(f"{'pairs':>5}  {'noise':<9}  {'fieller':>7}  {'welch':>7}  {'bootstrap':>9}")
    for pairs in (3, 5, 8):
        for noise in ("normal", "lognormal"):
            device, steps = simulate(args.cells, pairs, noise, rng)
            found = intervals(device, steps, args.resamples, rng)
            print(f"{pairs:>5}  {noise:<9}  {found['fieller']:>7.3f}  {found['welch']:>7.3f}  {found['bootstrap']:>9.3f}")


if __name__ == "__main__":
    main()
