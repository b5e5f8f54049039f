"""How often hostsweep's statistical statements are wrong, measured against simulated truth.

Every cell CI and stability test is run on synthetic pairs whose true step is known (1.0),
over many seeds, and the tables print how often the CI covered the truth or the test fired:

    median      a cell's median CI (order statistics) at n pairs, per noise shape
    starts      the CI across k engine starts (t-interval on the starts' medians) with a
                planted between-start spread
    adaptive    adaptive repetitions (measure.target_ci_pct): fixed looks at the level that
                splits the error across them, against Bonferroni over the same looks and
                against checking after every pair at the plain level
    drift       the drift rule (measure/stability.py): detection of a step shift with and
                without an outlier pair, and its false-alarm rate with no shift

Noise shapes (multiplicative, median exactly 1, so the truth is known): gauss; skewed
(1 + s * (Exp(1) - ln 2), a long right tail like a timing's); t3 (Student's t with 3
degrees of freedom, heavy tails); mix5 (gauss, each pair 1.5x slower with probability 5 %:
the truth is the mixture's median); outlier1 (gauss, exactly one pair per start 1.5x
slower: the truth stays 1).

The diff stage's gate (family-wise false-alarm rate, power) adds its own section below
the marked place, and `realistic` the same under this VM's noise (gate_realistic.py); main()
runs every section named in SECTIONS.

    .venv/bin/python benchmarks/gate_calibration.py [--seeds 2000] [--part median ...]
"""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pandas as pd
from scipy import optimize, stats

from hostsweep.measure.intervals import (
    between_starts_ci, look_level, median_ci_bounds, sequential_coverage, t_interval_bounds,
)
from hostsweep.measure.protocol import adaptive_looks, adaptive_stops
from hostsweep.measure.stability import StabilityRules, shift_flags

NOISES = ("gauss", "skewed", "t3", "mix5", "outlier1")
OUTLIER = 1.5  # an outlier pair's step over the cell's
MIX = 0.05  # the share of outlier pairs in mix5


def draw(rng: np.random.Generator, noise: str, shape: tuple[int, ...], scale: float) -> np.ndarray:
    """Multiplicative noise of the named shape, median 1 before outliers, spread `scale`."""
    if noise in ("gauss", "mix5", "outlier1"):
        x = 1.0 + scale * rng.standard_normal(shape)
    elif noise == "skewed":
        x = 1.0 + scale * (rng.exponential(1.0, shape) - math.log(2.0))
    elif noise == "t3":
        x = 1.0 + scale * rng.standard_t(3, shape) / math.sqrt(3.0)
    else:
        raise ValueError(f"noise must be one of {NOISES}, got {noise!r}")
    if noise == "mix5":
        x = np.where(rng.random(shape) < MIX, x * OUTLIER, x)
    if noise == "outlier1":
        pos = rng.integers(0, shape[-1], shape[:-1])
        np.put_along_axis(x, pos[..., None], np.take_along_axis(x, pos[..., None], -1) * OUTLIER, -1)
    return x


def true_median(noise: str, scale: float) -> float:
    """The population median of one pair under `noise` (1, except mix5's mixture)."""
    if noise != "mix5":
        return 1.0
    cdf = lambda x: (1 - MIX) * stats.norm.cdf((x - 1) / scale) + MIX * stats.norm.cdf((x / OUTLIER - 1) / scale)
    return float(optimize.brentq(lambda x: cdf(x) - 0.5, 0.5, 2.0))


def se(p: float, seeds: int) -> float:
    return math.sqrt(max(p * (1 - p), 1e-9) / seeds)


def median_section(seeds: int, level: float, scale: float) -> None:
    """Coverage of the cell's median CI at n pairs: exact by construction for iid pairs."""
    print(f"\n## median CI of one start's pairs (order statistics), {seeds} seeds, within-start noise {scale:.1%}")
    print(f"{'n':>3} {'exact':>7} " + " ".join(f"{n:>9}" for n in NOISES))
    for n in (5, 8, 12, 24):
        rng = np.random.default_rng(n)
        cells = []
        for noise in NOISES:
            x = draw(rng, noise, (seeds, n), scale)
            low, high, exact = median_ci_bounds(x, level)
            truth = true_median(noise, scale)
            cells.append(f"{np.mean((low <= truth) & (truth <= high)):9.3f}")
        flag = "  below level: flagged" if exact < level else ""
        print(f"{n:>3} {exact:7.3f} " + " ".join(cells) + flag)


def between_starts_section(seeds: int, level: float, scale: float) -> None:
    """Coverage of the across-starts CI with a planted N(0, spread) shift per start."""
    print(f"\n## CI across k engine starts (t on start medians, k-1 df), 12 pairs a start, {seeds} seeds")
    print(f"{'k':>2} {'spread':>6} " + " ".join(f"{n:>9}" for n in NOISES) + "   one-start CI (gauss)")
    for k in (2, 3, 5):
        for spread in (0.0, 0.01, 0.02, 0.03):
            rng = np.random.default_rng([k, int(spread * 1e4)])
            cells = []
            for noise in NOISES:
                shift = 1.0 + spread * rng.standard_normal((seeds, k, 1))
                medians = np.median(draw(rng, noise, (seeds, k, 12), scale) * shift, axis=-1)
                _, low, high = t_interval_bounds(medians, level)
                truth = true_median(noise, scale)
                cells.append(f"{np.mean((low <= truth) & (truth <= high)):9.3f}")
            one = draw(rng, "gauss", (seeds, 12), scale) * (1.0 + spread * rng.standard_normal((seeds, 1)))
            low1, high1, _ = median_ci_bounds(one, level)
            print(f"{k:>2} {spread:6.0%} " + " ".join(cells) + f"   {np.mean((low1 <= 1) & (1 <= high1)):9.3f}")
    example = between_starts_ci([[1.00, 1.01, 0.99], [1.02, 1.03, 1.01], [0.98, 0.99, 0.97]], level)
    print(f"(between_starts_ci on three starts of three pairs: point {example[0]:.3f} [{example[1]:.3f}, {example[2]:.3f}])")


def adaptive_section(seeds: int, level: float, scale: float) -> None:
    """Coverage after adaptive stopping: planned looks at their split level (hostsweep),
    Bonferroni over the same looks, and a check after every pair from 8 on at the plain
    level (stops on luck)."""
    looks = adaptive_looks(1.0, 8, 48)
    each, bonferroni = look_level(level, looks), 1 - (1 - level) / len(looks)
    print(f"\n## adaptive repetitions, min_reps 8, max_reps 48, looks {looks[:3]}...{looks[-1]}: "
          f"{len(looks)} looks at {each:.4f} (guaranteed >= {sequential_coverage(looks, level):.3f}); "
          f"Bonferroni at {bonferroni:.4f}; {seeds} seeds")
    print(f"{'noise':>9} {'target':>6} {'looks: cover':>12} {'mean n':>6}   {'Bonferroni':>10} {'mean n':>6}   "
          f"{'every pair':>10} {'mean n':>6}")
    for noise in NOISES:
        for target in (1.0, 2.0, 4.0):
            rng = np.random.default_rng([NOISES.index(noise), int(target * 10)])
            x = draw(rng, noise, (seeds, 48), scale)
            truth = true_median(noise, scale)
            cover = lambda lo, hi: np.mean((lo <= truth) & (truth <= hi))
            cells = []
            for schedule, at in ((looks, each), (looks, bonferroni), (tuple(range(8, 49)), level)):
                n, lo, hi = adaptive_stops(x, schedule, target, at)
                cells.append(f"{cover(lo, hi):10.3f} {n.mean():6.1f}")
            print(f"{noise:>9} {target:5.0f}% " + "   ".join(cells))


def drift_section(seeds: int, level: float, scale: float) -> None:
    """The drift rule on a step shift halfway through the pairs (and none: A/A)."""
    rules = StabilityRules(level=level)
    print(f"\n## drift rule (Yuen trimmed-means test at {1 - level:.2f} and min_shift_pct "
          f"{rules.min_shift_pct:g}), rate flagged over {seeds} seeds, step shift halfway")
    print(f"{'noise':>8} {'scale':>5} {'n':>3} " + " ".join(f"{f'{s:.0%}':>5}{o:>5}" for s in (0.0, 0.05, 0.10)
                                                           for o in ("", "+out")))
    for noise in ("gauss", "t3"):
        for within in (scale, 2 * scale):
            for n in (6, 8, 12, 24):
                cells = []
                for s in (0.0, 0.05, 0.10):
                    for outlier in (False, True):
                        rng = np.random.default_rng([n, int(s * 100), outlier, int(within * 1e4)])
                        x = draw(rng, "outlier1" if outlier and noise == "gauss" else noise, (seeds, n), within)
                        if outlier and noise != "gauss":
                            x[np.arange(seeds), rng.integers(0, n, seeds)] *= OUTLIER
                        x[:, n // 2:] *= 1.0 + s
                        h = n // 2
                        cells.append(np.mean(shift_flags(x[:, :h], x[:, h:], rules.level, rules.min_shift_pct)))
                print(f"{noise:>8} {within:5.1%} {n:>3} " + " ".join(f"{c:10.3f}" for c in cells))


# --- the diff stage's gate (compare/stats.py): family-wise false alarms and power -----

GATE_CELLS = 100  # cells a release grid judges at once
PLANTED_CELLS = 10  # of them, regressed by the planted shift in the power runs
CHUNK = 250  # simulated studies per vectorized batch (memory: CHUNK * cells * 2 * k * n floats)
DESIGNS = (  # (label, engine starts per side, the noise floor the diff is told: True = the planted spread)
    ("1 start, no widening", 1, None), ("1 start + floor", 1, True), ("3 starts", 3, None), ("5 starts", 5, None))


def gate_side(rng: np.random.Generator, noise: str, studies: int, k: int, n: int, scale: float, spread: float,
              shift: np.ndarray) -> np.ndarray:
    """Pairs of one side of many simulated studies: (studies, cells, k, n), each engine start
    shifted by N(0, spread) on log scale, each cell by its planted shift."""
    x = draw(rng, noise, (studies, GATE_CELLS, k, n), scale)
    return x * np.exp(spread * rng.standard_normal((studies, GATE_CELLS, k, 1))) * shift[None, :, None, None]


def gate_rates(seeds: int, noise: str, k: int, floor: Optional[float], spread: float, scale: float, planted: float,
               threshold: float, alpha: float, n: int = 12) -> tuple[float, float, float]:
    """(family-wise false-alarm rate over the unchanged cells, power per planted cell, share of
    unchanged cells shown `same`) of the gate over `seeds` simulated studies."""
    from hostsweep.compare.stats import judge_arrays

    shift = np.ones(GATE_CELLS)
    shift[:PLANTED_CELLS] = planted
    rng = np.random.default_rng([k, int(spread * 1e4), int(planted * 100), NOISES.index(noise)])
    between = math.nan if floor is None else math.log1p(floor) ** 2
    alarms, found, same = [], [], []
    for start in range(0, seeds, CHUNK):
        m = min(CHUNK, seeds - start)
        v = judge_arrays(gate_side(rng, noise, m, k, n, scale, spread, np.ones(GATE_CELLS)),
                         gate_side(rng, noise, m, k, n, scale, spread, shift), threshold, alpha, between)
        unchanged = slice(PLANTED_CELLS, None) if planted != 1.0 else slice(None)
        alarms.append((v[:, unchanged] == "slower").any(axis=1))
        found.append((v[:, :PLANTED_CELLS] == "slower").mean(axis=1))
        same.append((v[:, unchanged] == "same").mean(axis=1))
    return float(np.concatenate(alarms).mean()), float(np.concatenate(found).mean()), float(np.concatenate(same).mean())


def gate_section(seeds: int, level: float, scale: float) -> None:
    """The gate (fail_on=slower, threshold 5 %, alpha 1 - level, Holm over 100 cells): how often
    it fails with nothing changed, and how often it finds planted +5 % / +10 % regressions."""
    alpha = 1 - level
    print(f"\n## diff gate over {GATE_CELLS} cells, threshold 5 %, alpha {alpha:.2f} (Holm), 12 pairs a start, "
          f"within-start noise {scale:.1%}, {seeds} simulated studies per row")
    print(f"{'noise':>8} {'design':>22} {'spread':>6} {'FWER':>6} {'same':>6} {'power+5%':>9} {'power+10%':>9} "
          f"{'FWER(+10%)':>10}")
    for noise in ("gauss", "outlier1"):
        for label, k, floor in DESIGNS:
            for spread in (0.0, 0.01, 0.02, 0.03):
                told = (math.expm1(spread) if floor else None) if k == 1 else None  # the SD of log step, in %
                fwer, _, same = gate_rates(seeds, noise, k, told, spread, scale, 1.0, 5.0, alpha)
                _, p5, _ = gate_rates(seeds, noise, k, told, spread, scale, 1.05, 5.0, alpha)
                fwer10, p10, _ = gate_rates(seeds, noise, k, told, spread, scale, 1.10, 5.0, alpha)
                print(f"{noise:>8} {label:>22} {spread:6.0%} {fwer:6.3f} {same:6.3f} {p5:9.3f} {p10:9.3f} "
                      f"{fwer10:10.3f}")


# --- part (b): this machine's real pairs (tests/data/raw_timings), resampled -------------

REAL = Path(__file__).resolve().parent.parent / "tests" / "data" / "raw_timings"


def real_cells() -> dict[str, dict[str, pd.DataFrame]]:
    """study -> cell (b1-ctx128 ...) -> its raw_timings table, from the kept real sweeps."""
    out: dict[str, dict[str, pd.DataFrame]] = {}
    for path in sorted(REAL.glob("*.csv")):
        study, cell = path.stem.rsplit("-", 2)[0], "-".join(path.stem.rsplit("-", 2)[1:])
        out.setdefault(study, {})[cell] = pd.read_csv(path)
    return out


def replay_resampled(seeds: int, alpha: float, threshold: float) -> None:
    """A/A and planted shifts on each real cell's own pairs: both sides drawn (12 pairs, with
    replacement) from one start's real pairs, so the noise shape is this machine's (outliers,
    bursts) and the truth is known (ratio 1, or the planted shift); one cell judged at a time."""
    from hostsweep.compare.stats import judge_arrays

    print(f"\n## replayed real pairs: both sides resampled from one cell's pairs of one engine start "
          f"(12 pairs a side), {seeds} draws, one cell judged at alpha {alpha:.2f}, threshold {threshold:g} %")
    print(f"{'study/cell':>24} {'pairs':>5} {'spread':>6} {'slower A/A':>10} {'same A/A':>8} {'power+5%':>8} "
          f"{'power+10%':>9} {'power+20%':>9}")
    for study, cells in real_cells().items():
        for cell, table in cells.items():
            pool = table.loc[table.get("replicate", 0) == 0, "step_ms"].dropna().to_numpy(float)
            rng = np.random.default_rng(zlib_key(study + cell))
            rates = []
            for planted in (1.0, 1.05, 1.10, 1.20):
                base = rng.choice(pool, (seeds, 1, 1, 12))
                head = rng.choice(pool, (seeds, 1, 1, 12)) * planted
                v = judge_arrays(base, head, threshold, alpha, 0.0)
                rates.append(((v == "slower").mean(), (v == "same").mean()))
            spread = (np.percentile(pool, 75) - np.percentile(pool, 25)) / np.median(pool)
            print(f"{study + '/' + cell:>24} {pool.size:5d} {spread:6.1%} {rates[0][0]:10.3f} {rates[0][1]:8.3f} "
                  f"{rates[1][0]:8.3f} {rates[2][0]:9.3f} {rates[3][0]:9.3f}")


def zlib_key(text: str) -> int:
    import zlib

    return zlib.crc32(text.encode())


def real_side(cells: dict[str, pd.DataFrame], version: str) -> tuple[pd.DataFrame, dict[str, list[np.ndarray]]]:
    """One kept study as the diff reads a side: a row per cell, its pairs by engine start."""
    from hostsweep.record.read.sides import pairs_by_start, period_spread

    rows, raw = [], {}
    for cell, table in cells.items():
        batch, ctx = cell.split("-")
        run = f"{version}-{cell}"
        raw[run] = pairs_by_start(table)
        var, df = period_spread(table["step_ms"], table["period"]) if "period" in table else (math.nan, 0.0)
        starts = len(raw[run])
        rows.append({"batch": batch[1:], "ctx": ctx[3:], "step_ms": float(table["step_ms"].median()),
                     "run_id": run, "period_var": var, "period_df": df, "vllm_version": version,
                     **({"replicates": str(starts)} if starts > 1 else {})})
    return pd.DataFrame(rows), raw


def replay_studies(level: float, threshold: float) -> None:
    """The kept studies diffed against each other as they are (nothing changed between them,
    minutes apart on the same machine): the gate's verdicts, and each cell's MDE."""
    from hostsweep.compare import DiffOptions, diff

    studies = real_cells()
    print(f"\n## replayed real studies diffed as they are (A/A: nothing changed between them), "
          f"threshold {threshold:g} %, alpha {1 - level:.2f}")
    print(f"{'base -> head':>26} {'cell':>10} {'ratio':>6} {'CI':>15} {'verdict':>12} {'MDE %':>6}  between-start "
          "component")
    names = sorted(studies)
    for b, h in [(x, y) for i, x in enumerate(names) for y in names[i + 1:]]:
        base, raw_b = real_side(studies[b], b)
        head, raw_h = real_side(studies[h], h)
        result = diff(base, head, {**raw_b, **raw_h}, DiffOptions(threshold, ("step_ms",), level, 1 - level,
                                                                   fail_on="slower"))
        for row in result.cells.to_dict("records"):
            print(f"{b + ' -> ' + h:>26} {row['cell']:>10} {row['ratio']:6.3f} "
                  f"[{row['ci_low']:.3f}, {row['ci_high']:.3f}] {row['verdict']:>12} {row['mde_pct']:6.1f}  "
                  f"{row['between']}")
        print(f"{'':>26} gate: {'FAIL' if result.gate()[0] else 'pass'}: {result.gate()[1]}")


def replay_section(seeds: int, level: float, scale: float) -> None:
    replay_resampled(seeds, 1 - level, 5.0)
    replay_studies(level, 5.0)


def realistic_section(seeds: int, level: float, scale: float) -> None:
    """The diff under this VM's noise (gate_noise.py: a shared AR(1) machine, engine instances, a
    switch cost, skewed / t3 / replayed pairs), the old rules beside the new on the same seeds
    (gate_realistic.py); `seeds` simulated studies a row, its own level 0.95 and noise."""
    from gate_realistic import realistic

    realistic(seeds)


SECTIONS: dict[str, Callable[[int, float, float], None]] = {
    "median": median_section,
    "starts": between_starts_section,
    "adaptive": adaptive_section,
    "drift": drift_section,
    # The diff stage's gate: family-wise false-alarm rate over unchanged cells and power
    # against planted regressions; then this machine's real pairs replayed.
    "gate": gate_section,
    "replay": replay_section,
    # The same gate under realistic noise, old rules and new side by side.
    "realistic": realistic_section,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=2000, help="simulated cells per configuration")
    parser.add_argument("--level", type=float, default=0.95, help="the CI level (measure.ci_level)")
    parser.add_argument("--scale", type=float, default=0.015, help="within-start noise, a fraction of the step")
    parser.add_argument("--part", choices=sorted(SECTIONS), action="append", help="sections to run (default: all)")
    args = parser.parse_args()
    started = time.time()
    for name in args.part or list(SECTIONS):
        SECTIONS[name](args.seeds, args.level, args.scale)
    print(f"\n({time.time() - started:.0f} s; a coverage over {args.seeds} seeds has a standard error of about "
          f"{se(0.95, args.seeds):.3f} at 95 %)")


if __name__ == "__main__":
    main()
