"""Simulated studies with the noise this VM has (issue 45 item 12), for gate_realistic.py.

The older calibration (gate_calibration.py --part gate) draws iid pairs with an independent
shift per cell and start. On this VM the cells of an engine group share one machine whose
speed wanders (a canary and the steps moving together by 10-40 % within minutes, in
benchmarks/RESULTS.md), each engine start is its own instance (three paired A/As read 0.982,
0.994, 0.992), and a paired round switches engines between its two pairs. Every study here has:

- a machine speed on log scale, stationary AR(1) with marginal SD `machine_sd`, shared by
  every cell of an engine group; rho is its autocorrelation from one round to the next, and
  each pair meets the machine at its own moment (the series runs per pair, at rho^(1/pairs a
  round)), so two pairs back to back in a round are close but not equal;
- an engine-instance offset per engine start of each side, log-normal, SD `instance_sd`,
  shared by the group's cells on that start;
- in paired rounds, a switch cost: the first generate after the other engine ran is slower,
  which moves that pair's step by +-`switch` (up when the generate is the T one, down when it
  is the T=1 one: step = (wall_T - wall_1) / (T - 1)); the side order per round from the
  counterbalanced rule (measure/protocol.py side_a_first) or the old one, (k + slot) % 2;
- pair noise: skewed (a right tail), Student t3 (heavy tails), or real pairs replayed (each
  kept study's pairs over their start's median, tests/data/raw_timings), each pair an
  outlier (x1.5) with probability `outlier_p`.

Pure numpy (no hostsweep import), so the same seeds give the same studies under the old
rules' code in a subprocess. Shapes: rounds (studies, cells, rounds); starts (studies,
cells, k starts, pairs a start); cell c belongs to group c // (cells // groups).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import numpy as np
from scipy import signal

MACHINE_SD = 0.08  # log SD of the machine's speed: this VM's canary and steps move 5-10 % (RESULTS.md)
INSTANCE_SD = 0.01  # log SD per engine start: three paired A/As at 0.982, 0.994, 0.992
SWITCH = 0.03  # a switched pair's step move: the fake engine's planted 0.1 ms over 4 steps of 0.6 ms is ~4 %
PAIR_SD = 0.05  # a pair's own noise (skewed, t3), beside the machine's
OUTLIER_P, OUTLIER = 0.02, 1.5  # one pair in 50 half again as slow
CELLS, GROUPS, PAIRS = 16, 4, 12
PAIR_NOISES = ("skewed", "t3", "replay")
REAL = Path(__file__).resolve().parent.parent / "tests" / "data" / "raw_timings"

Order = Callable[[np.ndarray, np.ndarray], np.ndarray]


def counterbalanced(k: np.ndarray, slot: np.ndarray) -> np.ndarray:
    """measure/protocol.py side_a_first (kept here so the old rules' subprocess, whose tree has
    none, simulates the same order; a unit test holds the two equal)."""
    return (k // 2 + slot) % 2 == 0


def old_order(k: np.ndarray, slot: np.ndarray) -> np.ndarray:
    """The side order before counterbalancing: flipped with the T order every round."""
    return (k + slot) % 2 == 0


@dataclass(frozen=True)
class Noise:
    rho: float = 0.5
    machine_sd: float = MACHINE_SD
    instance_sd: float = INSTANCE_SD
    switch: float = SWITCH
    pair: str = "skewed"
    pair_sd: float = PAIR_SD
    outlier_p: float = OUTLIER_P

    def with_(self, **changes) -> "Noise":
        return replace(self, **changes)


def ar1(rng: np.random.Generator, lead: tuple[int, ...], steps: int, phi: float, sd: float) -> np.ndarray:
    """A stationary AR(1) series (lead..., steps) with lag-1 autocorrelation phi and marginal SD
    sd: the first value drawn from the stationary law, then x_t = phi x_{t-1} + e_t."""
    e = rng.standard_normal((*lead, steps)) * sd * math.sqrt(1 - phi * phi)
    e[..., 0] = rng.standard_normal(lead) * sd
    return signal.lfilter([1.0], [1.0, -phi], e, axis=-1)


def per_pair_phi(rho: float, pairs_a_round: int) -> float:
    """The series' lag-1 autocorrelation per pair that makes it rho from one round to the next."""
    return rho ** (1.0 / pairs_a_round) if rho > 0 else 0.0


_POOL: Optional[np.ndarray] = None


def real_pool() -> np.ndarray:
    """Log deviations of every kept real pair from its engine start's median (all kept studies
    and cells): this VM's pair noise, machine wander within a start included."""
    global _POOL
    if _POOL is None:
        import pandas as pd

        parts = []
        for path in sorted(REAL.glob("*.csv")):
            table = pd.read_csv(path)
            for _, start in table.groupby(table["replicate"] if "replicate" in table else 0):
                x = np.log(start["step_ms"].dropna().to_numpy(float))
                parts.append(x - np.median(x))
        _POOL = np.concatenate(parts)
    return _POOL


def pair_log_noise(rng: np.random.Generator, noise: Noise, shape: tuple[int, ...]) -> np.ndarray:
    """Each pair's own noise on log scale (median about 0 before outliers) plus the outliers."""
    if noise.pair == "skewed":
        x = np.log1p(noise.pair_sd * (rng.exponential(1.0, shape) - math.log(2.0)))
    elif noise.pair == "t3":
        x = noise.pair_sd * rng.standard_t(3, shape) / math.sqrt(3.0)
    elif noise.pair == "replay":
        x = rng.choice(real_pool(), shape)
    else:
        raise ValueError(f"pair noise must be one of {PAIR_NOISES}, got {noise.pair!r}")
    return x + np.where(rng.random(shape) < noise.outlier_p, math.log(OUTLIER), 0.0)


def _positions(rng: np.random.Generator, shape: tuple[int, ...], slots: int) -> np.ndarray:
    """Each slot's place in its round: a fresh shuffle per round (measure/protocol.py
    round_order shuffles the cells of every round too)."""
    return rng.permuted(np.broadcast_to(np.arange(slots), (*shape, slots)), axis=-1)


def _by_cell(x: np.ndarray) -> np.ndarray:
    """(studies, groups, rounds, slots, ...) -> (studies, groups * slots, rounds, ...)."""
    x = np.moveaxis(x, 3, 2)
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def switch_shift(rng: np.random.Generator, studies: int, groups: int, rounds: int, slots: int,
                 order: Order) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The time each side's pair ran at and the switch cost's move of its log step, per (studies,
    groups, rounds, slots): (t_a, t_b, shift_a, shift_b) in units of `switch`. Each round times
    every slot's two pairs back to back, the slots shuffled; in round k side a goes first where
    order(k, slot), and both pairs run their T=1 generate first when k is even (interleaved_rounds)."""
    k = np.arange(rounds)[:, None]
    a_first = order(k, np.arange(slots)[None, :])
    start = k * 2 * slots + 2 * _positions(rng, (studies, groups, rounds), slots)
    t_a, t_b = start + np.where(a_first, 0, 1), start + np.where(a_first, 1, 0)
    side = np.zeros((studies, groups, rounds * 2 * slots), dtype=np.int8)
    np.put_along_axis(side, t_b.reshape(studies, groups, -1), 1, axis=-1)
    before = lambda t: np.take_along_axis(side, np.maximum(t - 1, 0).reshape(studies, groups, -1), axis=-1
                                          ).reshape(t.shape)
    switched_a, switched_b = (t_a > 0) & (before(t_a) == 1), (t_b > 0) & (before(t_b) == 0)
    # the switched generate is the pair's first: the T=1 one in even rounds (its wall grows, the step falls)
    sign = np.where(k % 2 == 0, -1.0, 1.0)
    return t_a, t_b, switched_a * sign, switched_b * sign


def rounds_sides(rng: np.random.Generator, noise: Noise, studies: int, rounds: int, planted: float = 1.0,
                 order: Order = counterbalanced, cells: int = CELLS, groups: int = GROUPS
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Paired rounds: (base, head) steps shaped (studies, cells, rounds), one engine instance
    a side per group, head's true step `planted` times base's."""
    slots = cells // groups
    machine = ar1(rng, (studies, groups), rounds * 2 * slots, per_pair_phi(noise.rho, 2 * slots), noise.machine_sd)
    t_a, t_b, s_a, s_b = switch_shift(rng, studies, groups, rounds, slots, order)
    at = lambda t: np.take_along_axis(machine, t.reshape(studies, groups, -1), axis=-1).reshape(t.shape)
    inst = noise.instance_sd * rng.standard_normal((studies, groups, 2, 1, 1))
    shape = t_a.shape
    log_a = at(t_a) + inst[:, :, 0] + noise.switch * s_a + pair_log_noise(rng, noise, shape)
    log_b = at(t_b) + inst[:, :, 1] + noise.switch * s_b + pair_log_noise(rng, noise, shape) + math.log(planted)
    return _by_cell(np.exp(log_a)), _by_cell(np.exp(log_b))


def starts_sides(rng: np.random.Generator, noise: Noise, studies: int, k: int, planted: float = 1.0,
                 paired: bool = False, pairs: int = PAIRS, cells: int = CELLS, groups: int = GROUPS
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Engine starts: (base, head) shaped (studies, cells, k, pairs). Each start times `pairs`
    rounds of its group's cells (one engine at a time: no switch cost), a new instance each.
    paired: one sweep, the starts alternated ABBA (start pair i adjacent in time), on one
    machine series; else two studies measured apart, each on its own stationary draw."""
    slots = cells // groups
    block = pairs * slots
    phi = per_pair_phi(noise.rho, slots)
    where = np.arange(pairs)[:, None] * slots + _positions(rng, (studies, groups, 2, k, pairs), slots)
    if paired:
        first = np.arange(k) % 2  # 0: a then b; 1: b then a
        blocks = np.stack([2 * np.arange(k) + first, 2 * np.arange(k) + 1 - first])  # (side, start)
        machine = ar1(rng, (studies, groups), 2 * k * block, phi, noise.machine_sd)[:, :, None]
        machine = np.broadcast_to(machine, (studies, groups, 2, 2 * k * block))
    else:
        blocks = np.stack([np.arange(k), np.arange(k)])
        machine = ar1(rng, (studies, groups, 2), k * block, phi, noise.machine_sd)
    t = blocks[:, :, None, None] * block + where  # (studies, groups, side, start, pairs, slots)
    m = np.take_along_axis(machine, t.reshape(studies, groups, 2, -1), axis=-1).reshape(t.shape)
    inst = noise.instance_sd * rng.standard_normal((studies, groups, 2, k, 1, 1))
    logs = m + inst + pair_log_noise(rng, noise, t.shape)
    logs[:, :, 1] += math.log(planted)
    x = np.moveaxis(np.exp(logs), -1, 2)  # (studies, groups, slots, side, start, pairs)
    x = x.reshape(studies, groups * slots, 2, k, pairs)
    return x[:, :, 0], x[:, :, 1]


def floor_var(noise: Noise, pairs: int = PAIRS) -> float:
    """The true between-study variance of a one-start side's log level: the variance of the mean
    of the machine over its `pairs` rounds (autocorrelation rho^|i - j|) plus the instance's.
    What a diff.noise_floor_pct known exactly would say; a real floor is only estimated."""
    lag = np.abs(np.subtract.outer(np.arange(pairs), np.arange(pairs)))
    return float(noise.machine_sd ** 2 * np.mean(noise.rho ** lag) + noise.instance_sd ** 2)


def lag1(x: np.ndarray) -> float:
    """The lag-1 autocorrelation over the last axis, pooled over the rest (about the mean of 0)."""
    return float(np.sum(x[..., 1:] * x[..., :-1]) / np.sum(x * x))
