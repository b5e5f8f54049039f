"""The rule that ends a group's warm-up rounds (measure/warmup.py)."""
from __future__ import annotations

import pytest

from hostsweep.measure.warmup import round_speedup_pct, warmed_up

COLD, WARMER, WARM = [12.0, 24.0, 36.0], [11.0, 22.0, 33.0], [10.0, 20.0, 30.0]


@pytest.mark.parametrize("rounds, minimum, done", [
    ([], 0, True),  # measure.warmups=0: no warm-up
    ([], 2, False),
    ([COLD], 1, False),  # one round has nothing to be compared with
    ([COLD, WARMER], 1, False),  # 9 % faster than the round before: still warming
    ([COLD, WARMER], 2, False),
    ([COLD, WARMER, WARM], 2, False),  # 10 % faster again
    ([COLD, WARMER, WARM, WARM], 2, True),  # settled
    ([WARM, WARM], 2, True),
    ([WARM, WARM], 3, False),  # the minimum first
    ([WARM, COLD], 2, True),  # slower is not warming
])
def test_the_warm_up_ends_once_a_round_is_no_faster_than_the_one_before(rounds, minimum, done):
    assert warmed_up(rounds, minimum, settle_pct=3.0, max_rounds=6) is done


def test_the_warm_up_ends_at_its_most_rounds_however_fast_it_still_gets():
    falling = [[10.0 * 0.8 ** r] for r in range(6)]
    assert not warmed_up(falling[:5], 2, 3.0, 6)
    assert warmed_up(falling, 2, 3.0, 6)


def test_the_speed_up_is_the_median_over_the_cells_so_one_noisy_cell_does_not_decide_it():
    assert round_speedup_pct(COLD, WARMER) == pytest.approx(100 * (12 / 11 - 1))
    assert round_speedup_pct([10, 10, 10], [10, 10, 5]) == pytest.approx(0.0)


def test_a_canary_still_slow_keeps_the_warm_up_going_though_the_steps_have_settled():
    steady = [WARM, WARM, WARM]
    assert not warmed_up(steady, 2, 3.0, 6, canary_by_round=[2.8, 1.7, 2.3])  # 35 % above the fastest
    assert warmed_up(steady, 2, 3.0, 6, canary_by_round=[2.8, 1.7, 1.8])
    assert warmed_up(steady[:2], 2, 3.0, 6, canary_by_round=[1.7, 1.8])
