"""Plan feasibility against node inventories, and SKU pinning options (no Ray needed)."""
from __future__ import annotations

import pytest

from hostsweep.cluster import (
    InfeasiblePlan, NodeInventory, actor_options, check_feasible, cpu_engine_cpus, describe_inventory,
)
from hostsweep.grid import build_cells, group_by_engine
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


def test_gpu_workers_are_pinned_by_accelerator_type_and_hold_tp_gpus():
    (spec,) = specs("+sku=h100", "tp=4", "model=llama-3.1-8b")
    assert actor_options(spec) == {"num_cpus": 1, "num_gpus": 4, "accelerator_type": "H100"}


def test_cpu_workers_reserve_a_whole_cpu_node_and_no_gpu():
    (spec,) = specs("+sku=cpu")
    cpus = cpu_engine_cpus([CPU_NODE, H100_NODE])
    assert cpus == 2
    assert actor_options(spec, cpus) == {"num_cpus": 2, "num_gpus": 0}
