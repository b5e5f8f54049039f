"""The measurement design against planted truths: a re-measure times the whole group again
(companions kept), a contended round is left out for every cell alike, the speed canary
catches a machine that changed speed, and a cell that moves alone between periods is
told apart from a machine that moved every cell."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from hostsweep.config.grid import build_cells
from hostsweep.measure.group import (MIN_PERIOD_PAIRS, GroupMeasurement, between_period_variance, half_width_after,
                                    pooled_periods)
from hostsweep.measure.periods import (
    DesignRecord, canary_shift_pct, clean_pairs, common_period_ratios, contended_rounds, period_disagrees,
)
from hostsweep.measure.protocol import Contention, RepTiming, summarize
from hostsweep.measure.results import MeasureOptions, cell_metrics
from tests.conftest import compose_typed
from tests.fakes import VirtualClock

QUIET = Contention(foreign_cpu_frac=0.01, engine_cpu_frac=0.9, steal_frac=0.0, load1=1.0)
BUSY = Contention(foreign_cpu_frac=0.6, engine_cpu_frac=0.4, steal_frac=0.0, load1=3.0)


def pairs_of(steps_ms, period=0, contention=QUIET, canary=None, first_round=0):
    """Timed pairs with these steps, one per round from first_round."""
    return tuple(RepTiming(k, k % 2 == 0, 0.01, 0.01 + s / 1e3 * 32, s / 1e3, first_round + k, contention,
                           period=period, canary_ms=None if canary is None else canary[k])
                 for k, s in enumerate(steps_ms))


def noisy(median_ms, n, rng, cv=0.02):
    return list(median_ms * np.exp(rng.normal(0.0, cv, n)))


def test_a_round_any_cell_met_a_neighbour_in_is_left_out_for_every_cell():
    rng = np.random.default_rng(1)
    a = list(pairs_of(noisy(5.0, 12, rng)))
    b = list(pairs_of(noisy(7.0, 12, rng)))
    a[3] = pairs_of([5.0], contention=BUSY, first_round=3)[0]  # only a's pair of round 3 met the neighbour
    contended = contended_rounds([a, b], max_foreign_cpu_frac=0.10)
    assert contended == {(0, 3)}
    kept_a, kept_b = clean_pairs(a, contended), clean_pairs(b, contended)
    assert [p.round for p in kept_a] == [p.round for p in kept_b] == [r for r in range(12) if r != 3]


def test_too_few_clean_rounds_leave_no_clean_estimate():
    rng = np.random.default_rng(2)
    steps = noisy(5.0, 12, rng)
    busy = [pairs_of([s], contention=BUSY if k % 3 else QUIET, first_round=k)[0] for k, s in enumerate(steps)]
    assert clean_pairs(busy, contended_rounds([busy], 0.10)) is None  # 4 of 12 clean


def test_the_canary_catches_a_machine_that_slowed_mid_run_and_ignores_one_slow_canary():
    rng = np.random.default_rng(3)
    steady = list(1.5 * np.exp(rng.normal(0, 0.03, 24)))
    slowed = steady[:12] + [c * 1.3 for c in steady[12:]]  # the machine 30 % slower from round 12
    spiked = steady[:5] + [15.0] + steady[6:]  # one canary hit by a page fault
    shift = {name: canary_shift_pct(pairs_of([5.0] * 24, canary=c))
             for name, c in [("steady", steady), ("slowed", slowed), ("spiked", spiked)]}
    assert shift["slowed"] == pytest.approx(30.0, abs=8.0)
    assert shift["steady"] < 8.0 and shift["spiked"] < 8.0
    assert canary_shift_pct(pairs_of([5.0] * 24)) is None  # no canary timed


def test_a_machine_that_moved_every_cell_is_not_a_cell_that_moved_alone():
    rng = np.random.default_rng(4)
    level, min_shift = 0.95, 3.0
    first = [pairs_of(noisy(m, 12, rng)) for m in (5.0, 6.0, 8.0)]
    machine = [p + pairs_of(noisy(m * 1.35, 12, rng), period=1, first_round=0)
               for p, m in zip(first, (5.0, 6.0, 8.0))]  # every cell 35 % slower in period 1
    common = common_period_ratios(machine)
    assert common[0] == pytest.approx(1.35, rel=0.05)
    assert not any(period_disagrees(cell, common, min_shift, level) for cell in machine)
    alone = machine[:2] + [first[2] + pairs_of(noisy(8.0 * 1.35 * 1.25, 12, rng), period=1)]  # one cell +25 % more
    common = common_period_ratios(alone)
    assert [period_disagrees(cell, common, min_shift, level) for cell in alone] == [False, False, True]


def group_of(*overrides: str) -> GroupMeasurement:
    # the ci_width re-measure's own tests need it on; test_a_ci_is_not_chased_by_default holds the default
    cfg = compose_typed(["+sku=cpu", "engine.name=fake", "measure.reps=12", "batch=[1,2,4]", "ctx=[16]",
                         "measure.remeasure_ci_width=true", *overrides])
    cells = build_cells(cfg)
    return GroupMeasurement(cells, [[[1]]] * len(cells), MeasureOptions.of(cfg.config))


@pytest.mark.parametrize("seed", range(20))
def test_periods_pool_with_every_cell_weighing_each_period_alike_so_cross_cell_ratios_hold(seed):
    """A machine 30 % slower in the second period moves every cell's number alike: the
    ratios between cells are those of the first period, and every pair is kept."""
    rng = np.random.default_rng(seed)
    truth = (5.0, 6.0, 8.0)
    group = group_of()
    group.take_period([pairs_of(noisy(m, 12, rng)) for m in truth])
    before = [s.step_ms for s in group.summaries]
    group.take_period([pairs_of(noisy(m * 1.3, 12, rng)) for m in truth])
    after = [s.step_ms for s in group.summaries]
    assert all(len(s.reps) == 24 and {p.period for p in s.reps} == {0, 1} for s in group.summaries)
    for k in (1, 2):
        assert after[k] / after[0] == pytest.approx(truth[k] / truth[0], rel=0.04)
        assert after[k] / after[0] == pytest.approx(before[k] / before[0], rel=0.04)
    assert all(v.attempts == 2 and v.design.periods == 2 for v in group.verdicts)
    assert all("period" not in v.reasons for v in group.verdicts)  # the machine moved, not a cell


def test_a_canary_that_moved_annotates_every_cell_of_the_group_without_making_one_unstable():
    rng = np.random.default_rng(5)
    canary = list(1.5 * np.exp(rng.normal(0, 0.02, 12)))
    slowed = canary[:6] + [c * 1.4 for c in canary[6:]]
    group = group_of()
    group.take_period([pairs_of(noisy(m, 12, rng), canary=slowed) for m in (5.0, 6.0, 8.0)])
    assert all(v.annotations == ("machine_speed",) and "machine_speed" not in v.reasons for v in group.verdicts)
    assert all(v.stable for v in group.verdicts)  # the cells' own pairs agree with themselves
    assert all(v.design.canary_shift_pct == pytest.approx(40.0, abs=10.0) for v in group.verdicts)
    group.take_period([pairs_of(noisy(m, 12, rng), canary=canary) for m in (5.0, 6.0, 8.0)])
    assert all("machine_speed" in v.annotations for v in group.verdicts)  # the second period's steady canary too


def test_a_cell_estimated_on_the_common_clean_rounds_says_how_many_pairs_it_rests_on():
    rng = np.random.default_rng(6)
    timings = [list(pairs_of(noisy(m, 12, rng))) for m in (5.0, 6.0, 8.0)]
    for r in (2, 7):  # two rounds in which the first cell's pair met a neighbour
        timings[0][r] = pairs_of([50.0], contention=BUSY, first_round=r)[0]  # and came out 10x slow
    group = group_of()
    group.take_period(timings)
    assert [v.design.clean_pairs for v in group.verdicts] == [10, 10, 10]
    assert all(v.design.contended_rounds == 2 for v in group.verdicts)
    assert group.summaries[0].step_ms == pytest.approx(5.0, rel=0.05)  # the slow pairs left out
    assert len(group.summaries[0].reps) == 12  # and kept
    metrics = cell_metrics_of(group, 0)
    assert metrics["clean_pairs"] == 10 and metrics["contended_rounds"] == 2 and metrics["periods"] == 1


def cell_metrics_of(group: GroupMeasurement, i: int) -> dict[str, float]:
    from hostsweep.measure.results import CellResult

    result = CellResult(key=group.cells[i].key, params=group.cells[i].params(), status="FINISHED",
                        measurement=group.summaries[i], error=None, stability=group.verdicts[i])
    return cell_metrics(result)


# The worker with the fake engine: thresholds no fake measurement breaks but the one planted.
FAKE = ["+sku=cpu", "engine.name=fake", "measure.reps=8", "measure.warmups=1", "measure.warmup_max_rounds=1",
        "measure.T=5", "measure.remeasure_ci_width=true",
        "batch=[1,2,4]", "ctx=[16]", "measure.max_foreign_cpu_frac=1.0", "split.enabled=false",
        "measure.replicate_first=false", "measure.max_canary_shift_pct=1000"]


def fake_study(*overrides: str):
    chosen = {o.split("=", 1)[0]: o for o in [*FAKE, *overrides]}
    cfg = compose_typed(list(chosen.values()))
    return build_cells(cfg), MeasureOptions.of(cfg.config)


def slowing_worker(tmp_path, spec, slow_after: int, factor: float, monkeypatch, noise: float = 0.02):
    """A SweepWorker on a virtual clock whose engine counts T-token generates per batch; each
    generate takes the fake engine's modelled time with `noise` (lognormal) and, from the
    `slow_after`-th generate on (T=1 and T alike), `factor` times as long: a machine that
    slowed down at a known moment."""
    from hostsweep.run import worker as worker_module

    monkeypatch.setenv("HOSTSWEEP_FAKE_TIME_SCALE", "0")  # the engine does not sleep: the clock is virtual
    clock, rng = VirtualClock(), np.random.default_rng(11)
    monkeypatch.setattr(worker_module, "time", clock)
    worker = worker_module.SweepWorker(spec, str(tmp_path))
    engine = worker.engine
    counts, generate, calls = Counter(), engine.generate, [0]

    def counted(prompts, tokens):
        out = generate(prompts, tokens)
        calls[0] += 1
        modelled = engine.overhead_s + engine.cycle_seconds(len(prompts), len(prompts[0])) * tokens
        clock.now += modelled * float(np.exp(rng.normal(0.0, noise))) * (factor if calls[0] > slow_after else 1.0)
        counts[len(prompts)] += tokens > 1
        return out

    engine.generate = counted
    return worker, counts


def test_a_re_measure_times_the_whole_group_again_and_keeps_the_ratios_between_cells(tmp_path, monkeypatch):
    # A CI target no measurement meets, taken as one a new period cures: the group is
    # unstable (ci_width) and re-measured once. Cells 1, 2 and 4 times as slow.
    monkeypatch.setattr("hostsweep.measure.group.half_width_after", lambda width, periods, more=1: 0.0)
    cells, options = fake_study("measure.max_ci_pct=1e-9", "measure.remeasure_unstable=1", "measure.T=17",
                                "batch=[1,11,31]")
    # slower from the second period on: after 3 cells x (1 warm-up + 8 pairs) x 2 generates
    worker, counts = slowing_worker(tmp_path, cells[0].engine, slow_after=3 * 9 * 2, factor=1.5,
                                    monkeypatch=monkeypatch)
    results = [worker.measure(cell, options, tuple(cells[i + 1:])) for i, cell in enumerate(cells)]
    assert counts == {1: 17, 11: 17, 31: 17}  # warm-up, then 8 pairs in each of two periods, every cell
    steps = [r.measurement.step_ms for r in results]
    periods = [r.stability.design.period_medians_ms for r in results]
    assert all(len(p) == 2 for p in periods)
    for k in (1, 2):  # the machine slowed between the periods; the cells' ratios did not move
        assert periods[k][1] / periods[0][1] == pytest.approx(periods[k][0] / periods[0][0], rel=0.15)
        assert steps[k] / steps[0] == pytest.approx(periods[k][0] / periods[0][0], rel=0.15)
    assert all(r.earlier_timings == () and {p.period for p in r.measurement.reps} == {0, 1} for r in results)
    assert all(r.measurement.reps[0].canary_ms is not None for r in results)


def test_a_stable_group_is_not_re_measured(tmp_path, monkeypatch):
    # no rule can fire, however loaded the machine: what is tested is that nothing triggers a period
    cells, options = fake_study("measure.max_ci_pct=1000", "measure.min_shift_pct=1000", "measure.remeasure_unstable=2")
    worker, counts = slowing_worker(tmp_path, cells[0].engine, slow_after=10**9, factor=1.0, monkeypatch=monkeypatch)
    result = worker.measure(cells[0], options, tuple(cells[1:]))
    assert counts == {1: 9, 2: 9, 4: 9} and result.stability.design.periods == 1, result.stability


# Twelve steps whose 95 % CI, [X(3), X(10)], lies `width` % either side of `median`, in an
# order whose halves agree (no drift); every cell of a group given the same order.
ORDER = [0, 11, 5, 6, 2, 9, 1, 10, 4, 7, 3, 8]


def steps_with_ci(median: float, width: float) -> list[float]:
    low, high = median * (1 - width / 100), median * (1 + width / 100)
    ranked = [low * 0.9, low * 0.95, low, median * 0.99, median * 0.995, median, median, median * 1.005,
              median * 1.01, high, high * 1.05, high * 1.1]
    return [ranked[k] for k in ORDER]


@pytest.mark.parametrize("width, cured", [(9.0, None), (12.0, True), (14.0, True), (14.5, False), (20.0, False)])
def test_a_group_is_re_measured_for_its_ci_only_when_one_more_period_would_bring_it_within_max_ci_pct(width, cured):
    group = group_of()  # measure.max_ci_pct 10: one more period narrows by sqrt(1/2), so up to +-14.1 %
    group.take_period([pairs_of(steps_with_ci(m, width)) for m in (5.0, 6.0, 8.0)])
    assert [s.ci_half_width_pct for s in group.summaries] == pytest.approx([width] * 3, rel=1e-6)
    assert all(("ci_width" in v.reasons) == (cured is not None) for v in group.verdicts)
    assert group.needs_another_period() is bool(cured)
    too_wide = group.too_wide_to_cure()
    if cured is False:  # flagged, not chased; the pairs one period would need to reach +-10 %
        assert [(c.key, n) for c, _, n in too_wide] == [(c.key, int(np.ceil(12 * (width / 10) ** 2)))
                                                         for c in group.cells]
    else:
        assert too_wide == []


@pytest.mark.parametrize("allowed, cured", [(1, False), (2, True)])
def test_the_ci_forecast_counts_every_period_remeasure_unstable_still_allows(allowed, cured):
    # +-16 %: one more period forecasts +-11.3 %, two more +-9.2 %
    group = group_of(f"measure.remeasure_unstable={allowed}")
    group.take_period([pairs_of(steps_with_ci(m, 16.0)) for m in (5.0, 6.0, 8.0)])
    assert group.needs_another_period() is cured and (group.too_wide_to_cure() == []) is cured


def test_a_neighbour_re_measures_a_group_whose_ci_alone_would_not():
    group = group_of()
    busy_rounds = {0, 2, 4, 6, 8, 10, 11}  # 5 clean rounds of 12: under half, too few to estimate on
    group.take_period([tuple(p if p.round not in busy_rounds else pairs_of([p.step_s * 1e3], contention=BUSY,
                                                                          first_round=p.round)[0]
                             for p in pairs_of(steps_with_ci(m, 20.0))) for m in (5.0, 6.0, 8.0)])
    assert all({"foreign_cpu", "ci_width"} <= set(v.reasons) for v in group.verdicts)
    assert group.needs_another_period()


def test_one_more_period_narrows_a_pooled_ci_as_predicted_over_many_noise_seeds():
    """The rule's forecast against what pooling two periods of 12 pairs gives: over 400
    simulated cells (lognormal noise, 10 % and 25 %), the median of (pooled half-width /
    first period's) is sqrt(1/2) within 10 %."""
    for cv in (0.10, 0.25):
        rng = np.random.default_rng(int(cv * 100))
        ratios = []
        for _ in range(400):
            first, second = pairs_of(noisy(5.0, 12, rng, cv)), pairs_of(noisy(5.0, 12, rng, cv), period=1)
            alone = summarize(first, 0.95).ci_half_width_pct
            ratios.append(pooled_periods([first, second], 0.95).ci_half_width_pct / alone)
        assert float(np.median(ratios)) == pytest.approx(half_width_after(1.0, 1), rel=0.10)


def test_a_worker_flags_a_ci_no_period_can_cure_and_says_how_many_pairs_would(tmp_path, monkeypatch, caplog):
    cells, options = fake_study("measure.remeasure_unstable=1", "measure.min_shift_pct=1000")
    # 30 % noise per generate: 8 pairs' CI (their min and max) tens of % wide
    worker, counts = slowing_worker(tmp_path, cells[0].engine, slow_after=10**9, factor=1.0, monkeypatch=monkeypatch,
                                    noise=0.3)
    with caplog.at_level("WARNING", logger="hostsweep.run.worker"):
        result = worker.measure(cells[0], options, tuple(cells[1:]))
    assert counts == {1: 9, 2: 9, 4: 9} and result.stability.design.periods == 1  # not timed again
    assert "ci_width" in result.stability.reasons
    assert "left flagged ci_width" in caplog.text and "pairs a period would" in caplog.text


def test_the_design_record_survives_the_journal():
    from hostsweep.record.journal import decode_stability
    from dataclasses import asdict

    group = group_of()
    rng = np.random.default_rng(7)
    group.take_period([pairs_of(noisy(m, 12, rng), canary=[1.5] * 12) for m in (5.0, 6.0, 8.0)])
    verdict = group.verdicts[0]
    assert isinstance(verdict.design, DesignRecord)
    assert decode_stability(asdict(verdict)) == verdict


def test_the_console_line_names_the_periods_a_pooled_number_comes_from_and_the_canarys_move():
    from hostsweep.measure.stability import Stability
    from hostsweep.record.recorder import periods_note, unstable_note

    pooled = Stability(attempts=2, design=DesignRecord(periods=2, period_medians_ms=(5.1, 6.62), canary_shift_pct=31.4))
    assert periods_note(pooled) == " (2 periods pooled: 5.100, 6.620 ms)"
    assert periods_note(Stability(design=DesignRecord(periods=1, period_medians_ms=(5.1,)))) == ""
    annotated = pooled.with_reason("machine_speed")
    assert annotated.stable and unstable_note(annotated) == ""
    assert unstable_note(annotated.with_reason("drift")) == ", UNSTABLE: drift"


def spied_profiles(worker) -> list[tuple[int, int]]:
    """(batch, round) of every profiled pair the worker takes, in the order taken."""
    taken, profile = [], worker._profile_pair

    def spy(cell, prompts, opts, keep, round_index=-1):
        taken.append((cell.batch, round_index))
        return profile(cell, prompts, opts, keep, round_index)

    worker._profile_pair = spy
    return taken


def test_the_splits_profiled_pairs_are_taken_in_the_same_rounds_for_every_cell(tmp_path, monkeypatch):
    cells, options = fake_study("split.enabled=true", "split.reps=3", "measure.reps=8", "measure.remeasure_unstable=0")
    worker, counts = slowing_worker(tmp_path, cells[0].engine, slow_after=10**9, factor=1.0, monkeypatch=monkeypatch)
    taken = spied_profiles(worker)
    results = [worker.measure(cell, options, tuple(cells[i + 1:])) for i, cell in enumerate(cells)]
    assert sorted(taken) == sorted((b, r) for b in (1, 2, 4) for r in (1, 4, 6))  # in the rounds, alike
    assert counts == {1: 9 + 3, 2: 9 + 3, 4: 9 + 3}  # the timed pairs, and one T generate per profiled pair
    assert all(r.split is not None and r.split.split_s > 0 for r in results)


def test_profiled_pairs_the_rounds_did_not_reach_are_taken_after_them(tmp_path, monkeypatch):
    cells, options = fake_study("split.enabled=true", "split.reps=3", "measure.reps=2", "measure.remeasure_unstable=0")
    worker, _ = slowing_worker(tmp_path, cells[0].engine, slow_after=10**9, factor=1.0, monkeypatch=monkeypatch)
    taken = spied_profiles(worker)
    worker.measure(cells[0], options, tuple(cells[1:]))
    assert sorted(taken) == sorted((b, r) for b in (1, 2, 4) for r in (0, 1, -1))  # -1: after the rounds


def test_profiled_rounds_spread_over_the_rounds_and_more_pairs_than_rounds_take_every_round():
    from hostsweep.measure.periods import profiled_rounds

    assert sorted(profiled_rounds(12, 3)) == [2, 6, 10]
    assert sorted(profiled_rounds(8, 1)) == [4]
    assert sorted(profiled_rounds(2, 3)) == [0, 1]  # the third pair is taken after the rounds
    assert profiled_rounds(0, 3) == frozenset()


def test_the_run_says_how_many_cells_were_re_measured_and_how_far_the_canary_moved():
    from hostsweep.report.summary import build_summary, design_counts, design_line

    rows = [{"periods": 2.0, "canary_ms": 1.7, "canary_shift_pct": 12.4}, {"periods": 2.0, "canary_ms": 1.8},
            {"periods": 1.0, "canary_ms": 1.6, "canary_shift_pct": 3.0}]
    assert design_line(rows) == "re-measured 2 of 3 cells (2 periods); speed canary 1.700 ms, moved up to 12 % within a group"
    assert design_line([{"periods": 1.0}]) == "no cell re-measured (1 cells, one period each)"
    assert design_line([{"step_ms": 1.0}]) is None  # measured before periods existed
    import pandas as pd
    assert build_summary(pd.DataFrame(rows), {"ci_level": 0.95})["design"] == {**design_counts(rows), "line": design_line(rows)}


def test_a_flagged_split_is_profiled_again_within_its_group_before_any_cell_is_handed_over(tmp_path, monkeypatch):
    import dataclasses

    cells, options = fake_study("split.enabled=true", "split.reps=3", "measure.reps=8", "measure.remeasure_unstable=1")
    worker, _ = slowing_worker(tmp_path, cells[0].engine, slow_after=10**9, factor=1.0, monkeypatch=monkeypatch)
    taken, split = spied_profiles(worker), worker._split

    def planted(cell, pairs, measurement, opts):  # batch 2's split fails a physical check, every time
        result = split(cell, pairs, measurement, opts)
        return dataclasses.replace(result, implausible=("planted",)) if cell.batch == 2 else result

    worker._split = planted
    first = worker.measure(cells[0], options, tuple(cells[1:]))
    assert taken[-3:] == [(2, -1)] * 3 and len(taken) == 12  # in the rounds, then batch 2 again before hand-over
    rest = [worker.measure(cell, options, tuple(cells[i + 2:])) for i, cell in enumerate(cells[1:])]
    assert len(taken) == 12  # nothing profiled alone when the cells are asked for
    flags = {r.params["batch"]: "split_implausible" in r.stability.reasons for r in [first, *rest]}
    assert flags == {1: False, 2: True, 4: False}


def test_a_cell_whose_profiling_fails_fails_alone(tmp_path, monkeypatch):
    cells, options = fake_study("split.enabled=true", "split.reps=3", "measure.reps=8", "measure.remeasure_unstable=0")
    worker, _ = slowing_worker(tmp_path, cells[0].engine, slow_after=10**9, factor=1.0, monkeypatch=monkeypatch)
    profile = worker._profile_pair

    def broken(cell, prompts, opts, keep, round_index=-1):
        if cell.batch == 4:
            raise ValueError("trace unreadable")
        return profile(cell, prompts, opts, keep, round_index)

    worker._profile_pair = broken
    results = [worker.measure(cell, options, tuple(cells[i + 1:])) for i, cell in enumerate(cells)]
    status = {r.params["batch"]: r.status for r in results}
    assert status == {1: "FINISHED", 2: "FINISHED", 4: "FAILED"}
    assert "profiling the cell failed: ValueError: trace unreadable" in results[2].error


def test_a_cell_timed_in_two_periods_that_disagree_can_detect_less_than_one_whose_periods_agree():
    """Its CI over the periods is the fixed-effects one (within-period noise), so its MDE adds
    the spread of the period medians: a machine that moved between periods widens it."""
    from hostsweep.measure.detectable import cell_mde_pct

    agree = cell_mde_pct(5.0, 4.9, 5.1, 0.95, period_medians_ms=(5.0, 5.0))
    apart = cell_mde_pct(5.0, 4.9, 5.1, 0.95, period_medians_ms=(4.5, 5.5))
    assert agree == pytest.approx(cell_mde_pct(5.0, 4.9, 5.1, 0.95))  # no spread: the CI alone
    assert apart > agree + 10  # a 20 % spread between periods is in the MDE


@pytest.mark.parametrize("target", [2.0, 5.0, 10.0, 30.0])
def test_the_ci_target_for_a_detectable_effect_gives_exactly_that_effect(target):
    from hostsweep.measure.detectable import cell_mde_pct, ci_target_for_mde

    half = ci_target_for_mde(target, 0.95)
    assert cell_mde_pct(10.0, 10.0 * (1 - half / 100), 10.0 * (1 + half / 100), 0.95) == pytest.approx(target)


def test_a_cell_asked_for_a_detectable_effect_stops_once_it_can_detect_it(tmp_path, monkeypatch):
    from hostsweep.measure.results import cell_metrics

    taken = {}
    for target in (4.0, 12.0):
        cells, options = fake_study(f"measure.target_mde_pct={target}", "measure.min_reps=8", "measure.max_reps=48",
                                    "measure.remeasure_unstable=0", "batch=[1]")
        assert cells[0].adaptive and cells[0].params()["target_mde_pct"] == target
        worker, counts = slowing_worker(tmp_path / str(target), cells[0].engine, slow_after=10**9, factor=1.0,
                                        monkeypatch=monkeypatch, noise=0.05)
        result = worker.measure(cells[0], options)
        taken[target] = len(result.measurement.reps)
        mde = cell_metrics(result)["mde_pct"]
        assert mde <= target or taken[target] == 48, (target, mde, taken[target])
    assert taken[4.0] > taken[12.0]  # a smaller effect needs more pairs


def test_a_detectable_effect_target_is_its_own_cell_and_excludes_a_ci_target():
    from hostsweep.config.schema import ConfigError

    plain, mde = (fake_study(*o)[0][0] for o in ((), ("measure.target_mde_pct=5",)))
    assert plain.key != mde.key and not plain.adaptive
    with pytest.raises(ConfigError, match="measure.target_ci_pct and measure.target_mde_pct are two ways"):
        fake_study("measure.target_mde_pct=5", "measure.target_ci_pct=2")
    with pytest.raises(ConfigError, match="measure.target_mde_pct must be a percentage in"):
        fake_study("measure.target_mde_pct=0")


def test_a_steady_machine_with_a_noisy_canary_is_rarely_flagged_machine_speed():
    """500 groups of 6 cells x 12 rounds on a machine of constant speed, each canary with a
    20 % spread and one canary in twenty 3 times slow: the 15 % threshold fires in under 5 %
    of them (1.8 % with this seed); a 30 % slowdown half way is caught in nearly all (98 %)."""
    rng = np.random.default_rng(12)
    steady, slowed = [], []
    for _ in range(500):
        canary = 1.7 * np.exp(rng.normal(0, 0.2, (12, 6))) * np.where(rng.random((12, 6)) < 0.05, 3.0, 1.0)
        pairs = [RepTiming(0, True, 0.01, 0.02, 0.001, r, canary_ms=float(canary[r, c]))
                 for r in range(12) for c in range(6)]
        steady.append(canary_shift_pct(pairs) > 15.0)
        slow = [dataclasses_replace(p, canary_ms=p.canary_ms * (1.3 if p.round >= 6 else 1.0)) for p in pairs]
        slowed.append(canary_shift_pct(slow) > 15.0)
    assert np.mean(steady) < 0.05 and np.mean(slowed) > 0.9


def dataclasses_replace(pair, **changes):
    import dataclasses

    return dataclasses.replace(pair, **changes)


def test_a_period_left_with_one_pair_still_gives_the_pooled_cell_a_finite_ci():
    # the common clean rounds can leave a period one pair: its CI has no width and coverage
    # 0, and reading a standard error from it made the cell's CI NaN (then unlogged in MLflow)
    rng = np.random.default_rng(3)
    first = pairs_of(noisy(5.0, 12, rng))
    second = pairs_of([5.2], period=1)
    pooled = pooled_periods([first, second], 0.95)
    assert np.isfinite(pooled.step_ci_low_ms) and np.isfinite(pooled.step_ci_high_ms)
    assert pooled.step_ci_low_ms <= pooled.step_ms <= pooled.step_ci_high_ms
    assert len(pooled.reps) == 13 and 0.95 <= pooled.ci_coverage < 1.0
    both = pooled_periods([first, pairs_of(noisy(5.5, 12, rng), period=1)], 0.95)  # the usual case is unchanged
    assert both.step_ms == pytest.approx((np.median([p.step_s for p in first]) * 1e3
                                          + np.median([p.step_s for p in both.reps[12:]]) * 1e3) / 2)


def machine_and_cells(rng, machine, cell_moves=None, medians=(4.0, 4.5, 5.0, 6.0, 7.0, 8.0), cv=0.05):
    """One period's pairs of a group: each round's steps are the cell's median times the
    machine's speed in that round (shared by every cell) times the cell's own movement,
    with lognormal noise per pair."""
    moves = cell_moves or {}
    return [pairs_of([m * machine[r] * moves.get(i, np.ones(len(machine)))[r] * float(np.exp(rng.normal(0, cv)))
                      for r in range(len(machine))])
            for i, m in enumerate(medians)]


def fresh_groups(*overrides: str):
    """A new GroupMeasurement of the same cells for every call (composing the config once)."""
    cfg = compose_typed(["+sku=cpu", "engine.name=fake", "measure.reps=12", "batch=[1,2,4]", "ctx=[16]", *overrides])
    cells, options = build_cells(cfg), MeasureOptions.of(cfg.config)
    return lambda: GroupMeasurement(cells, [[[1]]] * len(cells), options)


RAMP = np.linspace(1.0, 1.3, 12)  # the machine 30 % slower by the group's last round
STEADY = np.ones(12)
ALONE = np.where(np.arange(12) >= 6, 1.2, 1.0)  # one cell 20 % slower from its seventh round


def test_a_machine_that_slowed_over_the_rounds_is_the_groups_trend_not_every_cells_drift():
    """100 groups of 6 cells x 12 rounds on a machine 30 % slower by the end, which no canary
    saw: the raw pairs of about 80 % of the cells drift, but against its companions no cell
    does beyond the drift test's own false-alarm rate (4.2 % here; 4.5 % over 400 groups);
    the group is annotated group_trend (in nearly all), with how far its cells moved
    together, and no cell is unstable for it. On a steady machine the group rarely is."""
    drift, machine, moved, steady = [], [], [], []
    new_group = fresh_groups("ctx=[16,32]")
    for seed in range(100):
        group = new_group()
        group.take_period(machine_and_cells(np.random.default_rng(seed), RAMP))
        drift += ["drift" in v.reasons for v in group.verdicts]
        machine.append(all(v.annotations == ("group_trend",) for v in group.verdicts))
        moved.append(group.verdicts[0].design.common_shift_pct)
        group = new_group()
        group.take_period(machine_and_cells(np.random.default_rng(1000 + seed), STEADY))
        steady.append("group_trend" in group.verdicts[0].annotations)
    assert np.mean(drift) < 0.06
    assert np.mean(machine) > 0.95 and np.mean(steady) < 0.05
    assert np.median(moved) == pytest.approx(15.4, abs=4.0)  # the halves' medians: 1.068 and 1.232


def test_a_cell_that_moved_alone_is_flagged_drift_and_its_companions_are_not():
    """A steady machine (then the same machine slowing 30 % over the rounds), one cell of six
    20 % slower from its seventh round: that cell is flagged drift in nearly every group
    (98 % of 100), its companions about as often as the test's false-alarm rate (3.2 %: the
    cell that moved alone is not their companion once found), and the machine's move is
    not taken for the cell's."""
    new_group = fresh_groups("ctx=[16,32]")
    for machine_path in (STEADY, RAMP):
        alone, others = [], []
        for seed in range(100):
            group = new_group()
            group.take_period(machine_and_cells(np.random.default_rng(seed), machine_path, {2: ALONE}))
            flags = ["drift" in v.reasons for v in group.verdicts]
            alone.append(flags[2])
            others += flags[:2] + flags[3:]
        assert np.mean(alone) > 0.9
        assert np.mean(others) < 0.06


def test_a_group_of_one_cell_judges_drift_on_its_own_pairs():
    """Without companions nothing tells the machine from the cell: a cell alone that moved
    20 % is flagged drift, as before there were companions, and no common move is recorded."""
    flagged = []
    new_group = fresh_groups("batch=[1]")
    for seed in range(50):
        group = new_group()
        group.take_period(machine_and_cells(np.random.default_rng(seed), STEADY, {0: ALONE}, medians=(5.0,)))
        flagged.append("drift" in group.verdicts[0].reasons)
        assert group.verdicts[0].design.common_shift_pct is None
    assert np.mean(flagged) > 0.9


def test_the_console_says_how_far_the_cells_moved_together_beside_the_canary():
    from hostsweep.record.recorder import group_note, unstable_note

    group = group_of("ctx=[16,32]")
    group.take_period(machine_and_cells(np.random.default_rng(0), RAMP))
    assert unstable_note(group.verdicts[0]) == ""
    assert group_note(group.verdicts[0]).startswith("group_trend (the cells together moved ")
    assert cell_metrics_of(group, 0)["common_shift_pct"] == pytest.approx(group.verdicts[0].design.common_shift_pct,
                                                                          abs=1e-3)  # metrics are rounded


def test_a_cell_whose_prefill_outlasts_its_steps_is_pointed_to_a_T_that_narrows_its_pairs():
    """b8 ctx1024 of the paired proofs: a T=1 generate of 1.3 s (sd 0.13 s) against 8 ms steps.
    At T=33 the pair's step is mostly the two prefills' noise over 32; at the T the rule
    names, the simulated pairs' spread is several times smaller (known parameters, 4,000 pairs)."""
    import numpy as np

    from hostsweep.measure.protocol import prefill_bound_T
    from hostsweep.report.summary import design_counts, design_line

    assert prefill_bound_T(1300.0, 8.0, 33) == 193 and prefill_bound_T(25.0, 5.0, 33) is None
    assert prefill_bound_T(1300.0, 8.0, 193) is None and prefill_bound_T(float("nan"), 8.0, 33) is None
    rng = np.random.default_rng(0)

    def pair_steps(T: int) -> np.ndarray:
        prefills = rng.normal(1300.0, 130.0, (4000, 2))
        steps = rng.normal(8.0, 0.8, (4000, T - 1)).sum(axis=1)
        return (prefills[:, 1] + 8.0 + steps - 8.0 - prefills[:, 0]) / (T - 1)

    assert np.std(pair_steps(33)) > 3.5 * np.std(pair_steps(prefill_bound_T(1300.0, 8.0, 33)))
    rows = [{"periods": 1.0, "status": "FINISHED", "T": 33, "batch": 8, "ctx": 1024, "wall_1_ms": 1300.0,
             "step_ms": 8.0, "model": "m"},
            {"periods": 1.0, "status": "FINISHED", "T": 33, "batch": 1, "ctx": 128, "wall_1_ms": 25.0,
             "step_ms": 5.0, "model": "m"}]
    assert design_counts(rows)["prefill_bound"] == {"b8 ctx1024": 193}
    assert "1 cell(s) prefill for longer than their T−1 steps (b8 ctx1024)" in design_line(rows)
    assert "measure.T=193" in design_line(rows)


def test_drift_sends_a_group_to_a_new_period_at_the_groups_family_wise_level():
    """100 steady groups of 6 cells x 12 rounds: some cell of a group is flagged drift (each at
    the drift test's own level) in 21 of them, which would each be timed again; at the
    group's family-wise level (Bonferroni over its cells) 2 are. One cell 20 % slower from its
    seventh round is still sent in 75 of 100 groups (and flagged drift in 98)."""
    new_group = fresh_groups("ctx=[16,32]")
    flagged, sent, alone = [], [], []
    for seed in range(100):
        group = new_group()
        group.take_period(machine_and_cells(np.random.default_rng(seed), STEADY))
        flagged.append(any("drift" in v.reasons for v in group.verdicts))
        sent.append(group.needs_another_period())
        group = new_group()
        group.take_period(machine_and_cells(np.random.default_rng(500 + seed), STEADY, {2: ALONE}))
        alone.append(group.needs_another_period() and 2 in group.drift_across_group)
    assert np.mean(flagged) > 0.12  # measured 21 %: six tests at 5 % each
    assert np.mean(sent) < 0.06  # measured 2 %
    assert np.mean(alone) > 0.6  # measured 75 % (flagged drift, the cell's verdict, in 98 %)


def test_a_ci_is_not_chased_with_a_new_period_by_default():
    """A CI just over measure.max_ci_pct, which one more period is forecast to cure: by default
    (measure.remeasure_ci_width=false) the group is not timed again for it, the cell is
    flagged ci_width and named among those left flagged; with it on, the group is sent."""
    def group_with_wide_ci(*overrides: str) -> GroupMeasurement:
        cfg = compose_typed(["+sku=cpu", "engine.name=fake", "measure.reps=12", "batch=[1,2,4]", "ctx=[16]",
                             *overrides])
        cells = build_cells(cfg)
        group = GroupMeasurement(cells, [[[1]]] * len(cells), MeasureOptions.of(cfg.config))
        rng = np.random.default_rng(1)  # cell 3's CI comes out ±11.2 %: one more period forecasts ±7.9 %
        group.take_period([pairs_of(list(m * np.exp(rng.normal(0, s, 12)))) for m, s in
                           ((5.0, 0.01), (6.0, 0.01), (8.0, 0.13))])
        return group

    default = group_with_wide_ci()
    assert "ci_width" in default.verdicts[2].reasons
    assert not default.needs_another_period()
    assert [cell.batch for cell, _, _ in default.too_wide_to_cure()] == [4]
    chased = group_with_wide_ci("measure.remeasure_ci_width=true")
    assert chased.summaries[2].ci_half_width_pct == pytest.approx(11.2, abs=0.1)
    assert chased.needs_another_period() and chased.curable_reasons() == ["ci_width"]
    assert chased.too_wide_to_cure() == []


def test_the_design_line_says_what_each_period_was_for_and_each_groups_note_once():
    from hostsweep.report.summary import design_counts, design_line

    def row(batch: int, model: str, annotations: str = "", why: str = "") -> dict:
        return {"sku": "cpu", "model": model, "mode": "eager", "tp": 1, "batch": batch, "ctx": 128,
                "periods": 2 if why else 1, "remeasured_for": why, "group_annotations": annotations,
                "common_shift_pct": 12.4 if annotations else 1.0, "canary_shift_pct": 1.2, "warmup_rounds": 3,
                "canary_ms": 1.7}

    rows = [*(row(b, "tiny-llama", "group_trend", "ci_width") for b in (1, 2, 4)),
            *(row(b, "small-llama", why="foreign_cpu") for b in (1, 2))]
    line = design_line(rows)
    assert "re-measured 5 of 5 cells (2 periods; a period for foreign_cpu, ci_width)" in line
    assert "group note cpu/tiny-llama/eager/tp1: group_trend (cells together moved 12 %, canary 1 %)" in line
    assert line.count("group note") == 1 and "warm-up 3 round(s)" in line
    assert design_counts(rows)["groups_annotated"]["cpu/tiny-llama/eager/tp1"]["annotations"] == ["group_trend"]


def period_coverage(tau: float, seeds: int, monkeypatch=None) -> tuple[float, float]:
    """(coverage of the cell's true step, median half-width %) of pooled two-period CIs, each
    period 12 pairs of 5 % noise shifted by its own N(0, tau) on log scale."""
    rng = np.random.default_rng([int(tau * 1000), seeds])
    covered, widths = [], []
    for _ in range(seeds):
        parts = [pairs_of(noisy(5.0 * float(np.exp(rng.normal(0, tau))), 12, rng, 0.05), period=i) for i in range(2)]
        m = pooled_periods(parts, 0.95)
        covered.append(m.step_ci_low_ms <= 5.0 <= m.step_ci_high_ms)
        widths.append(m.ci_half_width_pct)
    return float(np.mean(covered)), float(np.median(widths))


@pytest.mark.parametrize("tau,at_least", [(0.0, 0.93), (0.02, 0.85), (0.05, 0.72), (0.10, 0.65)])
def test_pooled_periods_add_the_between_period_variance_and_cover_more_than_fixed_effects(tau, at_least, monkeypatch):
    """Over 600 simulated cells: with a between-period shift tau the random-effects CI covers
    the cell's step far more often than the fixed-effects CI it replaced (which kept its width
    whatever the periods' disagreement), and as often when the periods agree. Two periods
    estimate tau poorly, so it still falls short of 95 % at large tau: the docs give the rates."""
    import hostsweep.measure.group as group

    random_effects, width = period_coverage(tau, 600)
    monkeypatch.setattr(group, "between_period_variance", lambda medians, ses: 0.0)
    fixed_effects, fixed_width = period_coverage(tau, 600)
    assert random_effects >= at_least, (tau, random_effects)
    assert random_effects >= fixed_effects - 0.01
    if tau >= 0.05:
        assert random_effects >= fixed_effects + 0.15 and width > 1.4 * fixed_width


def test_the_between_period_variance_is_recovered_from_known_period_shifts():
    """DerSimonian–Laird on many periods of known spread: tau^2 recovered within 20 %, and 0
    when every period's median lies within its own error."""
    rng = np.random.default_rng(7)
    tau, se = 0.3, np.full(400, 0.1)
    medians = 5.0 + rng.normal(0, tau, 400) + rng.normal(0, 0.1, 400)
    assert between_period_variance(medians, se) == pytest.approx(tau ** 2, rel=0.2)
    assert between_period_variance([5.0, 5.01, 4.99], [0.1, 0.1, 0.1]) == 0.0


def test_a_period_of_fewer_than_six_pairs_is_not_pooled_as_its_own_estimate():
    rng = np.random.default_rng(11)
    first, short = pairs_of(noisy(5.0, 12, rng)), pairs_of(noisy(5.3, MIN_PERIOD_PAIRS - 1, rng), period=1)
    pooled = pooled_periods([first, short], 0.95)
    assert pooled.step_ms == pytest.approx(float(np.median([p.step_s for p in first + short])) * 1e3)
