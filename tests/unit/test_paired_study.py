"""A paired A/B study (pair.enabled / pair.against): side b composed from the study and the
overrides, refused in one line where the sides cannot pair, every cell keyed by its side,
and a rerun after a stop that never pairs a start of one sweep with a start of another."""
from __future__ import annotations

import logging
import sys
from collections import Counter

import mlflow
import pytest

from hostsweep.config.grid import build_cells, group_by_engine, partner_keys
from hostsweep.config.resolve import resolve
from hostsweep.config.schema import ConfigError
from hostsweep.stages import sweep
from tests.conftest import compose_raw, compose_typed
from tests.fakes import FakeBackend

FAST = ["+sku=cpu", "engine.name=fake", "measure.T=5", "measure.reps=3", "measure.warmups=1", "ctx=[16]",
        "batch=[1,2]", "split.enabled=false", "ray.exclusive=false", "tracking.heartbeat_s=0.5",
        "tracking.outage_s=1", "tracking.stale_after_s=5"]
DELAY = ["+pair.against.debug.delay_phase=sample", "+pair.against.debug.delay_ms=0.2"]


def test_side_b_is_the_study_with_the_against_keys_and_side_a_the_study_as_given():
    study = compose_typed([*FAST, "+pair.against.mode=graph", "+pair.against.engine.engine_args.block_size=32",
                           "pair.design=starts"])
    assert study.config.mode.name == "eager" and study.side_b is not None
    assert study.side_b.config.mode.name == "graph" and study.side_b.config.engine.engine_args == {"block_size": 32}
    assert study.side_b.config.batch == study.config.batch and not study.side_b.config.pair.paired
    cells = build_cells(study)
    a, b = [c for c in cells if c.engine.side == "a"], [c for c in cells if c.engine.side == "b"]
    assert len(a) == len(b) == 2 and {c.engine.mode for c in b} == {"graph"}
    assert {c.replicates for c in cells} == {3}  # pair.starts engine starts per side
    assert {c.params()["pair_against"] for c in cells} == {"engine.engine_args.block_size=32 mode=graph"}
    # the start pairs are the re-measure: no periods or lone replicate within a start, on both sides
    for side in (study.config, study.side_b.config):
        assert side.measure.remeasure_unstable == 0 and side.measure.replicate_first is False
    assert partner_keys(cells) == {**{x.key: y.key for x, y in zip(a, b)}, **{y.key: x.key for x, y in zip(a, b)}}


def test_a_paired_aa_keys_its_sides_apart_and_a_delay_is_part_of_a_cells_identity():
    cells = build_cells(compose_typed([*FAST, "pair.enabled=true"]))
    assert len({c.key for c in cells}) == 4 and len(group_by_engine(cells)) == 2
    assert [c.params()["side"] for c in cells] == ["a", "a", "b", "b"]
    unpaired = build_cells(compose_typed(FAST))
    assert {c.key for c in unpaired}.isdisjoint(c.key for c in cells)
    planted = build_cells(compose_typed([*FAST, "debug.delay_phase=sample", "debug.delay_ms=0.2"]))
    assert {c.key for c in planted}.isdisjoint(c.key for c in unpaired)  # a planted delay never resumes a plain cell


@pytest.mark.parametrize("overrides,needle", [
    (["+pair.against.measure.reps=24"], "pair.against.measure.reps: measure.reps is what both sides share"),
    (["+pair.against.ctx=[32]"], "pair.against.ctx: ctx is what both sides share"),
    (["+pair.against.mode=turbo"], "unknown mode 'turbo' in pair.against.mode"),
    (["+pair.against.debug.delay_msec=1"], "pair.against.debug.delay_msec"),
    (["pair.enabled=true", "pair.starts=1"], "pair.starts must be >= 2"),
    (["pair.enabled=true", "measure.replicates=2"], "a paired study (pair.against) takes pair.starts only"),
    (["tp=[1,2]", "+pair.against.tp=2"], "side a has 2 engine group(s), side b 1"),
    (["pair.enabled=true", "pair.python=/nonexistent/python"], "pair.python=/nonexistent/python: no executable"),
    (["+pair.against.engine.engine_args.max_num_seqs=8"], "pair.against (side b): engine.engine_args.max_num_seqs is set by"),
])
def test_sides_that_cannot_pair_are_refused_in_one_line(overrides, needle):
    with pytest.raises(ConfigError) as refused:
        compose_typed([*FAST, *overrides])
    assert needle in str(refused.value) and "\n" not in str(refused.value)


def test_a_side_b_python_whose_environment_lacks_the_worker_is_refused_naming_what_it_lacks(tmp_path):
    bare = tmp_path / "bare"  # a Python environment holding neither Ray nor hostsweep nor vLLM
    import venv

    venv.EnvBuilder(with_pip=False).create(bare)
    with pytest.raises(ConfigError, match=r"its environment lacks ray, hostsweep, vllm"):
        compose_typed([*FAST, "pair.enabled=true", f"pair.python={bare / 'bin' / 'python'}"])
    # the driver's own environment holds all three: accepted, and side b's engines get it
    study = compose_typed([*FAST, "pair.enabled=true", f"pair.python={sys.executable}"])
    from hostsweep.run.actors import actor_options

    specs = {c.engine.side: c.engine for c in build_cells(study)}
    assert actor_options(specs["b"])["runtime_env"] == {"py_executable": sys.executable}
    assert "runtime_env" not in actor_options(specs["a"])


@pytest.fixture
def study(request, new_store, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = new_store(tmp_path / "mlflow.db")
    return store, [*FAST, f"tracking.uri={store}", f"study={request.node.name[:50]}"]


def test_a_stop_in_the_last_engine_start_measures_both_sides_again_never_one_with_the_others_starts(study, tmp_path):
    store, args = study
    args = [*args, *DELAY, "pair.design=starts"]
    cells = build_cells(compose_typed(args))

    def stop_in_sixth_start(cell, seen=[]):  # A B B A A B: the sixth is side b's last
        seen.append(cell.key)
        if len(seen) == 5 * 2 + 1:
            raise KeyboardInterrupt

    first = FakeBackend(tmp_path / "w1", on_measure=stop_in_sixth_start)
    with pytest.raises(KeyboardInterrupt):
        sweep.run(compose_raw(args), tmp_path / "first", first)
    mlflow.set_tracking_uri(store)
    runs = mlflow.search_runs(experiment_names=[compose_typed(args).experiment])
    finished = set(runs[(runs["status"] == "FINISHED") & runs["tags.cell_key"].notna()]["tags.cell_key"])
    assert finished == {c.key for c in cells if c.engine.side == "a"}  # side a ended its starts; b did not
    rerun = FakeBackend(tmp_path / "w2")
    assert sweep.run(compose_raw(args), tmp_path / "second", rerun) == 0
    assert Counter(rerun.measured) == {c.key: 3 for c in cells}  # both sides again, in three starts each
    starts = [e.rsplit("/", 1)[1] for e in rerun.events if e.startswith("start")]
    assert starts == ["a", "b", "b", "a", "a", "b"]


def test_a_paired_sweep_ends_with_its_diff_the_gate_passing_an_aa_and_failing_a_planted_slowdown(study, tmp_path,
                                                                                                  capsys):
    store, args = study
    args = [*args, "pair.design=starts"]
    # the fake engine's sleeps jitter with the machine's load, and so its MDE: the power refusal
    # (exit 2) is tests/unit/test_diff_rule.py's to check, not this test's
    aa = [*args, "pair.enabled=true", "diff.fail_on=slower", "study=aa", "diff.max_mde_factor=null"]
    assert sweep.run(compose_raw(aa), tmp_path / "aa", FakeBackend(tmp_path / "w1")) == 0
    out = capsys.readouterr().out
    assert "paired diff: side b (the same configuration: A/A)" in out and "design: paired" in out
    assert "between-start spread on this machine" in out and "diff.fail_on=slower: pass" in out
    # side b sleeps 3 ms more every engine step (the fake engine's steps take about 1 ms)
    planted = [*args, "+pair.against.debug.delay_phase=sample", "+pair.against.debug.delay_ms=3",
               "diff.fail_on=slower", "study=planted"]
    assert sweep.run(compose_raw(planted), tmp_path / "ab", FakeBackend(tmp_path / "w2")) == 1
    out = capsys.readouterr().out
    assert "debug.delay_ms=3 debug.delay_phase=sample" in out and "diff.fail_on=slower: FAIL" in out
    table = __import__("pandas").read_csv(tmp_path / "ab" / "diff" / "diff.csv")
    steps = table[table["quantity"] == "step_ms"]
    assert (steps["verdict"] == "slower").all() and (steps["design"] == "paired").all()


@pytest.mark.parametrize("override,named", [("pair.python=/usr/bin/python3", "pair.python=/usr/bin/python3"),
                                             ("pair.starts=3", "pair.starts=3"), ("pair.design=rounds", "pair.design=rounds")])
def test_a_side_b_key_on_a_study_that_is_not_paired_is_refused_in_one_line(override, named):
    with pytest.raises(ConfigError, match=f"{named} set for a study that is not paired: add pair.enabled=true"):
        compose_typed(["+sku=cpu", override])
    if not override.startswith("pair.python"):  # that one is then probed for its Ray (above)
        assert compose_typed(["+sku=cpu", override, "pair.enabled=true"]).config.pair.paired


@pytest.mark.parametrize("extra,rounds", [
    (["pair.enabled=true", "diff.fail_on=slower"], 40),  # a gate in paired rounds: 12 could not see its threshold
    (["pair.enabled=true", "diff.fail_on=slower_overall"], 40),
    (["pair.enabled=true", "diff.fail_on=slower", "measure.reps=16"], 16),  # given: kept
    (["pair.enabled=true"], 12),  # no gate
    (["pair.enabled=true", "diff.fail_on=slower", "pair.design=starts"], 12),  # pairs a start, not rounds
    ([], 12),
])
def test_a_gated_paired_study_in_rounds_takes_forty_rounds_unless_measure_reps_is_given(extra, rounds, caplog):
    caplog.set_level(logging.INFO, logger="hostsweep.config.resolve")
    base = [arg for arg in FAST if not arg.startswith("measure.reps")]
    raw = compose_raw([*base, *extra])
    study = resolve(raw)
    assert study.config.measure.reps == rounds and raw.measure.reps == rounds  # the logged config says what ran
    assert {c.reps for c in build_cells(study)} == {rounds}
    if study.side_b is not None:
        assert study.side_b.config.measure.reps == rounds
    assert ("40 rounds a cell, not 12" in caplog.text) == (rounds == 40)
