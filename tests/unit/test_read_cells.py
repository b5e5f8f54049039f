"""What the fit and compare stages read back from a real sqlite store: cell runs only (a
sweep's parent has list-valued params), narrowed by parent run or filter, each with its
run id, readable name and parent."""
from __future__ import annotations

import mlflow
import pytest

from hostsweep.measure.protocol import CellMeasurement, RepTiming
from hostsweep.measure.results import CellResult
from hostsweep.record.read.readback import read_cells
from hostsweep.record.tracking import SweepTracker
from hostsweep.record.views import cell_run_name

PARAMS = {"sku": "cpu", "model": "tiny-llama", "mode": "eager", "tp": 1, "batch": 2, "ctx": 128,
          "T": 33, "reps": 2, "warmups": 1, "dtype": "float32", "engine": "fake", "tp_executor": "mp"}
REPS = (RepTiming(0, True, 0.010, 0.106, 0.003), RepTiming(1, False, 0.011, 0.107, 0.003))


def sweep(tracker: SweepTracker, batches: list[int], model: str) -> str:
    parent = tracker.start_sweep(f"{model} sweep", "study: unit\n", {"batch": batches, "tp": [1, 2]}, {})
    for batch in batches:
        params = {**PARAMS, "batch": batch, "model": model}
        tracker.log_cell(CellResult(f"{model}/{batch}", params, "FINISHED",
                                    CellMeasurement(2.0 + batch, 1.9, 2.1 + batch, 10.0, 100.0, REPS), None, {}), {})
    tracker.finish_sweep("FINISHED", {})
    return parent


@pytest.fixture
def store(tmp_path, new_store):
    tracker = SweepTracker(new_store(tmp_path / "mlflow.db"), "hostsweep-unit")
    parents = {model: sweep(tracker, [1, 4], model) for model in ("tiny-llama", "small-llama")}
    yield tracker.tracking_uri, parents
    mlflow.set_tracking_uri(None)


def test_only_cell_runs_come_back_with_their_run_name_and_parent(store):
    uri, parents = store
    frame = read_cells(uri, ["hostsweep-unit"])
    assert len(frame) == 4 and set(frame["parent_run_id"]) == set(parents.values())
    assert set(frame["run_name"]) == {f"b{b}-ctx128-eager-tp1-cpu-{m}" for b in (1, 4)
                                      for m in ("tiny-llama", "small-llama")}
    assert frame["run_id"].notna().all() and (frame["mode"] == "eager").all()


def test_cells_are_narrowed_by_their_sweep_or_a_filter(store):
    uri, parents = store
    one = read_cells(uri, ["hostsweep-unit"], parent_run_id=parents["small-llama"])
    assert set(one["model"]) == {"small-llama"} and len(one) == 2
    filtered = read_cells(uri, ["hostsweep-unit"], filter_string="params.batch = '4'")
    assert sorted(filtered["model"]) == ["small-llama", "tiny-llama"] and set(filtered["batch"]) == {4}


def test_a_cell_measured_again_by_a_later_sweep_counts_once_with_its_newest_run(store):
    uri, parents = store
    tracker = SweepTracker(uri, "hostsweep-unit")
    again = sweep(tracker, [4], "tiny-llama")  # the same cell key, newer
    frame = read_cells(uri, ["hostsweep-unit"])
    assert len(frame) == 4 and frame["cell_key"].is_unique
    tiny4 = frame[frame["cell_key"] == "tiny-llama/4"].iloc[0]
    assert tiny4["parent_run_id"] == again != parents["tiny-llama"]


def test_a_cell_run_name_reads_batch_context_mode_tp_then_sku_and_model():
    assert cell_run_name({**PARAMS, "batch": 4, "ctx": 512}) == "b4-ctx512-eager-tp1-cpu-tiny-llama"


def test_the_stability_verdict_comes_back_with_each_cell_and_a_cell_without_one_is_stable(store):
    from mlflow.tracking import MlflowClient

    from hostsweep.measure.unstable import exclude_unstable, unstable_mask

    uri, _ = store
    assert not unstable_mask(read_cells(uri, ["hostsweep-unit"])).any()
    frame = read_cells(uri, ["hostsweep-unit"])
    run_id = frame.loc[frame["cell_key"] == "tiny-llama/4", "run_id"].iloc[0]
    MlflowClient(uri).set_tag(run_id, "stable", "false")
    MlflowClient(uri).set_tag(run_id, "unstable_reasons", "foreign_cpu,ci_width")
    frame = read_cells(uri, ["hostsweep-unit"])
    flagged = frame.set_index("cell_key").loc["tiny-llama/4"]
    assert (flagged["stable"], flagged["unstable_reasons"]) == ("false", "foreign_cpu,ci_width")
    kept, exclusion = exclude_unstable(frame)
    assert len(kept) == 3 and exclusion.reasons() == {"ci_width": 1, "foreign_cpu": 1}
