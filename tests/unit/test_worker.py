"""The worker in-process with the fake engine: results, provenance, failure capture."""
from __future__ import annotations

import math

import pytest

from hostsweep.config.grid import build_cells
from hostsweep.measure.results import MeasureOptions, cell_metrics
from hostsweep.run.worker import SweepWorker, release_ray_thread_limits
from tests.conftest import compose_typed


# No re-measures: what these tests count must not depend on how busy the machine is.
FAKE = ["+sku=cpu", "engine.name=fake", "measure.reps=4", "measure.warmups=1", "measure.T=5", "measure.remeasure_unstable=0"]


def fake_cells(*overrides: str):
    return build_cells(compose_typed([*FAKE, *overrides]))


def options(*overrides: str) -> MeasureOptions:
    """The measure options a study with these overrides hands its workers."""
    return MeasureOptions.of(compose_typed([*FAKE, *overrides]).config)


def test_worker_measures_a_cell_with_a_finite_step_and_bracketing_ci(tmp_path):
    cell = fake_cells("batch=[1]", "ctx=[64]")[0]
    worker = SweepWorker(cell.engine, str(tmp_path))
    result = worker.measure(cell, options())
    assert result.status == "FINISHED" and result.error is None
    m = result.measurement
    assert math.isfinite(m.step_ms) and m.step_ms > 0
    assert m.step_ci_low_ms <= m.step_ms <= m.step_ci_high_ms
    assert len(m.reps) == 4
    assert result.host["vllm_version"] == "fake" and result.host["hostname"]


def test_a_worker_in_its_own_process_freezes_what_its_start_made_and_one_in_a_test_does_not(tmp_path):
    import gc

    cell = fake_cells("batch=[1]", "ctx=[16]")[0]
    before = gc.get_freeze_count()
    SweepWorker(cell.engine, str(tmp_path / "here"))
    assert gc.get_freeze_count() == before  # in this process: nothing of the test's frozen
    try:
        SweepWorker(cell.engine, str(tmp_path / "own"), own_process=True)  # as a Ray actor is made
        assert gc.get_freeze_count() > before
    finally:
        gc.unfreeze()


def test_a_short_generate_fails_the_cell_instead_of_corrupting_it(tmp_path):
    cell = fake_cells("batch=[2]", "ctx=[8]")[0]
    worker = SweepWorker(cell.engine, str(tmp_path))
    worker.engine.generate = lambda prompts, tokens: [tokens, tokens - 1]
    result = worker.measure(cell, options())
    assert result.status == "FAILED" and result.measurement is None
    assert "engine produced" in result.error


def test_ray_thread_caps_are_dropped_and_reported():
    environ = {"OMP_NUM_THREADS": "1", "PATH": "/bin"}
    assert release_ray_thread_limits(environ) == {"OMP_NUM_THREADS": "1"}
    assert environ == {"PATH": "/bin"}


def test_split_through_the_fake_profiler_recovers_the_known_device_share(tmp_path):
    from hostsweep.engines.fake import FakeEngine

    cell = fake_cells("batch=[2]", "ctx=[64]", "tp=2")[0]
    worker = SweepWorker(cell.engine, str(tmp_path))
    result = worker.measure(cell, options("split.reps=3"))
    assert result.status == "FINISHED", result.error
    expected_ms = FakeEngine.step_seconds(worker.engine, 2, 64) * FakeEngine.device_share * 1e3
    split = result.split
    assert split.kernel_source == "cpu-ops"
    assert split.device_ms == pytest.approx(expected_ms, rel=1e-9)
    assert split.per_rank_device_ms == pytest.approx((expected_ms, expected_ms), rel=1e-9)
    assert 0 < split.host_frac < 1 and split.host_ms == pytest.approx(result.measurement.step_ms - split.device_ms)
    assert split.top_ops[0][0] == "aten::linear"
    assert not list((tmp_path / "traces").glob("*.json.gz"))  # parsed traces are not left behind


def test_host_phases_through_the_fake_profiler_have_the_known_shares(tmp_path):
    from hostsweep.engines.fake import FakeEngine

    cell = fake_cells("batch=[2]", "ctx=[64]", "tp=2")[0]
    worker = SweepWorker(cell.engine, str(tmp_path))
    result = worker.measure(cell, options())
    cycle_ms = FakeEngine.cycle_seconds(worker.engine, 2, 64) * 1e3
    # The traces' host phases are the profiled ones: the fake profiler stretches the host's part.
    host_cycle_ms = cycle_ms * FakeEngine.profiler_host_cost
    expected = {name: share * host_cycle_ms for name, share in FakeEngine.phase_shares.items()}
    expected.update(other_worker=0.05 * host_cycle_ms, engine_worker_ipc=0.05 * host_cycle_ms,
                    other_engine_loop=0.1 * host_cycle_ms)
    expected.update(frontend_exposed=0.0)  # the front-end keeps up: all its work is overlapped
    phases = result.split.phases
    assert phases.host_ms == pytest.approx(expected, rel=1e-6, abs=1e-9)
    assert phases.overlapped_ms == pytest.approx({"frontend_process_outputs": FakeEngine.frontend_share * cycle_ms})
    assert phases.forward_compute_ms == pytest.approx(FakeEngine.device_share * cycle_ms, rel=1e-6)
    # The phases scaled to the timed step (scale: timed host / profiled host) name as much of the
    # timed host time as the traces' 0.6 cycle names of the profiled one.
    split = result.split
    assert phases.scale == pytest.approx(split.host_ms / (split.profiled_step_ms - split.device_ms), rel=1e-9)
    assert phases.attributed_frac == pytest.approx(0.6 * host_cycle_ms * phases.scale / split.host_ms, rel=1e-6)
    metrics = cell_metrics(result)
    assert metrics["phase_sample_ms"] == pytest.approx(0.1 * host_cycle_ms * phases.scale, abs=1e-3)
    assert metrics["overlapped_frontend_process_outputs_ms"] == pytest.approx(0.08 * cycle_ms, abs=1e-3)


def test_several_profiled_pairs_give_phase_cis(tmp_path):
    cell = fake_cells("batch=[1]", "ctx=[16]")[0]
    result = SweepWorker(cell.engine, str(tmp_path)).measure(cell, options("split.reps=3"))
    phases = result.split.phases
    assert phases.pairs == 3 and set(phases.ci_ms) == set(phases.host_ms) | set(phases.overlapped_ms)
    low, high = phases.ci_ms["sample"]
    assert low <= phases.host_ms["sample"] <= high
    metrics = cell_metrics(result)
    assert "phase_sample_ci_high_ms" in metrics and "overlapped_frontend_process_outputs_ci_high_ms" in metrics


def test_split_phases_false_leaves_the_phases_out(tmp_path):
    cell = fake_cells("batch=[1]", "ctx=[16]", "split.phases=false")[0]
    assert not cell.engine.phases
    result = SweepWorker(cell.engine, str(tmp_path)).measure(cell, options("split.phases=false"))
    assert result.split.device_ms > 0 and result.split.phases is None
    assert not [name for name in cell_metrics(result) if name.startswith("phase_") or name == "attributed_frac"]


@pytest.mark.parametrize("phase", ["sample", "schedule", "forward"])
def test_a_debug_delay_in_a_phase_moves_that_phase_and_the_step_by_it(tmp_path, phase):
    delay_ms = 2.0
    plain_cell = fake_cells("batch=[1]", "ctx=[16]")[0]
    cell = fake_cells("batch=[1]", "ctx=[16]", f"debug.delay_phase={phase}", f"debug.delay_ms={delay_ms}")[0]
    assert cell.engine.debug_delay == f"{phase}:2" and plain_cell.engine.debug_delay == ""
    plain = SweepWorker(plain_cell.engine, str(tmp_path / "plain")).measure(plain_cell, options())
    delayed = SweepWorker(cell.engine, str(tmp_path / "delayed")).measure(cell, options())
    name = "forward_dispatch" if phase == "forward" else phase
    before, after = plain.split.phases.host_ms, delayed.split.phases.host_ms
    assert after[name] - before[name] == pytest.approx(delay_ms, rel=1e-6)
    assert all(after[p] == pytest.approx(before[p], rel=1e-6) for p in before if p != name)
    # The step (slept, so as noisy as the machine): d lies within the CIs' difference, give or
    # take 0.5 ms of scheduling noise.
    p, d = plain.measurement, delayed.measurement
    assert d.step_ci_low_ms - p.step_ci_high_ms - 0.5 <= delay_ms <= d.step_ci_high_ms - p.step_ci_low_ms + 0.5


@pytest.mark.parametrize("delay_ms, exposed", [(0.2, False), (2.0, True)])
def test_a_debug_delay_in_the_front_end_is_overlapped_until_the_front_end_falls_behind(tmp_path, delay_ms, exposed):
    """The front-end processes step k's outputs while step k+1 runs: a delay there moves the
    overlapped work by d and the step not at all, until the front-end's work outlasts a step;
    then the step and frontend_exposed rise by the excess."""
    from hostsweep.engines.fake import FakeEngine

    plain_cell = fake_cells("batch=[1]", "ctx=[16]")[0]
    cell = fake_cells("batch=[1]", "ctx=[16]", "debug.delay_phase=frontend_process_outputs",
                      f"debug.delay_ms={delay_ms}")[0]
    plain = SweepWorker(plain_cell.engine, str(tmp_path / "plain")).measure(plain_cell, options())
    worker = SweepWorker(cell.engine, str(tmp_path / "delayed"))
    delayed = worker.measure(cell, options())
    front = "frontend_process_outputs"
    assert delayed.split.phases.overlapped_ms[front] - plain.split.phases.overlapped_ms[front] == \
        pytest.approx(delay_ms, rel=1e-6)
    cycle_ms = FakeEngine.cycle_seconds(worker.engine, 1, 16) * 1e3
    excess_ms = max(0.0, FakeEngine.frontend_share * cycle_ms + delay_ms - cycle_ms)
    assert (excess_ms > 0) == exposed
    # The traces' excess is over the profiled cycle, which the fake profiler stretches.
    profiled_cycle_ms = FakeEngine.profiled_cycle_seconds(worker.engine, cycle_ms / 1e3) * 1e3
    traced_excess_ms = max(0.0, FakeEngine.frontend_share * cycle_ms + delay_ms - profiled_cycle_ms)
    before, after = plain.split.phases.host_ms, delayed.split.phases.host_ms
    assert after["frontend_exposed"] == pytest.approx(traced_excess_ms, abs=1e-6)
    assert all(after[p] == pytest.approx(before[p], rel=1e-6) for p in before if p != "frontend_exposed")
    p, d = plain.measurement, delayed.measurement  # slept: as noisy as the machine, give or take 0.5 ms
    assert d.step_ci_low_ms - p.step_ci_high_ms - 0.5 <= excess_ms <= d.step_ci_high_ms - p.step_ci_low_ms + 0.5


def test_kept_traces_come_back_with_the_result(tmp_path):
    cell = fake_cells("batch=[1]", "ctx=[16]")[0]
    worker = SweepWorker(cell.engine, str(tmp_path))
    result = worker.measure(cell, options("split.keep_traces=true", "split.reps=1"))  # one pair: two traces
    # Per generate: the rank's trace, the EngineCore's step intervals and the front-end's (host phases).
    assert len(result.traces) == 6 and all(name.endswith(".json.gz") for name in result.traces)
    assert sum("_enginecore" in name for name in result.traces) == 2
    assert sum("_frontend" in name for name in result.traces) == 2


def test_plain_json_traces_are_parsed_and_kept_ones_come_back_gzipped(tmp_path):
    """vLLM writes uncompressed traces (torch_profiler_use_gzip off): the split reads them
    as they are, and only the kept ones are compressed."""
    import gzip
    import json

    cell = fake_cells("batch=[1]", "ctx=[16]")[0]
    worker = SweepWorker(cell.engine, str(tmp_path))
    stop = worker.engine.stop_profile

    def plain(prefix):
        paths = []
        for path in stop(prefix):
            target = path.with_name(path.name.removesuffix(".gz"))
            target.write_bytes(gzip.decompress(path.read_bytes()))
            path.unlink()
            paths.append(target)
        return paths

    worker.engine.stop_profile = plain
    result = worker.measure(cell, options("split.keep_traces=true", "split.reps=1"))  # one pair: two traces
    assert result.status == "FINISHED", result.error
    assert result.split.device_ms > 0
    ranks = [name for name in result.traces if "_enginecore" not in name and "_frontend" not in name]
    assert len(ranks) == 2 and all(name.endswith(".pt.trace.json.gz") for name in ranks)
    for blob in result.traces.values():
        assert "traceEvents" in json.loads(gzip.decompress(blob))


def test_the_split_logs_what_it_costs_beyond_as_many_unprofiled_pairs(tmp_path):
    cell = fake_cells("batch=[1]", "ctx=[16]")[0]
    result = SweepWorker(cell.engine, str(tmp_path)).measure(cell, options("split.reps=2"))
    m, split = result.measurement, result.split
    assert split.split_s > 0
    assert split.split_overhead_s == pytest.approx(split.split_s - 2 * (m.wall_1_ms + m.wall_T_ms) / 1e3)
    assert "split_overhead_s" in cell_metrics(result) and "split_s" in cell_metrics(result)


def test_linearity_sweep_reports_r2_for_wall_and_kernels(tmp_path):
    cell = fake_cells("batch=[1]", "ctx=[16]")[0]
    worker = SweepWorker(cell.engine, str(tmp_path))
    result = worker.measure(cell, options("linearity.enabled=true", "linearity.T=[8,32,128]", "linearity.reps=3"))
    lin = result.linearity
    assert lin.tokens == (8, 32, 128) and len(lin.kernel_ms) == 3
    assert lin.r2_kernel == pytest.approx(1.0)  # synthetic kernels are exactly linear in T
    assert lin.r2_wall > 0.8


PYSPY = ("split.enabled=false", "split.pyspy=true", "split.pyspy_seconds=1")


def test_pyspy_view_samples_the_worker_process_tree(tmp_path):
    from hostsweep.run import pyspy

    if pyspy.pyspy_binary() is None:
        pytest.skip("py-spy is not installed (it is in the test extra)")
    cell = fake_cells("batch=[1]", "ctx=[16]", "measure.T=20")[0]
    result = SweepWorker(cell.engine, str(tmp_path)).measure(cell, options(*PYSPY))
    assert result.status == "FINISHED", result.error
    states = result.thread_states
    assert states["samples"].sum() > 0 and states["active_frac"].between(0, 1).all()


def test_pyspy_view_without_py_spy_is_skipped_and_the_cell_still_measured(tmp_path, monkeypatch):
    from hostsweep.run import pyspy

    monkeypatch.setattr(pyspy, "pyspy_binary", lambda: None)
    cell = fake_cells("batch=[1]", "ctx=[16]", "measure.T=20")[0]
    result = SweepWorker(cell.engine, str(tmp_path)).measure(cell, options(*PYSPY))
    assert result.status == "FINISHED" and result.thread_states is None and result.measurement is not None


def test_worker_takes_back_every_core_when_ray_daemons_were_confined():
    import os
    import subprocess
    import sys

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    script = ("import os; os.sched_setaffinity(0, {%d}); from hostsweep.run.hygiene import restore_affinity; "
              "restore_affinity(); print(sorted(os.sched_getaffinity(0)))" % cores[-1])
    env = {**os.environ, "HOSTSWEEP_WORKER_AFFINITY": ",".join(map(str, cores))}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(cores)


def test_a_worker_started_under_sched_idle_measures_under_the_normal_policy_or_refuses():
    import os
    import subprocess
    import sys

    script = ("import os; os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0)); "
              "from hostsweep.run.hygiene import restore_scheduler; print(restore_scheduler(), os.sched_getscheduler(0))")
    import resource

    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    # Leaving SCHED_IDLE for nice 0 needs CAP_SYS_NICE (root here) or a nice ceiling 20 - soft <= 0.
    soft = resource.getrlimit(resource.RLIMIT_NICE)[0]
    if os.geteuid() == 0 or soft == resource.RLIM_INFINITY or soft >= 20:
        assert out.returncode == 0 and out.stdout.split() == ["other", str(os.SCHED_OTHER)], out.stderr[-2000:]
    else:
        assert out.returncode != 0 and "SCHED_OTHER" in out.stderr


def test_repeat_workload_prompts_are_the_models_own_text(tmp_path):
    from hostsweep.engines.fake import next_token
    from hostsweep.measure.protocol import OWN_TEXT_SEED_TOKENS

    random_cell, repeat_cell = fake_cells("batch=[3]", "ctx=[40]", "workload=[random,repeat]")
    worker = SweepWorker(repeat_cell.engine, str(tmp_path))
    random_prompts, repeat_prompts = worker.prompts(random_cell), worker.prompts(repeat_cell)
    assert [len(p) for p in repeat_prompts] == [40] * 3 and len({tuple(p) for p in repeat_prompts}) == 3
    for random_prompt, own in zip(random_prompts, repeat_prompts):
        assert own[:OWN_TEXT_SEED_TOKENS] == random_prompt[:OWN_TEXT_SEED_TOKENS]
        assert all(b == next_token(a) for a, b in zip(own[OWN_TEXT_SEED_TOKENS - 1:], own[OWN_TEXT_SEED_TOKENS:]))


def test_speculation_accepts_more_on_the_models_own_text_and_a_token_costs_less(tmp_path):
    """The fake's n-gram proposer finds its 16-token ring in its own text (repeat) but not in
    random prompts within T=9 tokens: acceptance 1 vs 0, and per-token time follows."""
    random_cell, repeat_cell = fake_cells("mode=spec-ngram", "batch=[1]", "ctx=[40]", "measure.T=9",
                                          "workload=[random,repeat]")
    worker = SweepWorker(repeat_cell.engine, str(tmp_path))
    random_result = worker.measure(random_cell, options("mode=spec-ngram", "measure.T=9"))
    repeat_result = worker.measure(repeat_cell, options("mode=spec-ngram", "measure.T=9"))
    rand, rep = random_result.spec, repeat_result.spec
    assert (rand.acceptance_rate, rand.drafts, rand.cycles, rand.tokens_per_cycle) == (0.0, 0.0, 8.0, 1.0)
    assert rep.acceptance_rate == 1.0 and rep.accepted_per_cycle == 4.0 and rep.num_speculative_tokens == 4
    assert rep.cycles == 2.0 and rep.tokens_per_cycle == 4.0  # 8 tokens after the prefill, in 2 cycles
    assert repeat_result.measurement.step_ms < random_result.measurement.step_ms
    from hostsweep.measure.results import cell_metrics

    metrics = cell_metrics(repeat_result)
    assert metrics["spec_cycle_ms"] == pytest.approx(repeat_result.measurement.step_ms * 4.0, abs=5e-4)  # kept to the µs
    assert metrics["spec_host_cycle_ms"] == pytest.approx(repeat_result.split.host_ms * 4.0, abs=5e-4)
    assert repeat_result.host["prompt_digest"] != random_result.host["prompt_digest"]


def test_an_engine_without_speculation_reports_no_acceptance(tmp_path):
    cell = fake_cells("batch=[1]", "ctx=[16]")[0]
    result = SweepWorker(cell.engine, str(tmp_path)).measure(cell, options())
    assert result.spec is None and "spec_acceptance_rate" not in result.params


def early_round_excess_pct(result) -> float:
    """How much slower the first four timed rounds ran than the rest, in % (medians)."""
    import numpy as np

    steps = sorted(result.measurement.reps, key=lambda p: p.round)
    early, late = [p.step_s for p in steps[:4]], [p.step_s for p in steps[4:]]
    return (float(np.median(early)) / float(np.median(late)) - 1.0) * 100.0


@pytest.mark.parametrize("max_rounds, warmed", [(1, False), (8, True)])
def test_the_group_warms_up_until_its_rounds_stop_getting_faster(tmp_path, monkeypatch, max_rounds, warmed):
    """An engine planted to start 40 % slow and warm up over its first 15 long generates (5
    rounds of 3 cells): the group warm-up takes rounds until a round is no longer faster than
    the one before, and the timed rounds then show no early excess; held to one warm-up
    round, the first timed rounds carry the curve."""
    monkeypatch.setenv("HOSTSWEEP_FAKE_WARMUP", "1.4:15")
    first, *companions = fake_cells("batch=[1,2,4]", "ctx=[512]", "measure.reps=12", "measure.T=17",
                                    f"measure.warmup_max_rounds={max_rounds}")
    worker = SweepWorker(first.engine, str(tmp_path))
    result = worker.measure(first, options("measure.reps=12", "measure.T=17", f"measure.warmup_max_rounds={max_rounds}"),
                            companions)
    rounds = result.stability.design.warmup_rounds
    if warmed:
        assert 5 <= rounds <= 8 and early_round_excess_pct(result) < 5.0
    else:
        assert rounds == 1 and early_round_excess_pct(result) > 10.0
    assert cell_metrics(result)["warmup_rounds"] == rounds
