"""The gate's two rules (diff.rule, compare/rules.py) calibrated under this VM's noise model
(gate_noise.py: a group-shared AR(1) machine, an instance per engine start, a switch cost in
paired rounds, skewed or t3 pair noise with outliers).

Per design, rho and pair noise, over `studies` simulated studies of 16 cells in 4 engine groups
(threshold 5 %, alpha 0.05, Holm over the 16, diff.instance_floor_pct at its default 1.5 % for
paired rounds, as a default paired gate judges them): the family-wise false-alarm rate of an
A/A (any cell `slower`), per-cell power with every cell planted at +2/+5/+7.5/+10/+20 %, power
for one planted cell of 16 at +7.5 %, and the median MDE the gate line states (80 % power,
Holm's first step) with its check: the share found when every cell is planted at its own
study's median MDE. The verdicts come from the compare package's own vectorized replays
(stats.judge_rounds, judge_arrays), the code the diff judges with.

    .venv/bin/python benchmarks/gate_rule.py --studies 400
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gate_noise as G  # noqa: E402

from hostsweep.compare import stats as S  # noqa: E402
from hostsweep.compare.options import DiffOptions  # noqa: E402
from hostsweep.compare.rules import RULES  # noqa: E402
from hostsweep.measure.detectable import mde_from_se  # noqa: E402

THRESHOLD, ALPHA, LEVEL, FLOOR_PCT = 5.0, 0.05, 0.95, 1.5
PLANTED = (1.02, 1.05, 1.075, 1.10, 1.20)
RHOS = (0.0, 0.5, 0.9)
DESIGNS = (("rounds 12 (default reps)", 12, 0), ("rounds 24", 24, 0), ("rounds 40", 40, 0),
           ("start pairs 5", 0, 5))
MDE_STUDIES = 60
ROUNDS_MDE_STUDIES = 12  # each rounds cell's MDE is a simulation of its own


def simulate(rounds: int, starts: int, noise: G.Noise, studies: int, planted: np.ndarray, seed: list[int]
             ) -> tuple[np.ndarray, np.ndarray]:
    """(base, head) with head's true step `planted` (per cell) times base's."""
    rng = np.random.default_rng(seed)
    if rounds:
        base, head = G.rounds_sides(rng, noise, studies, rounds)
        return base, head * planted[None, :, None]
    base, head = G.starts_sides(rng, noise, studies, starts, paired=True)
    return base, head * planted[None, :, None, None]


def judge(rounds: int, base: np.ndarray, head: np.ndarray, rule: str) -> np.ndarray:
    if rounds:
        var = DiffOptions(instance_floor_pct=FLOOR_PCT).instance_var
        return S.judge_rounds(base, head, THRESHOLD, ALPHA, LEVEL, rule=rule, instance_var=var)
    return S.judge_arrays(base, head, THRESHOLD, ALPHA, paired=True, level=LEVEL, rule=rule)


def start_pairs_se(base: np.ndarray, head: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(se, df) per start-pairs cell: its t, as the diff computes its MDE."""
    _, se, df = S.paired_log_ratio(np.median(base, axis=-1), np.median(head, axis=-1))
    return se, df


def mdes(rounds: int, base: np.ndarray, head: np.ndarray, rule: str) -> np.ndarray:
    """Per study, the median over its cells of the MDE the diff prints: a rounds cell's from
    its own widened sign test (stats.sign_mde_pct, first ROUNDS_MDE_STUDIES studies, fewer
    draws than the diff takes), a start-pairs cell's from its t (first MDE_STUDIES)."""
    cells = base.shape[1]
    if rounds:
        var = DiffOptions(instance_floor_pct=FLOOR_PCT).instance_var
        d = np.log(head[:ROUNDS_MDE_STUDIES]) - np.log(base[:ROUNDS_MDE_STUDIES])
        m = np.array([[S.sign_mde_pct(cell, var, ALPHA / cells, THRESHOLD, rule, draws=400) for cell in study]
                      for study in d])
    else:
        se, df = start_pairs_se(base[:MDE_STUDIES], head[:MDE_STUDIES])
        m = np.array([[mde_from_se(e, f, ALPHA, cells, threshold_pct=THRESHOLD, rule=rule) for e, f in zip(s, d)]
                      for s, d in zip(se, df)])
    return np.median(m, axis=-1)


def rows(studies: int, noises: tuple[str, ...]) -> list[dict]:
    out = []
    cells = G.CELLS
    for di, (label, rounds, starts) in enumerate(DESIGNS):
        for rho in RHOS:
            for ni, pair in enumerate(noises):
                noise = G.Noise(rho=rho, pair=pair)
                seed = [di, int(rho * 10), ni]
                base, head = simulate(rounds, starts, noise, studies, np.ones(cells), seed + [0])
                for rule in RULES:
                    row = {"design": label, "rho": rho, "noise": pair, "rule": rule}
                    v = judge(rounds, base, head, rule)
                    row["fwer"] = float((v == "slower").any(axis=1).mean())
                    row["faster"] = float((v == "faster").any(axis=1).mean())
                    mde = mdes(rounds, base, head, rule)
                    row["mde"] = float(np.median(mde))
                    for planted in PLANTED:
                        b, h = simulate(rounds, starts, noise, studies, np.full(cells, planted),
                                        seed + [int(planted * 1000)])
                        row[f"p{planted}"] = float((judge(rounds, b, h, rule) == "slower").mean())
                    one = np.ones(cells)
                    one[0] = 1.075
                    b, h = simulate(rounds, starts, noise, studies, one, seed + [1])
                    row["one"] = float((judge(rounds, b, h, rule)[:, 0] == "slower").mean())
                    # the power statement checked: one cell planted at the median MDE the A/A stated
                    at = 1 + row["mde"] / 100
                    if math.isfinite(at):
                        one = np.ones(cells)
                        one[0] = at
                        b, h = simulate(rounds, starts, noise, studies, one, seed + [2])
                        row["at_mde"] = float((judge(rounds, b, h, rule)[:, 0] == "slower").mean())
                    out.append(row)
    return out


def print_table(table: list[dict], studies: int) -> None:
    f = lambda x: "   –  " if x is None else f"{x:6.3f}"  # noqa: E731
    print(f"\n## diff.rule under this VM's noise model: 16 cells in 4 engine groups, machine AR(1) SD "
          f"{G.MACHINE_SD:.0%}, instance SD {G.INSTANCE_SD:.0%} per start, switch cost {G.SWITCH:.0%}, pair noise SD "
          f"{G.PAIR_SD:.0%}, outliers {G.OUTLIER_P:.0%} x{G.OUTLIER}; threshold {THRESHOLD:g} %, alpha {ALPHA} (Holm), "
          f"rounds judged with diff.instance_floor_pct={FLOOR_PCT:g}; {studies} studies a row")
    print(f"{'design':>24} {'rho':>3} {'noise':>6} {'rule':>11} {'FWER':>6} {'faster':>6} "
          + " ".join(f"{'+' + format((p - 1) * 100, 'g') + '%':>6}" for p in PLANTED)
          + f" {'1of16':>6} {'MDE %':>6} {'@MDE':>6}")
    for r in table:
        print(f"{r['design']:>24} {r['rho']:3.1f} {r['noise']:>6} {r['rule']:>11} {f(r['fwer'])} {f(r['faster'])} "
              + " ".join(f(r[f"p{p}"]) for p in PLANTED) + f" {f(r['one'])} {r['mde']:6.1f} {f(r.get('at_mde'))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--studies", type=int, default=400)
    parser.add_argument("--noises", default="skewed,t3")
    args = parser.parse_args()
    started = time.time()
    print_table(rows(args.studies, tuple(args.noises.split(","))), args.studies)
    print(f"({time.time() - started:.0f} s; a rate near 0.05 over {args.studies} studies has a standard error of "
          f"about {math.sqrt(0.05 * 0.95 / args.studies):.3f}; power columns: the share of planted cells called "
          "slower, every cell planted; 1of16: one cell planted +7.5 %, the other 15 unchanged; @MDE: one cell "
          "planted at the median MDE the A/A states, found 0.80 of the time if the statement is right)")


if __name__ == "__main__":
    main()
