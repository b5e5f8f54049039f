"""The group trend test's false-alarm rate under an autocorrelated machine speed, and its
power, beside the half-versus-half Yuen test it replaced (measure/trend.py).

    python benchmarks/trend_calibration.py [--groups 1000] [--rounds 12]

Prints, per AR(1) rho, the share of steady groups (6 cells, machine SD 10 %, pair noise
6 %) each test flags at 5 %, then the share of quiet groups (machine SD 2 %) with a
planted ramp or step each finds. Pure simulation: the same output on any machine.
"""
from __future__ import annotations

import argparse

import numpy as np

from hostsweep.measure.stability import shift_flags
from hostsweep.measure.trend import stepped
from hostsweep.measure.trend_sim import ar1_speed, common_speed

ALPHA, MIN_SHIFT_PCT = 0.05, 3.0


def yuen_halves(series: np.ndarray) -> np.ndarray:
    """The test the trend annotation used before: Yuen on the halves and medians 3 % apart."""
    half = series.shape[-1] // 2
    return shift_flags(series[:, :half], series[:, half:], 1.0 - ALPHA, MIN_SHIFT_PCT)


def rates(series: np.ndarray) -> tuple[float, float]:
    return float(yuen_halves(series).mean()), float(np.mean([stepped(row, ALPHA) for row in series]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=1000, help="simulated groups per row")
    parser.add_argument("--rounds", type=int, default=12, help="rounds in a group's period")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"steady groups ({args.groups}, {args.rounds} rounds, machine SD 10 %): share flagged at 5 %")
    print("  rho   old (Yuen, halves)   new (trend, AR-safe)")
    for rho in (0.0, 0.3, 0.5, 0.7, 0.8, 0.9):
        old, new = rates(common_speed(ar1_speed(rho, args.rounds, args.groups, 0.10, rng), 6, 0.06, rng))
        print(f"  {rho:.1f}   {old:6.3f}               {new:6.3f}")
    print("quiet groups (machine SD 2 %, rho 0.3) with a planted move: share found")
    rounds = np.arange(args.rounds)
    for name, planted in (("ramp +30 %", np.linspace(1.0, 1.3, args.rounds)),
                          ("step +20 % at half", np.where(rounds >= args.rounds // 2, 1.2, 1.0)),
                          ("step +10 % at half", np.where(rounds >= args.rounds // 2, 1.1, 1.0)),
                          ("first 4 rounds +19..8 %", np.r_[np.linspace(1.19, 1.08, 4), np.ones(args.rounds - 4)])):
        machine = ar1_speed(0.3, args.rounds, args.groups, 0.02, rng) + np.log(planted)
        old, new = rates(common_speed(machine, 6, 0.06, rng))
        print(f"  {name:24s} old {old:.3f}   new {new:.3f}")


if __name__ == "__main__":
    main()
