"""The CPU keystone preset as a Hydra multirun (-m): its sweeper's two shapes become two
jobs, through the real CLI, a local Ray cluster and MLflow, each logged with a split.

The fake engine answers: the real vLLM CPU engine measures and splits both shapes in
tests/integration/test_compare_end_to_end.py (this preset's engines, started again, would
add two minutes and test nothing new).
"""
from __future__ import annotations

import mlflow
import pytest

from tests.conftest import run_hostsweep

pytestmark = pytest.mark.integration


def test_keystone_cpu_multirun_logs_one_job_per_shape_with_a_split(tmp_path, new_store):
    uri = new_store(tmp_path / "mlflow.db")  # the sweeps in tests/integration with real engines create theirs
    proc = run_hostsweep(
        ["-m", "+experiment=keystone-cpu", "+sku=cpu", "engine.name=fake", "measure.T=17", "ctx=[64]", "measure.reps=3",
         "measure.warmups=1", "measure.remeasure_unstable=0", f"tracking.uri={uri}", f"hydra.sweep.dir={tmp_path}/multi"],
        cwd=tmp_path, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=["hostsweep-keystone-cpu"])
    cells = runs[runs["tags.mlflow.parentRunId"].notna()]
    assert sorted(cells["params.model"]) == ["small-llama", "tiny-llama"]
    assert ((cells["metrics.host_frac"] > 0) & (cells["metrics.host_frac"] < 1)).all()
    assert len(set(cells["tags.mlflow.parentRunId"])) == 2  # one parent run per multirun job
