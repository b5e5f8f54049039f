"""When a group's engine has warmed up (pure): the rule that ends its untimed warm-up rounds.

A cell's own warm-up pairs, taken cell after cell, left the engine cold for the group: on
the CPU build the first four timed rounds of every cell ran 8-19 % slower than the later
ones while the speed canary held (benchmarks/RESULTS.md), a curve that then read as the
machine moving. The group warms up as it is measured instead: its cells in interleaved
rounds, untimed, at least measure.warmups rounds, then one more while the last round ran
more than measure.warmup_settle_pct % faster than the one before (the median over the
group's cells of the ratio of their steps), up to measure.warmup_max_rounds.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def round_speedup_pct(previous: Sequence[float], latest: Sequence[float]) -> float:
    """How much faster the latest warm-up round ran than the one before, in %: the median
    over the group's cells of (previous step / latest step - 1). Negative: it ran slower."""
    ratios = [p / q for p, q in zip(previous, latest) if p > 0 and q > 0]
    return float(np.median(ratios) - 1.0) * 100.0 if ratios else 0.0


def warmed_up(steps_by_round: Sequence[Sequence[float]], min_rounds: int, settle_pct: float,
              max_rounds: int) -> bool:
    """Whether the warm-up may end after these rounds (each a step per cell, in cell order):
    min_rounds taken and the last not more than settle_pct % faster than the one before, or
    max_rounds taken; at once for min_rounds 0. A single round has nothing to be compared
    with: the warm-up takes two at least (unless max_rounds is 1)."""
    taken = len(steps_by_round)
    if min_rounds == 0 or taken >= max_rounds:  # measure.warmups=0: no warm-up at all
        return True
    if taken < max(min_rounds, 2):  # two rounds at least: one has nothing to be compared with
        return False
    return round_speedup_pct(steps_by_round[-2], steps_by_round[-1]) <= settle_pct
