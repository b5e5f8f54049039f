"""RayBackend's questions to a worker's watch thread, with a stand-in actor (no cluster)."""
from __future__ import annotations

from types import SimpleNamespace

import ray

from hostsweep.run.backend import WATCH_INTERVAL_S, RayBackend


class Question:
    """An actor method: counts how often it was called; each call's answer is ready at once."""

    def __init__(self, answer: object) -> None:
        self.answer, self.calls = answer, 0

    def options(self, **_: object) -> "Question":
        return self

    def remote(self) -> object:
        self.calls += 1
        return ("ref", self.answer)


def test_a_worker_is_asked_for_its_health_and_phase_at_most_once_a_watch_interval(monkeypatch):
    monkeypatch.setattr(ray, "wait", lambda refs, timeout=None: (list(refs), []))
    monkeypatch.setattr(ray, "get", lambda ref: ref[1])
    health, phase = Question(None), Question("rep 1 of 2")
    worker = SimpleNamespace(actor=SimpleNamespace(engine_health=health, phase=phase))
    clock = [100.0]
    backend = RayBackend()
    monkeypatch.setattr(backend, "now", lambda: clock[0])
    for _ in range(50):  # the dispatcher's polls after fifty instant cells
        assert backend.engine_fault(worker) is None
        backend.phase(worker)
    assert (health.calls, phase.calls) == (1, 1)
    assert backend.phase(worker) == "rep 1 of 2"  # the last answer is still shown
    clock[0] += WATCH_INTERVAL_S
    backend.engine_fault(worker)
    backend.phase(worker)
    assert (health.calls, phase.calls) == (2, 2)
