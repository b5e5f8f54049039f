"""Dispatch on a multi-node local Ray cluster with fake accelerators and the fake engine:
SKU pinning, TP placement, actor death, timeouts, resume, infeasible plans (the last also
through the command line, joining this cluster by its address)."""
from __future__ import annotations

import os
from collections import Counter

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hostsweep.stages import sweep
from hostsweep.run.actors import new_worker, release_worker
from hostsweep.run.cluster import InfeasiblePlan, check_feasible, live_nodes
from hostsweep.run.backend import RayBackend
from hostsweep.run.dispatch import Dispatcher
from hostsweep.run.faults import FaultPolicy
from hostsweep.record.recorder import SweepRecorder
from hostsweep.config.grid import build_cells, group_by_engine
from hostsweep.measure.results import MeasureOptions
from tests.conftest import compose_raw, compose_typed, run_hostsweep

pytestmark = pytest.mark.integration
FAST = ["engine.name=fake", "measure.T=5", "measure.reps=3", "measure.warmups=1", "ctx=[16]"]


@pytest.fixture(scope="module")
def cluster():
    """A CPU head, one node with 4 fake H100s and one with 4 fake H200s."""
    fake = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    nodes = {
        "h100": fake.add_node(num_cpus=2, num_gpus=4, resources={"accelerator_type:H100": 1}),
        "h200": fake.add_node(num_cpus=2, num_gpus=4, resources={"accelerator_type:H200": 1}),
    }
    fake.wait_for_nodes()
    ray.init(address=fake.address)
    yield {sku: node.node_id for sku, node in nodes.items()}
    ray.shutdown()
    fake.shutdown()


def quick_options() -> MeasureOptions:
    return MeasureOptions.of(compose_typed([*FAST, "split.enabled=false"]).config)


def cells_for(*overrides: str):
    return build_cells(compose_typed([*FAST, *overrides]))


def run(cells, policy=FaultPolicy(), on_result=None):
    results = []

    def collect(result):
        results.append(result)
        if on_result:
            on_result(result)

    dispatcher = Dispatcher(cells, quick_options(), collect, RayBackend(), policy)
    dispatcher.run()
    return results, dispatcher


def test_cells_land_on_nodes_of_their_sku(cluster):
    cells = cells_for("+sku=h100", "model=llama-3.1-8b", "batch=[1,2]") + \
        cells_for("+sku=h200", "model=llama-3.1-8b", "batch=[1,2]")
    results, _ = run(cells)
    assert sorted(r.key for r in results) == sorted(c.key for c in cells)
    for result in results:
        assert result.status == "FINISHED", result.error
        assert result.host["ray_node_id"] == cluster[result.params["sku"]]


def worker_env(actor, name):
    return ray.get(actor.__ray_call__.remote(lambda worker, key: os.environ.get(key), name))


@pytest.mark.parametrize("executor", ["mp", "ray"])
def test_tp_k_worker_gets_k_one_gpu_bundles_on_one_node_and_hands_their_gpus_to_its_ranks(cluster, executor):
    (spec,) = group_by_engine(cells_for("+sku=h200", "model=llama-3.1-8b", "tp=4", f"engine.tp_executor={executor}"))
    worker = new_worker(spec)
    actor = worker.actor
    host = ray.get(actor.host_info.remote())
    (table,) = [t for t in ray.util.placement_group_table().values() if t["state"] == "CREATED"]
    assert table["strategy"] == "STRICT_PACK"
    assert [b["GPU"] for b in table["bundles"].values()] == [1.0] * 4
    assert all(b["accelerator_type:H200"] > 0 for b in table["bundles"].values())
    assert set(table["bundles_to_node_id"].values()) == {cluster["h200"]}
    gpus = host["ray_gpu_ids"].split(",")
    assert len(set(gpus)) == 4  # one distinct GPU from each bundle
    if executor == "mp":  # vLLM's multiprocessing ranks see exactly the bundles' GPUs
        assert worker_env(actor, "CUDA_VISIBLE_DEVICES") == host["ray_gpu_ids"]
    else:  # vLLM's Ray executor places rank i in bundle i: each bundle's GPU is still free
        assert worker_env(actor, "CUDA_VISIBLE_DEVICES") is None
        pg = worker.placement_group
        rank = ray.remote(num_cpus=0, num_gpus=1)(lambda: ray.get_gpu_ids())
        ranks = [rank.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i))
                 .remote() for i in range(4)]
        assert sorted(str(g) for ids in ray.get(ranks, timeout=30) for g in ids) == sorted(gpus)
    release_worker(worker)
    assert not [t for t in ray.util.placement_group_table().values() if t["state"] == "CREATED"]


def test_killing_a_worker_mid_sweep_still_measures_every_cell_once(cluster):
    cells = cells_for("+sku=h100", "model=llama-3.1-8b", "batch=[1,2,3,4]")
    results = []

    def record_and_kill_once(result):
        results.append(result)
        if len(results) == 1:
            (worker,) = dispatcher.workers.values()
            ray.kill(worker.actor)  # the next cell goes to a dead worker and must be retried elsewhere

    dispatcher = Dispatcher(cells, quick_options(), record_and_kill_once, RayBackend(),
                            FaultPolicy(max_retries=2))
    dispatcher.run()
    assert Counter(r.key for r in results) == Counter(c.key for c in cells)
    assert all(r.status == "FINISHED" for r in results), [r.error for r in results]
    assert sorted(r.attempt for r in results) == [1, 1, 1, 2]  # one cell retried once, the others not
    assert sum(len(r.retry_reasons) for r in results) == 1


def test_a_cell_past_its_timeout_fails_and_the_sweep_goes_on(cluster):
    slow = cells_for("+sku=h200", "model=llama-3.1-8b", "batch=[1,2]", "measure.T=400")
    results, _ = run(slow, FaultPolicy(cell_timeout_s=0.5, max_retries=0, poll_s=0.2))
    assert len(results) == 2
    assert all(r.status == "FAILED" and "timed out" in r.error for r in results)


def test_rerun_after_an_interrupted_sweep_measures_only_missing_cells(cluster, tmp_path, monkeypatch):
    args = ["+sku=h100", "model=llama-3.1-8b", *FAST, "batch=[1,2,3]", "split.enabled=false",
            f"tracking.uri=sqlite:///{tmp_path}/m.db", "study=resume", "ray.address=auto"]
    monkeypatch.setenv("RAY_ADDRESS", ray.get_runtime_context().gcs_address)  # preflight finds the test cluster
    calls = []
    original = SweepRecorder.on_result

    def crash_on_third(self, result):
        calls.append(result.key)
        if len(calls) == 3:
            raise KeyboardInterrupt  # the driver is interrupted as the third cell comes back
        return original(self, result)

    monkeypatch.setattr(SweepRecorder, "on_result", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        sweep.run(compose_raw(args), tmp_path / "first")
    monkeypatch.setattr(SweepRecorder, "on_result", original)

    assert sweep.run(compose_raw(args), tmp_path / "second") == 0
    import pandas as pd

    second = pd.read_csv(tmp_path / "second" / "cells.csv")  # the whole study, in grid order
    assert list(second["batch"]) == [1, 2, 3] and list(second["resumed"]) == [True, True, False]
    assert second["step_ms"].notna().all()
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/m.db")
    runs = mlflow.search_runs(experiment_names=["hostsweep-resume"], filter_string="attributes.status = 'FINISHED'")
    keys = runs["tags.cell_key"].dropna()
    assert sorted(Counter(keys).values()) == [1, 1, 1]
    run_of = dict(zip(runs["tags.cell_key"], runs["run_id"]))
    assert [run_of[k] for k in second["cell_key"]] == list(second["mlflow_run_id"])  # earlier rows: their own runs
    assert sweep.run(compose_raw([*args, "resume=false"]), tmp_path / "fresh") == 0
    assert len(pd.read_csv(tmp_path / "fresh" / "cells.csv")) == 3


def test_infeasible_plan_names_the_accelerators_the_cluster_has(cluster):
    specs = group_by_engine(cells_for("+sku=h200", "model=llama-3.1-8b", "tp=8"))
    with pytest.raises(InfeasiblePlan) as err:
        check_feasible(specs, live_nodes())
    assert "CPU-only (1 node)" in str(err.value) and "H100 x4 (1 node)" in str(err.value)
    assert "H200 x4 (1 node)" in str(err.value)


def test_infeasible_sku_fails_fast_naming_what_the_cluster_has(cluster, tmp_path):
    """A GPU SKU on a cluster without enough of it: the command joins the cluster by its
    address and refuses in one line naming the cluster's inventory, before anything is
    recorded. (Without ray.address, preflight refuses it before any cluster starts:
    tests/test_cli.py.)"""
    address = ray.get_runtime_context().gcs_address
    proc = run_hostsweep(["+sku=h200", "tp=8", "model=llama-3.1-8b", f"ray.address={address}",
                          f"tracking.uri=sqlite:///{tmp_path}/m.db", f"hydra.run.dir={tmp_path}/run"],
                         cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("hostsweep: error: sku=h200 tp=8 needs accelerator_type H200"), last
    assert "the cluster has: CPU-only (1 node), H100 x4 (1 node), H200 x4 (1 node)" in last
    assert not (tmp_path / "m.db").exists()
