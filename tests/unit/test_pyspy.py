"""run/pyspy.py against a stand-in py-spy whose attaching takes a known time: every
process of the tree gets its whole window, however long its py-spy takes to attach."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from hostsweep.run import pyspy

# Records "its" process for --duration seconds after attaching, which takes SLOW_ATTACH_S
# for every process but the root (the one named in ROOT_PID): as py-spy takes seconds to
# read a process's memory maps on a loaded machine.
STAND_IN = textwrap.dedent("""\
    #!{python}
    import os, sys, time
    args = sys.argv[1:]
    pid, seconds, output = (args[args.index(flag) + 1] for flag in ("--pid", "--duration", "--output"))
    time.sleep(0 if pid == os.environ["ROOT_PID"] else float(os.environ["SLOW_ATTACH_S"]))
    time.sleep(float(seconds))
    with open(output, "w") as out:
        out.write(f"thread ({{pid}}): MainThread;work (x.py:1);wait (y.py:2) 100\\n")
        if "--idle" in args:
            out.write(f"thread ({{pid}}): MainThread;work (x.py:1);poll (z.py:3) 100\\n")
    """)


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    binary = tmp_path / "py-spy"
    binary.write_text(STAND_IN.format(python=sys.executable))
    binary.chmod(0o755)
    monkeypatch.setattr(pyspy, "pyspy_binary", lambda: str(binary))
    monkeypatch.setenv("ROOT_PID", str(os.getpid()))
    monkeypatch.setenv("SLOW_ATTACH_S", "2")
    return binary


def test_a_child_whose_py_spy_attaches_late_is_still_sampled_for_the_whole_window(stand_in):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        calls = []
        began = time.monotonic()
        states = pyspy.record_thread_states(os.getpid(), 1.0, lambda: (calls.append(1), time.sleep(0.05)))
        took = time.monotonic() - began
    finally:
        child.kill()
        child.wait()
    assert states is not None
    by_pid = states.groupby("pid")["samples"].sum()
    assert by_pid.get(str(child.pid)) == 200 and by_pid.get(str(os.getpid())) == 200
    assert took >= 3.0  # the workload ran until the late one's window (attach 2 s + 1 s) was over
    assert set(states["active_frac"]) == {0.5}


def test_a_child_py_spy_cannot_record_is_left_out_and_the_rest_kept(stand_in, monkeypatch):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    real = pyspy._recorder

    def refuse_the_child(binary, pid, seconds, output, idle):
        return real("/bin/false", pid, seconds, output, idle) if pid == child.pid else real(binary, pid, seconds,
                                                                                              output, idle)

    monkeypatch.setattr(pyspy, "_recorder", refuse_the_child)
    try:
        states = pyspy.record_thread_states(os.getpid(), 1.0, lambda: time.sleep(0.05))
    finally:
        child.kill()
        child.wait()
    assert states is not None  # pytest's other children (earlier tests' servers) may be in it too
    assert str(os.getpid()) in set(states["pid"]) and str(child.pid) not in set(states["pid"])


def test_a_child_whose_first_py_spy_fails_gets_one_more_window(stand_in, monkeypatch):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    real, tries = pyspy._recorder, []

    def fail_the_childs_first(binary, pid, seconds, output, idle):
        if pid == child.pid:
            tries.append(idle)
            if len(tries) <= 2:  # both views of the first window
                return real("/bin/false", pid, seconds, output, idle)
        return real(binary, pid, seconds, output, idle)

    monkeypatch.setattr(pyspy, "_recorder", fail_the_childs_first)
    monkeypatch.setenv("SLOW_ATTACH_S", "0")
    try:
        states = pyspy.record_thread_states(os.getpid(), 1.0, lambda: time.sleep(0.05))
    finally:
        child.kill()
        child.wait()
    assert len(tries) == 4
    assert states.groupby("pid")["samples"].sum().get(str(child.pid)) == 200
