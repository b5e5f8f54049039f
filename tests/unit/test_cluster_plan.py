"""Plan feasibility against node inventories, SKU pinning options and TP placement (no Ray needed)."""
from __future__ import annotations

import os
import time

import pytest

from hostsweep.config.grid import build_cells, group_by_engine
from hostsweep.engines.vllm_engine import engine_kwargs
from hostsweep.run import placement
from hostsweep.run.actors import actor_options, cpu_engine_cpus
from hostsweep.run.cluster import InfeasiblePlan, NodeInventory, check_feasible, describe_inventory
from hostsweep.run.hygiene import daemons_to_idle, descendant_pids, idle_process
from hostsweep.run.placement import placement_bundles
from tests.conftest import compose_typed

CPU_NODE = NodeInventory("n0", cpus=2, gpus=0, accelerator_types=())
H100_NODE = NodeInventory("n1", cpus=32, gpus=8, accelerator_types=("H100",))
H200_SMALL = NodeInventory("n2", cpus=16, gpus=2, accelerator_types=("H200",))


def specs(*overrides: str):
    return list(group_by_engine(build_cells(compose_typed(list(overrides)))))


def test_cpu_plan_fits_a_cpu_node():
    check_feasible(specs("+sku=cpu"), [CPU_NODE])


def test_h200_plan_on_a_cpu_cluster_names_what_exists():
    with pytest.raises(InfeasiblePlan) as err:
        check_feasible(specs("+sku=h200", "tp=4", "model=llama-3.1-8b"), [CPU_NODE])
    assert "H200" in str(err.value) and "CPU-only (1 node)" in str(err.value)


def test_tp_larger_than_any_node_of_the_sku_is_infeasible():
    with pytest.raises(InfeasiblePlan, match=r"H200 x2 \(1 node\)"):
        check_feasible(specs("+sku=h200", "tp=4", "model=llama-3.1-8b"), [H200_SMALL, H100_NODE])
    check_feasible(specs("+sku=h200", "tp=2", "model=llama-3.1-8b"), [H200_SMALL, H100_NODE])


def test_inventory_description_counts_nodes_per_kind():
    text = describe_inventory([CPU_NODE, H100_NODE, H100_NODE])
    assert text == "CPU-only (1 node), H100 x8 (2 nodes)"
    assert describe_inventory([]) == "no live nodes"


def test_single_gpu_workers_are_pinned_by_accelerator_type_and_hold_one_gpu():
    (spec,) = specs("+sku=h100", "tp=1", "model=llama-3.1-8b")
    assert actor_options(spec) == {"num_cpus": 1, "num_gpus": 1, "accelerator_type": "H100"}
    (tp4,) = specs("+sku=h100", "tp=4", "model=llama-3.1-8b")
    with pytest.raises(ValueError, match="placement group"):
        actor_options(tp4)


def test_tp_k_placement_is_k_one_gpu_bundles_of_the_sku_with_the_worker_cpu_in_bundle_0():
    bundles = placement_bundles(4, "H200")
    assert [b["GPU"] for b in bundles] == [1.0] * 4
    assert [b.get("CPU", 0) for b in bundles] == [1.0, 0, 0, 0]
    assert all(b["accelerator_type:H200"] > 0 for b in bundles)


def test_cpu_workers_reserve_a_whole_cpu_node_and_no_gpu():
    (spec,) = specs("+sku=cpu")
    cpus = cpu_engine_cpus([CPU_NODE, H100_NODE])
    assert cpus == 2
    assert actor_options(spec, cpus) == {"num_cpus": 2, "num_gpus": 0}


@pytest.mark.parametrize("executor, expected", [("mp", "3,5"), ("ray", None)])
def test_placement_group_gpus_go_to_mp_ranks_or_are_left_to_the_ray_executor(monkeypatch, executor, expected):
    monkeypatch.setattr(placement, "bundle_gpu_ids", lambda: ["3", "5"])
    environ = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    assert placement.hand_gpus_to_ranks(executor, environ) == ["3", "5"]
    assert environ.get("CUDA_VISIBLE_DEVICES") == expected


def test_outside_a_placement_group_the_visible_gpus_are_left_alone(monkeypatch):
    monkeypatch.setattr(placement, "bundle_gpu_ids", lambda: None)
    environ = {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert placement.hand_gpus_to_ranks("mp", environ) is None
    assert environ == {"CUDA_VISIBLE_DEVICES": "0,1"}


@pytest.mark.parametrize("sku, executor, backend", [("h100", "mp", "mp"), ("h100", "ray", "ray"), ("cpu", "mp", "mp")])
def test_vllm_gets_the_configured_executor_for_tp_ranks(sku, executor, backend):
    (spec,) = specs(f"+sku={sku}", "model=llama-3.1-8b" if sku != "cpu" else "model=tiny-llama", "tp=2",
                    f"engine.tp_executor={executor}")
    assert engine_kwargs(spec, "model-dir")["distributed_executor_backend"] == backend


def test_descendant_pids_finds_grandchildren():
    import subprocess
    import sys

    script = "import subprocess, sys; subprocess.run(['sleep', '5'])"
    child = subprocess.Popen([sys.executable, "-c", script])
    try:
        for _ in range(50):  # until the child has started its sleep
            grandchildren = descendant_pids(child.pid)
            if grandchildren:
                break
            time.sleep(0.1)
        found = descendant_pids(os.getpid())
        assert grandchildren and child.pid in found and set(grandchildren) <= set(found)
    finally:
        child.kill()
        child.wait()


def test_idle_process_puts_every_thread_of_a_daemon_under_sched_idle():
    import subprocess
    import sys

    script = "import threading, time; threading.Thread(target=time.sleep, args=(30,)).start(); print('ready', flush=True)"
    daemon = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert daemon.stdout.readline().strip() == "ready"
        idle_process(daemon.pid)
        threads = [int(t) for t in os.listdir(f"/proc/{daemon.pid}/task")]
        assert len(threads) >= 2
        assert all(os.sched_getscheduler(t) == os.SCHED_IDLE for t in threads)
    finally:
        daemon.kill()
        daemon.wait()


def test_every_daemon_but_the_raylet_is_idled():
    """A child keeps SCHED_IDLE (SCHED_RESET_ON_FORK only resets real-time policies), so
    an idled raylet would start idled workers."""
    import subprocess
    import sys

    rename = "import ctypes; ctypes.CDLL(None).prctl(15, b'%s', 0, 0, 0); print('ready', flush=True); input()"
    named = {name: subprocess.Popen([sys.executable, "-c", rename % name], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True) for name in ("raylet", "gcs_server")}
    try:
        for proc in named.values():
            assert proc.stdout.readline().strip() == "ready"
        pids = [p.pid for p in named.values()]
        assert daemons_to_idle(pids) == [named["gcs_server"].pid]
    finally:
        for proc in named.values():
            proc.kill()
            proc.wait()


