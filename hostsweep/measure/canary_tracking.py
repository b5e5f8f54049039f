"""How well the speed canary tracks what moved the engine (pure): over a group's rounds, the
correlation of the canary's round-to-round moves with the cells' common step moves, and the
share of the step's moves it explains.

The canary (run/canary.py) is a fixed workload timed once a round; dividing a step by it
(`diff.normalize=canary`) assumes the step slows as the canary does. That holds for a
hypervisor taking CPU time from the guest, and need not hold for what the engine meets
beside it: two threads busy, the memory system, the turbo frequency of all cores. So each
group says how well its canary tracked its own cells, and the diff offers normalized ratios
only where it did (TRACKS_EXPLAINED_PCT).

Moves, not levels: per round the mean over the cells of each cell's log step less its own
mean (the machine's speed as the cells saw it), and the log canary; then each round's change
from the round before, in the same period and engine start. A trend both share counts as
tracking; a level they happen to share does not.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import numpy as np

from hostsweep.measure.protocol import RepTiming

# A canary explains at least this share (%) of the steps' round-to-round moves (r >= 0.5)
# before a diff divides by it: below, the normalized ratio would trade the machine's noise for
# the canary's.
TRACKS_EXPLAINED_PCT = 25.0
MIN_MOVES = 8  # round-to-round moves a correlation is stated from (fewer: none)

RoundKey = tuple[int, int, int]  # (engine start, period, round)


@dataclass(frozen=True)
class CanaryTracking:
    moves: int  # round-to-round moves the correlation is over
    r: float  # Pearson correlation of the canary's moves with the cells' common step moves
    slope: float  # the step's move per unit canary move (log scale): 1 when the step slows as the canary does

    @property
    def explained_pct(self) -> float:
        """The share (%) of the steps' round-to-round moves the canary's explain (r^2)."""
        return self.r * self.r * 100.0

    @property
    def tracks(self) -> bool:
        return self.r > 0 and self.explained_pct >= TRACKS_EXPLAINED_PCT

    def text(self) -> str:
        return (f"canary tracks the steps' round-to-round moves with r = {self.r:+.2f} "
                f"(explains {self.explained_pct:.0f} % of them, {self.moves} moves)")


def tracking(observations: Iterable[tuple[RoundKey, int, float, Optional[float]]]) -> Optional[CanaryTracking]:
    """The canary's tracking over (round key, cell index, step, canary) observations of one
    group; None with fewer than MIN_MOVES round-to-round moves, a canary that never moved, or
    steps that never moved together."""
    logs: dict[int, dict[RoundKey, list[float]]] = {}
    canary: dict[RoundKey, list[float]] = {}
    for key, cell, step, value in observations:
        if step > 0 and math.isfinite(step):
            logs.setdefault(cell, {}).setdefault(key, []).append(math.log(step))
        if value is not None and value > 0 and math.isfinite(value):
            canary.setdefault(key, []).append(math.log(value))
    if not logs or not canary:
        return None
    # a key a cell met more than once (a block of rounds): the mean of its log steps there
    steps = {cell: {k: float(np.mean(v)) for k, v in row.items()} for cell, row in logs.items()}
    # each cell's log step less its own mean over the rounds it has: what the round did to it
    offsets = {cell: {k: v - float(np.mean(list(row.values()))) for k, v in row.items()} for cell, row in steps.items()}
    keys = sorted(set(canary) & {k for row in offsets.values() for k in row})
    common = {k: float(np.mean([row[k] for row in offsets.values() if k in row])) for k in keys}
    level = {k: float(np.median(canary[k])) for k in keys}
    moves = [(level[b] - level[a], common[b] - common[a]) for a, b in zip(keys, keys[1:])
             if a[:2] == b[:2]]  # the same engine start and period: a new period is not a round's move
    if len(moves) < MIN_MOVES:
        return None
    dk, ds = (np.array(x) for x in zip(*moves))
    if dk.std() == 0 or ds.std() == 0:
        return None
    r = float(np.corrcoef(dk, ds)[0, 1])
    return CanaryTracking(len(moves), r, float(np.cov(dk, ds)[0, 1] / dk.var(ddof=1)))


def group_tracking(cells: Sequence[Sequence[RepTiming]]) -> Optional[CanaryTracking]:
    """tracking() of a group's cells from their timed pairs; pairs from before rounds (round
    -1) are left out."""
    return tracking(((p.replicate, p.period, p.round), i, p.step_s, p.canary_ms)
                    for i, pairs in enumerate(cells) for p in pairs if p.round >= 0)
