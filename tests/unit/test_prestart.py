"""Engines start while the sweep still opens MLflow and claims its cells; a started worker
whose cells all turn out to be done already is released, never measured on."""
from __future__ import annotations

import time

from hostsweep.stages import sweep
from tests.conftest import compose_raw
from tests.fakes import FakeBackend

FAST = ["+sku=cpu", "engine.name=fake", "measure.T=5", "measure.reps=3", "measure.warmups=1", "ctx=[16]",
        "batch=[1,2]", "split.enabled=false", "ray.exclusive=false"]


class RecordingBackend(FakeBackend):
    """Notes, at each worker start, whether the sweep had opened its MLflow side yet."""

    def start(self, spec, partner=None, partner_first=False):
        self.started_before_mlflow = getattr(self, "started_before_mlflow", [])
        self.started_before_mlflow.append(not self.mlflow_open)
        return super().start(spec, partner, partner_first)


def test_workers_start_before_mlflow_opens_and_idle_ones_are_released(tmp_path, monkeypatch, new_store):
    import ray  # noqa: F401 - a worker's first start imports it (half a second): not what this test times

    monkeypatch.chdir(tmp_path)
    args = [*FAST, f"tracking.uri={new_store(tmp_path / 'mlflow.db')}", "study=prestart", "tp=[1,2]"]
    backend = RecordingBackend(tmp_path / "work")
    backend.mlflow_open = False
    open_study = sweep.open_study

    def opened(*a, **k):
        # Opening MLflow takes longer than two in-process fake starts on any machine: what is
        # tested is that the starts do not wait for it, not which of two threads is faster.
        time.sleep(1.0)
        result = open_study(*a, **k)
        backend.mlflow_open = True
        return result

    monkeypatch.setattr(sweep, "open_study", opened)
    assert sweep.run(compose_raw(args), tmp_path / "first", backend) == 0
    assert backend.started_before_mlflow == [True, True]  # one worker per TP degree, both early
    assert len(backend.measured) == 4

    # Resume with one more TP degree: the two done engines' workers go back unused.
    again = RecordingBackend(tmp_path / "work2")
    again.mlflow_open = False
    monkeypatch.setattr(sweep, "open_study", lambda *a, **k: (setattr(again, "mlflow_open", True), open_study(*a, **k))[1])
    assert sweep.run(compose_raw([*args[:-1], "tp=[1,2,4]"]), tmp_path / "second", again) == 0
    assert len(again.workers) == 3 and len(again.measured) == 2
    idle = [w for w in again.workers if w.spec.tp in (1, 2)]
    assert all(w.released for w in idle) and not any(w in again.closed for w in idle)
