"""Paired rounds (pair.design=rounds): both sides' engines in one worker, a cell's two pairs
timed back to back in every round, so a machine whose speed swings between rounds lands on
both sides of a round alike; where the sides cannot share a worker the study says why in one
line, or (auto) pairs engine starts instead."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from hostsweep.config.grid import build_cells, group_by_engine, rounds_partners
from hostsweep.config.schema import ConfigError
from hostsweep.measure.results import MeasureOptions
from tests.conftest import compose_typed
from tests.fakes import VirtualClock

FAST = ["+sku=cpu", "engine.name=fake", "measure.T=5", "measure.reps=12", "measure.warmups=1", "ctx=[16]",
        "batch=[1,2]", "measure.max_foreign_cpu_frac=1.0", "measure.max_canary_shift_pct=1000"]


def sides(cells):
    return [c for c in cells if c.engine.side == "a"], [c for c in cells if c.engine.side == "b"]


def test_a_paired_study_on_a_cpu_node_is_measured_in_paired_rounds_one_engine_start_each(caplog):
    study = compose_typed([*FAST, "pair.enabled=true"])
    assert (study.config.pair.design, study.config.pair.starts) == ("rounds", 1)
    cells = build_cells(study)
    a, b = sides(cells)
    assert {c.replicates for c in cells} == {1} and {c.params()["pair_design"] for c in cells} == {"rounds"}
    assert rounds_partners(cells) == {a[0].engine: b[0].engine}
    starts = build_cells(compose_typed([*FAST, "pair.enabled=true", "pair.design=starts"]))
    assert {c.key for c in starts}.isdisjoint(c.key for c in cells)  # another measurement, another key
    assert rounds_partners(starts) == {} and {c.replicates for c in starts} == {3}
    # the split needs one engine per process: off in paired rounds, and the run says so
    assert not compose_typed([*FAST, "pair.enabled=true", "split.enabled=true"]).config.split.enabled
    assert "the split (split.enabled) is not measured in paired rounds" in caplog.text


def test_cpu_sides_that_need_their_own_worker_are_paired_in_rounds_and_the_rest_pair_engine_starts(tmp_path):
    import sys

    # another Python or another TP degree: side b's engine in a partner worker on the same node
    auto = compose_typed([*FAST, "pair.enabled=true", f"pair.python={sys.executable}"])
    assert (auto.config.pair.design, auto.config.pair.starts) == ("rounds", 1)
    assert compose_typed([*FAST, "+pair.against.tp=2", "tp=[1]"]).config.pair.design == "rounds"
    assert compose_typed([*FAST, "pair.enabled=true", f"pair.python={sys.executable}",
                          "pair.design=starts"]).config.pair.starts == 3
    for asks_starts in ("pair.starts=4", "measure.target_mde_pct=5", "linearity.enabled=true"):
        assert compose_typed([*FAST, "pair.enabled=true", asks_starts]).config.pair.design == "starts", asks_starts
    gpu = ["+sku=h200", "engine.name=fake", "ctx=[16]", "batch=[1]", "pair.enabled=true"]
    assert compose_typed(gpu).config.pair.design == "starts"
    shared = compose_typed([*gpu, "pair.design=rounds", "engine.gpu_memory_utilization=0.45"])
    assert shared.config.pair.design == "rounds"
    # on GPUs a partner worker would need GPUs of its own: start pairs
    assert compose_typed([*gpu, f"pair.python={sys.executable}"]).config.pair.design == "starts"
    with pytest.raises(ConfigError, match="on GPUs its engine would need a partner worker"):
        compose_typed([*gpu, f"pair.python={sys.executable}", "pair.design=rounds",
                       "engine.gpu_memory_utilization=0.45"])


@pytest.mark.parametrize("overrides,needle", [
    (["pair.design=rounds", "+pair.against.sku=h100"], "pair.design=rounds: the sides differ in SKU"),
    (["pair.design=rounds", "pair.starts=3"], "pair.starts=3 is the starts design's"),
    (["pair.design=rounds", "measure.target_ci_pct=2"], "paired rounds time both sides measure.reps rounds each"),
    (["pair.design=rounds", "linearity.enabled=true"], "linearity.enabled: the linearity check runs on one engine"),
    (["pair.design=sometimes"], "pair.design must be one of auto, rounds, starts"),
])
def test_a_rounds_design_the_sides_cannot_take_is_refused_in_one_line(overrides, needle):
    with pytest.raises(ConfigError) as refused:
        compose_typed([*FAST, "pair.enabled=true", *overrides])
    assert needle in str(refused.value) and "\n" not in str(refused.value)


def test_two_gpu_engines_whose_memory_does_not_fit_beside_each_other_are_refused():
    with pytest.raises(ConfigError, match=r"add up to 1.8 \(> 0.95\)"):
        compose_typed(["+sku=h200", "engine.name=fake", "ctx=[16]", "batch=[1]", "pair.enabled=true",
                       "pair.design=rounds"])


def paired_worker(tmp_path, monkeypatch, cells, planted: float, swing: float, noise: float = 0.01,
                  switch_s: float = 0.0, across_workers: bool = False):
    """A worker holding both sides' fake engines on a virtual clock. Every generate takes the
    fake engine's modelled time times the machine's speed, which swings between 1 and `swing`
    every 5 generates (a machine whose speed changes faster than an engine start), times
    `planted` on side b, with lognormal `noise`; the first generate after the other side's
    engine ran costs `switch_s` more (a cost of switching engines: caches, the other engine's
    threads). across_workers: side b's engine in a partner worker of its own (another Python
    or TP degree would need one), which the first worker times in the same rounds. Returns the
    worker that coordinates and the generate log (side, batch, tokens) in call order."""
    from hostsweep.run import worker as worker_module

    monkeypatch.setenv("HOSTSWEEP_FAKE_TIME_SCALE", "0")
    clock, rng, calls = VirtualClock(), np.random.default_rng(5), []
    monkeypatch.setattr(worker_module, "time", clock)
    a, b = sides(cells)
    # as if side b ran under another Python: its engine in a partner worker (in-process here)
    monkeypatch.setattr(worker_module, "needs_own_worker", lambda spec, partner: across_workers)
    worker = worker_module.SweepWorker(a[0].engine, str(tmp_path), partner=b[0].engine)
    partner = worker.partner_worker
    if across_workers:
        assert set(worker.engines) == {a[0].engine} and set(partner.engines) == {b[0].engine}
    engines = {**worker.engines, **(partner.engines if across_workers else {})}
    # the speed canary runs on the real clock: a constant one keeps the warm-up rounds, and so
    # the generates the swing and the noise fall on, the same however busy the machine is
    for holder in {id(w): w for w in (worker, partner if across_workers else worker)}.values():
        monkeypatch.setattr(holder.canary, "time_ms", lambda: 2.0)
    for spec, engine in engines.items():
        generate = engine.generate

        def timed(prompts, tokens, engine=engine, generate=generate, side=spec.side):
            out = generate(prompts, tokens)
            speed = swing if (len(calls) // 5) % 2 else 1.0
            modelled = engine.overhead_s + engine.cycle_seconds(len(prompts), len(prompts[0])) * tokens
            clock.now += modelled * speed * (planted if side == "b" else 1.0) * float(np.exp(rng.normal(0, noise)))
            clock.now += switch_s if calls and calls[-1][0] != side else 0.0
            calls.append((side, len(prompts), tokens))
            return out

        engine.generate = timed
    return worker, calls


def measured(worker, cells, options):
    """Every cell measured as the dispatcher asks: the first with the rest as its companions."""
    queue = [c for pair in zip(*sides(cells)) for c in pair]
    return {c.key: worker.measure(c, options, tuple(queue[i + 1:])) for i, c in enumerate(queue)}


@pytest.mark.parametrize("across_workers", [False, True])
def test_a_cells_two_sides_are_timed_back_to_back_in_every_round_each_side_first_as_often(tmp_path, monkeypatch,
                                                                                         across_workers):
    study = compose_typed([*FAST, "pair.enabled=true"])
    cells = build_cells(study)
    worker, calls = paired_worker(tmp_path, monkeypatch, cells, planted=1.0, swing=1.0, across_workers=across_workers)
    results = measured(worker, cells, MeasureOptions.of(study.config))
    assert {r.status for r in results.values()} == {"FINISHED"}
    assert {r.host["hostname"] for r in results.values()} and len(group_by_engine(cells)) == 2
    for a, b in zip(*sides(cells)):
        pa, pb = results[a.key].measurement.reps, results[b.key].measurement.reps
        assert len(pa) == len(pb) == 12 and len({p.pair_round for p in pa}) == 12
        assert [p.pair_round for p in pa] == [p.pair_round for p in pb] and [p.round for p in pa] == [p.round for p in pb]
    # after the warm-up rounds of both sides: each round a pair (T=1 and T) of each of its 2 cells
    side_a, side_b = sides(cells)
    warm = sum(results[side[0].key].stability.design.warmup_rounds for side in (side_a, side_b))
    timed = calls[2 * 2 * warm:]
    pairs = [timed[i:i + 2] for i in range(0, len(timed), 2)]
    assert all(p[0][0] == p[1][0] and p[0][1] == p[1][1] for p in pairs)  # a pair is one side's T=1 and T
    slots = [pairs[i:i + 2] for i in range(0, len(pairs), 2)]
    assert all(s[0][0][1] == s[1][0][1] and {s[0][0][0], s[1][0][0]} == {"a", "b"} for s in slots)  # back to back
    first = Counter((s[0][0][1], s[0][0][0]) for s in slots)
    assert first == {(1, "a"): 6, (1, "b"): 6, (2, "a"): 6, (2, "b"): 6}


def test_every_slot_meets_all_four_side_and_t_orders_within_four_rounds():
    from hostsweep.measure.protocol import side_a_first

    for slot in range(5):
        for start in range(0, 16, 4):
            combos = {(side_a_first(k, slot), k % 2 == 0) for k in range(start, start + 4)}
            assert combos == {(True, True), (True, False), (False, True), (False, False)}


@pytest.mark.parametrize("counterbalanced,across_workers", [(True, False), (False, False), (True, True)])
def test_a_cost_of_switching_engines_leaves_a_paired_aa_at_one_only_when_the_orders_are_counterbalanced(
        tmp_path, monkeypatch, counterbalanced, across_workers):
    """A paired A/A whose first generate after the other engine's costs 0.1 ms more (steps of
    about 0.6 ms, T=5): with the side order counterbalanced against the T order the rounds'
    geometric mean ratio stays within 1.2 % of 1 (0.4 and 0.7 % here: the switch raises a
    round's ratio as often as it lowers it); flipped together (the old order) the switch lands
    on the same generate of each side in every round and the ratio leans 2-4 % (0.979, 1.044),
    which more rounds do not remove."""
    from hostsweep.run import worker as worker_module

    if not counterbalanced:
        monkeypatch.setattr(worker_module, "side_a_first", lambda k, slot: (k + slot) % 2 == 0)
    study = compose_typed([*FAST, "pair.enabled=true", "measure.reps=16"])
    cells = build_cells(study)
    worker, _ = paired_worker(tmp_path, monkeypatch, cells, planted=1.0, swing=1.0, noise=0.002, switch_s=1e-4,
                              across_workers=across_workers)
    results = measured(worker, cells, MeasureOptions.of(study.config))
    for a, b in zip(*sides(cells)):
        pa, pb = results[a.key].measurement.reps, results[b.key].measurement.reps
        log_ratios = np.log([q.step_s / p.step_s for p, q in zip(pa, pb)])
        lean = abs(float(np.exp(np.mean(log_ratios))) - 1.0)
        assert (lean < 0.012) if counterbalanced else (lean > 0.015), lean


@pytest.mark.parametrize("planted,across_workers", [(1.0, False), (1.10, False), (1.10, True)])
def test_a_machine_whose_speed_swings_between_rounds_leaves_the_per_round_ratio_at_the_planted_one(
        tmp_path, monkeypatch, planted, across_workers):
    study = compose_typed([*FAST, "pair.enabled=true"])
    cells = build_cells(study)
    worker, _ = paired_worker(tmp_path, monkeypatch, cells, planted=planted, swing=1.5, across_workers=across_workers)
    results = measured(worker, cells, MeasureOptions.of(study.config))
    for a, b in zip(*sides(cells)):
        pa, pb = results[a.key].measurement.reps, results[b.key].measurement.reps
        steps = np.array([p.step_s for p in pa])
        assert steps.max() / steps.min() > 1.3  # each side met both speeds of the machine
        ratios = np.array([q.step_s / p.step_s for p, q in zip(pa, pb)])
        assert abs(float(np.median(ratios)) / planted - 1) < 0.03


@pytest.fixture
def study_args(request, new_store, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = new_store(tmp_path / "mlflow.db")
    return store, [*FAST, "split.enabled=false", "ray.exclusive=false", "tracking.heartbeat_s=0.5",
                   "tracking.outage_s=1", "tracking.stale_after_s=5", f"tracking.uri={store}",
                   f"study={request.node.name[:50]}"]


@pytest.mark.parametrize("side_b_python", [False, True])
def test_a_paired_rounds_sweep_starts_one_worker_per_pair_holding_both_engines(study_args, tmp_path, side_b_python):
    """Side b as an engine argument lives in side a's worker; under another Python (here the
    driver's own interpreter, named as pair.python) in a partner worker that side a's worker
    starts and times in the same rounds: one start asked of the backend either way."""
    import sys

    import mlflow

    from hostsweep.record.read.sides import timed_pairs
    from hostsweep.stages import sweep
    from tests.conftest import compose_raw
    from tests.fakes import FakeBackend

    store, args = study_args
    args = [*args, "+pair.against.debug.delay_phase=sample", "+pair.against.debug.delay_ms=0.5",
            *([f"pair.python={sys.executable}"] if side_b_python else [])]
    backend = FakeBackend(tmp_path / "w")
    assert sweep.run(compose_raw(args), tmp_path / "run", backend) == 0
    cells = build_cells(compose_typed(args))
    a, b = sides(cells)
    assert [e for e in backend.events if e.startswith("start")] == [f"start {a[0].engine.label} with {b[0].engine.label}"]
    worker = backend.workers[0].real
    assert (worker.partner_worker is not None) == side_b_python
    assert set(worker.engines) == ({a[0].engine} if side_b_python else {a[0].engine, b[0].engine})
    assert Counter(backend.measured) == {c.key: 1 for c in cells}
    mlflow.set_tracking_uri(store)
    runs = mlflow.search_runs(experiment_names=[compose_typed(args).experiment])
    run_of = dict(zip(runs["tags.cell_key"], runs["run_id"]))
    for x, y in zip(a, b):
        ta, tb = timed_pairs(run_of[x.key]), timed_pairs(run_of[y.key])
        assert list(ta["pair_round"]) == list(tb["pair_round"]) and ta["pair_round"].nunique() == 12
        assert float(np.median(tb["step_ms"] / ta["step_ms"])) > 1.1  # the planted 0.5 ms on about 1 ms steps


def test_a_paired_rounds_sweep_ends_with_its_diff_judged_by_rounds_passing_an_aa_and_failing_a_plant(
        study_args, tmp_path, capsys):
    import pandas as pd

    from hostsweep.stages import sweep
    from tests.conftest import compose_raw
    from tests.fakes import FakeBackend

    _, args = study_args
    # the fake engine's sleeps jitter with the machine's load, and so its MDE: the power refusal
    # (exit 2) is tests/unit/test_diff_rule.py's to check, not this test's
    aa = [*args, "pair.enabled=true", "diff.fail_on=slower", "study=rounds-aa", "diff.max_mde_factor=null"]
    assert sweep.run(compose_raw(aa), tmp_path / "aa", FakeBackend(tmp_path / "w1")) == 0
    out = capsys.readouterr().out
    assert "round by round" in out and "rounds per cell, sides timed back to back" in out
    planted = [*args, "+pair.against.debug.delay_phase=sample", "+pair.against.debug.delay_ms=3",
               "diff.fail_on=slower", "study=rounds-ab"]
    assert sweep.run(compose_raw(planted), tmp_path / "ab", FakeBackend(tmp_path / "w2")) == 1
    table = pd.read_csv(tmp_path / "ab" / "diff" / "diff.csv")
    steps = table[table["quantity"] == "step_ms"]
    assert (steps["verdict"] == "slower").all() and (steps["rounds"] >= 8).all()
    # by default widened by the engine-instance floor: still the sign test, widened at every level
    assert (steps["test"] == "sign").all() and (steps["between_var"] > 0).all()
    assert steps["between"].str.contains("+ instance floor", regex=False).all()


def test_pair_start_first_b_starts_side_bs_engine_first_in_the_shared_worker(new_store, tmp_path, monkeypatch):
    from hostsweep.stages import sweep
    from tests.conftest import compose_raw
    from tests.fakes import FakeBackend

    monkeypatch.chdir(tmp_path)
    store = new_store(tmp_path / "mlflow.db")
    args = ["+sku=cpu", "engine.name=fake", "measure.T=5", "measure.reps=6", "measure.warmups=1", "ctx=[16]",
            "batch=[1]", "split.enabled=false", "ray.exclusive=false", f"tracking.uri={store}", "pair.enabled=true"]
    for first in ("a", "b"):
        backend = FakeBackend(tmp_path / f"w{first}")
        assert sweep.run(compose_raw([*args, f"study=first-{first}", f"pair.start_first={first}"]),
                         tmp_path / first, backend) == 0
        starts = [e for e in backend.events if e.startswith("start")]
        assert len(starts) == 1 and starts[0].endswith(" (b first)") == (first == "b"), backend.events
        started = [spec.side for spec in backend.workers[0].real.engines]  # in the order the worker started them
        assert started == (["b", "a"] if first == "b" else ["a", "b"])
    with pytest.raises(ConfigError, match="pair.start_first must be a or b"):
        compose_typed([*args, "pair.start_first=c"])


def test_a_partner_worker_whose_engine_dies_mid_rounds_hands_the_group_back_for_a_retry_measuring_nothing(
        tmp_path, monkeypatch):
    """Side b in a partner worker (another Python's): its engine dies after a few rounds. The
    coordinating worker's cell raises EngineDied (the driver retries the group on new workers)
    instead of reporting a cell FAILED or one side's pairs without the other's, and its
    engine_health names the partner's fault."""
    from hostsweep.run.faults import EngineDied

    study = compose_typed([*FAST, "pair.enabled=true"])
    cells = build_cells(study)
    worker, calls = paired_worker(tmp_path, monkeypatch, cells, planted=1.0, swing=1.0, across_workers=True)
    partner = worker.partner_worker
    engine = partner.engines[sides(cells)[1][0].engine]
    generate = engine.generate

    def dies(prompts, tokens):
        if sum(1 for c in calls if c[0] == "b") >= 30:
            monkeypatch.setattr(partner.watch, "fault", lambda: "EngineCore (pid 4242) killed by SIGKILL")
            raise RuntimeError("engine core is gone")
        return generate(prompts, tokens)

    engine.generate = dies
    queue = [c for pair in zip(*sides(cells)) for c in pair]
    with pytest.raises(EngineDied, match="killed by SIGKILL"):
        worker.measure(queue[0], MeasureOptions.of(study.config), tuple(queue[1:]))
    assert "killed by SIGKILL" in (worker.engine_health() or "")
    assert not worker._timed_cells  # nothing of the group kept to be handed out later
