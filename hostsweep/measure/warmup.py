"""When a group's engine has warmed up (pure): the rule that ends its untimed warm-up rounds.

A cell's own warm-up pairs, taken cell after cell, left the engine cold for the group: on
the CPU build the first four timed rounds of every cell ran 8-19 % slower than the later
ones while the speed canary held (benchmarks/RESULTS.md), a curve that then read as the
machine moving. The group warms up as it is measured instead: its cells in interleaved
rounds, untimed, at least measure.warmups rounds, then one more while the last round ran
more than measure.warmup_settle_pct % faster than the one before (the median over the
group's cells of the ratio of their steps), or while the speed canary of the last round
was more than CANARY_SETTLE_PCT % slower than the fastest warm-up round's, up to
measure.warmup_max_rounds.

The canary is there because the slow start is the machine's as much as the engine's: in
quiet default runs the canary of the first timed round was 1.3-1.7 times its later value
(2.81, 2.38, 2.26 against about 1.7 ms) and the cells' first rounds 5-26 % slow, decaying
over some six rounds, while round-to-round noise (5-10 %) hid the steps' own settling from
a 3 % rule after two warm-up rounds (benchmarks/RESULTS.md, the group warm-up).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

# A warm-up round whose canary (median of its timings) is more than this % slower than the
# fastest warm-up round's has not met the machine the timed rounds will: one canary timing
# spreads 5-10 % on a quiet VM, the median of a round's three about half that.
CANARY_SETTLE_PCT = 10.0


def round_speedup_pct(previous: Sequence[float], latest: Sequence[float]) -> float:
    """How much faster the latest warm-up round ran than the one before, in %: the median
    over the group's cells of (previous step / latest step - 1). Negative: it ran slower."""
    ratios = [p / q for p, q in zip(previous, latest) if p > 0 and q > 0]
    return float(np.median(ratios) - 1.0) * 100.0 if ratios else 0.0


def warmed_up(steps_by_round: Sequence[Sequence[float]], min_rounds: int, settle_pct: float,
              max_rounds: int, canary_by_round: Sequence[float] = ()) -> bool:
    """Whether the warm-up may end after these rounds (each a step per cell, in cell order;
    canary_by_round, when the canary runs, each round's canary in ms): min_rounds taken, the
    last not more than settle_pct % faster than the one before and its canary within
    CANARY_SETTLE_PCT % of the fastest round's, or max_rounds taken; at once for min_rounds
    0. A single round has nothing to be compared with: the warm-up takes two at least
    (unless max_rounds is 1)."""
    taken = len(steps_by_round)
    if min_rounds == 0 or taken >= max_rounds:  # measure.warmups=0: no warm-up at all
        return True
    if taken < max(min_rounds, 2):  # two rounds at least: one has nothing to be compared with
        return False
    if round_speedup_pct(steps_by_round[-2], steps_by_round[-1]) > settle_pct:
        return False
    return not canary_by_round or canary_by_round[-1] <= min(canary_by_round) * (1.0 + CANARY_SETTLE_PCT / 100.0)
