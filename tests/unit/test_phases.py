"""Host time per named phase, on synthesized CPU- and CUDA-style traces with known answers."""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from hostsweep.measure.phases import PhaseTotals, phase_metrics, phase_name, phase_split, phase_totals


def scope(name, ts, dur, tid=1, cat="user_annotation"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur}


def cpu_op(name, ts, dur, tid=1):
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur}


def cpu_steps(steps: int) -> list[dict]:
    """A prefill-ish preamble, then per step (1000 us): preprocess 80, forward 500 holding a
    300-us compute op (with a nested one and a view), sample 60 holding a 10-us argmax,
    bookkeep 40 with a nested phase scope; all inside the profiler's own span."""
    events = [scope("PyTorch Profiler (0)", 0, 10_000_000), scope("gpu_model_runner: preprocess", 0, 900)]
    clock = 1000.0
    for _ in range(steps):
        events += [
            scope("gpu_model_runner: preprocess", clock, 80),
            scope("gpu_model_runner: forward", clock + 100, 500),
            cpu_op("aten::linear", clock + 150, 300),
            cpu_op("aten::addmm", clock + 151, 298),  # nested compute: once
            cpu_op("aten::view", clock + 460, 5),  # metadata: host
            scope("gpu_model_runner: sample", clock + 620, 60),
            cpu_op("aten::argmax", clock + 640, 10),
            scope("gpu_model_runner: bookkeep", clock + 700, 40),
            scope("gpu_model_runner: ModelRunnerOutput", clock + 710, 20),  # nested phase: once
            scope("some user scope", clock + 700, 200),  # not a phase
        ]
        clock += 1000.0
    return events


@pytest.mark.parametrize("scope_name, phase", [
    ("gpu_model_runner: preprocess", "preprocess"),
    ("gpu_model_runner: ModelRunnerOutput", "model_runner_output"),
    ("schedule: allocate_slots", "schedule_allocate_slots"),
    ("hostsweep: engine_worker_ipc", "engine_worker_ipc"),
    ("PyTorch Profiler (0)", None),
    ("llm_engine step: get_output", None),
    ("ProfilerStep#3", None),
])
def test_phase_names(scope_name, phase):
    assert phase_name(scope_name) == phase


def test_cpu_trace_nested_scopes_once_and_compute_inside_subtracted():
    t = phase_totals({"traceEvents": cpu_steps(3)})
    assert t.scope_us == {"preprocess": 900 + 3 * 80, "forward": 3 * 500, "sample": 3 * 60, "bookkeep": 3 * 40}
    assert t.compute_us["forward"] == 3 * 300 and t.compute_us["sample"] == 3 * 10
    assert t.compute_us["preprocess"] == 0 and "model_runner_output" not in t.scope_us


def test_a_gloo_all_reduce_inside_the_forward_is_its_compute_until_gloos_thread_ends_it():
    # the caller's op only enqueues (20 us); gloo's thread reduces for 250 us while the caller
    # waits outside any op, inside the forward: its host time is what is left, 700 - 300 - 270
    events = cpu_steps(1)[:2] + [
        scope("gpu_model_runner: forward", 1100, 700),
        cpu_op("aten::linear", 1150, 300),
        cpu_op("c10d::allreduce_", 1460, 20),
        scope("gloo:all_reduce", 1470, 260, tid=9),
    ]
    t = phase_totals({"traceEvents": events})
    assert t.compute_us["forward"] == pytest.approx(300 + 270)
    assert t.scope_us["forward"] - t.compute_us["forward"] == pytest.approx(130)


def test_differenced_per_step_phases_known_answers():
    T = 9
    short, long = phase_totals({"traceEvents": cpu_steps(1)}), phase_totals({"traceEvents": cpu_steps(T)})
    split = phase_split(short, long, T, host_ms=0.69)
    assert split.host_ms == pytest.approx({"preprocess": 0.08, "forward_dispatch": 0.2, "sample": 0.05,
                                           "bookkeep": 0.04})
    assert split.forward_compute_ms == pytest.approx(0.3)
    assert split.attributed_frac == pytest.approx(0.37 / 0.69)
    assert split.largest == ("forward_dispatch", pytest.approx(0.2))
    metrics = phase_metrics(split)
    assert list(metrics)[:4] == ["phase_preprocess_ms", "phase_forward_dispatch_ms", "phase_sample_ms",
                                 "phase_bookkeep_ms"]
    assert metrics["attributed_frac"] == pytest.approx(0.37 / 0.69)
    assert "attributed_frac_profiled" not in metrics
    assert phase_metrics(split, profiled_host_ms=0.74)["attributed_frac_profiled"] == pytest.approx(0.5)


def test_phases_on_separate_threads_each_count():
    events = [scope("gpu_model_runner: sample", 0, 50, tid=1), scope("gpu_model_runner: sample", 10, 50, tid=2)]
    assert phase_totals({"traceEvents": events}).scope_us["sample"] == 100


def cuda_steps(steps: int) -> list[dict]:
    """Host scopes with launches inside; kernels on the stream overlap them in time and are
    not host time; the device stream's gpu_user_annotation copies are ignored."""
    events = []
    clock = 0.0
    for _ in range(steps):
        events += [
            scope("gpu_model_runner: preprocess", clock, 30),
            scope("gpu_model_runner: forward", clock + 40, 200),
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "pid": 7, "tid": 1, "ts": clock + 50,
             "dur": 10},
            {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": clock + 60, "dur": 400},
            scope("gpu_model_runner: forward", clock + 60, 400, tid=7, cat="gpu_user_annotation"),
            scope("gpu_model_runner: sample", clock + 250, 220),  # waits for the kernel
        ]
        clock += 500.0
    return events


def test_cuda_trace_host_scopes_keep_their_full_time():
    T = 5
    split = phase_split(phase_totals({"traceEvents": cuda_steps(1)}), phase_totals({"traceEvents": cuda_steps(T)}),
                        T, host_ms=0.1)
    assert split.host_ms == pytest.approx({"preprocess": 0.03, "forward_dispatch": 0.2, "sample": 0.22})
    assert split.forward_compute_ms == 0


def test_no_scopes_no_phases_and_extra_phases_join():
    assert phase_split(PhaseTotals(), PhaseTotals(), 33, 1.0) is None
    split = phase_split(PhaseTotals(), PhaseTotals(), 33, 2.0, extra_ms={"schedule": 0.5, "engine_worker_ipc": 0.3})
    assert split.ordered() == [("schedule", 0.5), ("engine_worker_ipc", 0.3)]
    assert split.attributed_frac == pytest.approx(0.4)
    assert math.isnan(phase_split(PhaseTotals(), PhaseTotals(), 33, 0.0, extra_ms={"x": 1.0}).attributed_frac)


def test_scheduler_scopes_in_a_rank_trace_are_left_to_the_engine_cores_schedule():
    """A GPU's single-process executor runs the scheduler in the profiled process: its
    `schedule: …` scopes sit inside the EngineCore's schedule interval, counted once."""
    from hostsweep.measure.phases import cell_phases

    def worker(steps):
        return phase_totals({"traceEvents": [e for k in range(steps) for e in (
            scope("schedule: allocate_slots", k * 1000, 30), scope("gpu_model_runner: sample", k * 1000 + 100, 50))]})

    def core(steps):
        return phase_totals({"traceEvents": [e for k in range(steps) for e in (
            scope("hostsweep: schedule", k * 1000, 80, tid="phases"),
            scope("hostsweep span: engine_step", k * 1000, 900, tid="step"))] +
            [scope("hostsweep span: engine_loop", 0, steps * 1000, tid="loop")]})

    T = 5
    with_core = cell_phases([worker(1), core(1)], [worker(T), core(T)], 1, 0, T, 1.0)
    assert with_core.host_ms == pytest.approx({"sample": 0.05, "schedule": 0.08, "other_engine_loop": 0.1})
    alone = cell_phases([worker(1)], [worker(T)], 1, 0, T, 1.0)
    assert alone.host_ms == pytest.approx({"sample": 0.05, "schedule_allocate_slots": 0.03})


def test_without_engine_steps_the_engine_cores_own_phases_still_count():
    from hostsweep.measure.phases import engine_phases

    def core(steps):
        return phase_totals({"traceEvents": [scope("hostsweep: schedule", k * 1000, 80, tid="phases")
                                             for k in range(steps)]})

    empty = phase_totals({"traceEvents": []})
    assert engine_phases(empty, empty, core(1), core(5), 5) == pytest.approx({"schedule": 0.08})


def test_several_pairs_give_mean_phases_with_a_t_interval_scaled_to_the_timed_host_time():
    from hostsweep.measure.phases import PhaseSplit, over_pairs

    pairs = [PhaseSplit({"sample": v, "preprocess": 1.0}, 2.0, 0.0) for v in (0.1, 0.2, 0.3, 0.4, 0.5)]
    pairs.append(PhaseSplit({"preprocess": 1.0}, 2.0, 0.0))  # no sample in this pair: 0 there
    merged = over_pairs(pairs, host_ms=2.5, level=0.95)
    assert merged.host_ms == pytest.approx({"sample": 0.25, "preprocess": 1.0}) and merged.pairs == 6
    low, high = merged.ci_ms["sample"]
    half = stats.t.ppf(0.975, 5) * np.std([0.1, 0.2, 0.3, 0.4, 0.5, 0.0], ddof=1) / np.sqrt(6)
    assert (low, high) == pytest.approx((0.25 - half, 0.25 + half)) and merged.ci_ms["preprocess"] == (1.0, 1.0)
    assert merged.attributed_frac == pytest.approx(1.25 / 2.5)
    metrics = phase_metrics(merged)
    assert metrics["phase_sample_ci_low_ms"] == low and metrics["phase_sample_ci_high_ms"] == high
    # The profiled step is slower: scale 0.8 maps its host time onto the timed one, CIs alike.
    scaled = over_pairs(pairs, host_ms=1.0, level=0.95, scale=0.8)
    assert scaled.host_ms == merged.host_ms and scaled.scale == 0.8  # kept as profiled
    assert scaled.timed_ms == pytest.approx({"sample": 0.2, "preprocess": 0.8})
    assert scaled.largest == ("preprocess", pytest.approx(0.8))
    metrics = phase_metrics(scaled, profiled_host_ms=1.25)
    assert metrics["phase_sample_ms"] == pytest.approx(0.2) and metrics["phase_scale"] == 0.8
    assert (metrics["phase_sample_ci_low_ms"], metrics["phase_sample_ci_high_ms"]) == pytest.approx((0.8 * low, 0.8 * high))
    assert metrics["attributed_frac"] == pytest.approx(1.0) and metrics["attributed_frac_profiled"] == pytest.approx(1.0)


def test_fewer_than_three_pairs_give_phases_without_a_ci():
    from hostsweep.measure.phases import PhaseSplit, over_pairs

    pairs = [PhaseSplit({"sample": v}, 2.0, 0.0) for v in (0.1, 0.3)]
    merged = over_pairs(pairs, host_ms=1.0, level=0.95)
    assert merged.host_ms == pytest.approx({"sample": 0.2}) and merged.ci_ms == {}
    assert merged.forward_compute_ci is None and "forward_compute_ci_low_ms" not in phase_metrics(merged)


def loop_trace(loop: str, start: float, end: float, scopes: list[tuple[str, float, float]] = ()) -> dict:
    events = [scope(f"hostsweep span: {loop}", start, end - start)]
    events += [scope(name, ts, dur) for name, ts, dur in scopes]
    return {"traceEvents": events}


@pytest.mark.parametrize("work_us", [400.0, 1300.0])
def test_the_front_end_is_overlapped_while_it_keeps_up_and_exposed_by_what_it_falls_behind(work_us):
    """Engine steps of 1000 us from t=0; the front-end takes each step's outputs 50 us after
    the step ends, or when it is done with the previous ones, and works work_us on them.
    400 us keeps up: its end trails the engine's by the same 450 us at T=1 and T=9, nothing
    exposed. 1300 us outlasts a step: it falls 300 us further behind each step."""
    from hostsweep.measure.phases import frontend_phases

    def pair(T: int) -> tuple:
        core = phase_totals(loop_trace("engine_loop", 0.0, 1000.0 * T))
        free, scopes = 0.0, []
        for k in range(T):
            start = max(1000.0 * (k + 1) + 50.0, free)
            scopes.append(("hostsweep: frontend_process_outputs", start, work_us))
            free = start + work_us
        return core, phase_totals(loop_trace("frontend_loop", scopes[0][1], free, scopes))

    (core_1, front_1), (core_T, front_T) = pair(1), pair(9)
    exposed, overlapped = frontend_phases(core_1, core_T, front_1, front_T, 9)
    assert overlapped == pytest.approx({"frontend_process_outputs": work_us / 1e3})
    assert exposed == pytest.approx({"frontend_exposed": max(0.0, work_us - 1000.0) / 1e3})
