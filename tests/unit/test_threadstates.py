"""py-spy raw output → thread-state table, on small synthesized recordings."""
from __future__ import annotations

import pytest

from hostsweep.measure.threadstates import idle_fraction, label_process, parse_raw, thread_states

ALL = """process 10:"ray::SweepWorker";thread (10): MainThread;generate (llm.py:1);poll (zmq.py:9) 80
process 10:"ray::SweepWorker";thread (10): MainThread;generate (llm.py:1);step (core.py:5) 20
process 10:"ray::SweepWorker";process 11:"VLLM::EngineCore";thread (11): MainThread;busy_loop (core.py:2);sched_yield (shm.py:3) 60
process 10:"ray::SweepWorker";process 11:"VLLM::EngineCore";thread (11): MainThread;busy_loop (core.py:2);schedule (sched.py:4) 40
"""
ACTIVE = """process 10:"ray::SweepWorker";thread (10): MainThread;generate (llm.py:1);step (core.py:5) 20
process 10:"ray::SweepWorker";process 11:"VLLM::EngineCore";thread (11): MainThread;busy_loop (core.py:2);schedule (sched.py:4) 40
process 10:"ray::SweepWorker";process 11:"VLLM::EngineCore";thread (11): MainThread;busy_loop (core.py:2);sched_yield (shm.py:3) 30
"""


def test_raw_lines_are_attributed_to_the_innermost_process_and_leaf():
    counts = parse_raw(ALL)
    assert counts[("11", "VLLM::EngineCore", "MainThread", "sched_yield")] == 60
    assert counts[("10", "ray::SweepWorker", "MainThread", "poll")] == 80


def test_thread_states_give_active_share_and_what_idle_threads_wait_in():
    table = thread_states(ALL, ACTIVE).set_index("process")
    assert table.loc["ray::SweepWorker", "active_frac"] == pytest.approx(0.2)
    assert table.loc["ray::SweepWorker", "top_idle_leaf"] == "poll"
    assert table.loc["VLLM::EngineCore", "active_frac"] == pytest.approx(0.7)
    assert table.loc["VLLM::EngineCore", "top_idle_leaf"] == "sched_yield"
    assert idle_fraction(thread_states(ALL, ACTIVE)) == pytest.approx((80 + 30) / 200)


def test_empty_recordings_give_an_empty_table():
    assert thread_states("", "").empty


def test_recordings_of_single_processes_parse_as_one_tree():
    worker = "thread (10): MainThread;generate (llm.py:1);poll (zmq.py:9) 80\n"
    engine = "thread (11): MainThread;busy_loop (core.py:2);schedule (sched.py:4) 40\n"
    text = label_process(worker, 10, "ray::SweepWorker") + label_process(engine, 11, "VLLM::EngineCore --x")
    counts = parse_raw(text)
    assert counts == {("10", "ray::SweepWorker", "MainThread", "poll"): 80,
                      ("11", "VLLM::EngineCore", "MainThread", "schedule"): 40}
