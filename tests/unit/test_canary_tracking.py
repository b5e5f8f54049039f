"""The canary's tracking of the engine's machine: how much of a group's round-to-round step
moves its canary explains, recorded per group, shown on the design line, and the gate of
diff.normalize=canary (measure/canary_tracking.py, compare/canary.py)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from hostsweep.measure.canary_tracking import MIN_MOVES, TRACKS_EXPLAINED_PCT, group_tracking, tracking
from hostsweep.measure.protocol import RepTiming


def group(rng: np.random.Generator, rounds: int, cells: int, coupling: float, machine_sd: float = 0.08,
          noise: float = 0.03, canary_noise: float = 0.02, periods: int = 1) -> list[list[RepTiming]]:
    """A group's pairs: per round a machine speed (AR(1), rho 0.6) every cell's step shares, and a
    canary that moves with `coupling` times that speed plus its own noise."""
    pairs: list[list[RepTiming]] = [[] for _ in range(cells)]
    for period in range(periods):
        speed = 0.0
        for r in range(rounds):
            speed = 0.6 * speed + math.sqrt(1 - 0.36) * rng.normal(0, machine_sd)
            canary = 1.7 * math.exp(coupling * speed + rng.normal(0, canary_noise))
            for c in range(cells):
                step = 0.004 * (1 + c) * math.exp(speed + rng.normal(0, noise))
                pairs[c].append(RepTiming(r, r % 2 == 0, 0.01, 0.01 + 32 * step, step, round=r, period=period,
                                          canary_ms=canary))
    return pairs


@pytest.mark.parametrize("seed", range(10))
def test_a_canary_that_moves_with_the_machine_tracks_and_one_that_does_not_is_told(seed):
    rng = np.random.default_rng(seed)
    coupled = group_tracking(group(rng, 24, 6, coupling=1.0))
    blind = group_tracking(group(rng, 24, 6, coupling=0.0))
    assert coupled is not None and coupled.tracks and coupled.r > 0.7 and coupled.slope == pytest.approx(1.0, abs=0.35)
    assert blind is not None and not blind.tracks and blind.explained_pct < TRACKS_EXPLAINED_PCT
    assert coupled.moves == 23 and "explains" in coupled.text()


def test_a_canary_that_moves_against_the_steps_does_not_track():
    moved = group_tracking(group(np.random.default_rng(3), 24, 4, coupling=-1.0))
    assert moved is not None and moved.r < -0.5 and moved.explained_pct > TRACKS_EXPLAINED_PCT and not moved.tracks


def test_too_few_rounds_or_a_still_canary_state_nothing_and_periods_are_not_one_move():
    rng = np.random.default_rng(4)
    assert group_tracking(group(rng, MIN_MOVES, 4, coupling=1.0)) is None  # 8 rounds: 7 moves
    still = [[RepTiming(r, True, 0.01, 0.1, 0.003 * (1 + rng.normal(0, 0.05)), round=r, canary_ms=1.7)
              for r in range(20)]]
    assert group_tracking(still) is None
    two = group_tracking(group(rng, 10, 4, coupling=1.0, periods=2))
    assert two is not None and two.moves == 18  # 9 moves a period, none across the periods


def test_tracking_takes_a_rounds_canary_once_and_skips_pairs_from_before_rounds():
    rows = [((0, 0, r), c, 2.0 * (1 + 0.1 * (r % 3)), 1.0 + 0.1 * (r % 3)) for r in range(12) for c in range(3)]
    t = tracking(rows)
    assert t is not None and t.r == pytest.approx(1.0) and t.moves == 11
    early = [RepTiming(0, True, 0.01, 0.1, 0.003, round=-1, canary_ms=9.0)]
    assert group_tracking([early]) is None


def diff_sides(r_base: float, r_head: float):
    from tests.unit.test_diff import side as diff_side

    base, raw_b = diff_side("0.31.0", {}, seed=1)
    head, raw_h = diff_side("0.32.0", {}, seed=2)
    base["canary_ms"], head["canary_ms"] = 1.7, 1.7 * 1.3
    head["step_ms"] *= 1.3
    raw_h = {k: v * 1.3 for k, v in raw_h.items()}
    base["canary_r"], head["canary_r"] = r_base, r_head
    return base, head, {**raw_b, **raw_h}


def test_normalize_canary_is_offered_only_where_the_canary_tracks():
    from hostsweep.compare import DiffOptions, diff

    options = DiffOptions(noise_floor_pct=1.0, normalize="canary")
    base, head, raw = diff_sides(0.8, 0.7)
    tracked = diff(base, head, raw, options)
    assert "ratio_canary" in tracked.cells and "the canary explains 64 % (base) / 49 % (head)" in tracked.machine
    base, head, raw = diff_sides(0.8, 0.2)
    blind = diff(base, head, raw, options)
    assert "ratio_canary" not in blind.cells
    assert any("the canary explains only head 4 %" in w and "no normalized ratios" in w for w in blind.warnings)
    assert (blind.cells["ratio"] == tracked.cells["ratio"]).all()  # the raw ratios stand either way


def test_the_design_line_says_how_much_the_canary_explained():
    from hostsweep.report.summary import design_line

    rows = [{"periods": 1, "canary_ms": 1.7, "canary_explains_pct": e, "sku": "cpu", "model": "m", "mode": "eager",
             "tp": 1} for e in (12.0, 40.0)]
    assert "explains 12–40 % of the steps' round-to-round moves" in design_line(rows)
    assert "explains" not in design_line([{k: v for k, v in r.items() if k != "canary_explains_pct"} for r in rows])
