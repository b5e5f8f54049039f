"""ray_cluster.yaml declares worker types whose accelerator types match conf/sku."""
from __future__ import annotations

from pathlib import Path

import yaml

from hostsweep.config.options import load_sku

CLUSTER = yaml.safe_load((Path(__file__).resolve().parents[2] / "ray_cluster.yaml").read_text())


def test_gpu_node_types_carry_the_accelerator_type_of_their_sku():
    for sku in ("h100", "h200"):
        node = CLUSTER["available_node_types"][sku]
        accelerator = load_sku(sku).accelerator_type
        assert node["resources"][f"accelerator_type:{accelerator}"] > 0
        assert node["resources"]["GPU"] == load_sku(sku).gpus_per_node


def test_head_is_cpu_only_and_gpu_workers_install_the_gpu_extra():
    head = CLUSTER["available_node_types"][CLUSTER["head_node_type"]]
    assert "GPU" not in head["resources"]
    assert any("[gpu]" in command for command in CLUSTER["worker_setup_commands"])
    assert all("RAY_worker_niceness=0" in c for c in CLUSTER["worker_start_ray_commands"] if "ray start" in c)


def test_the_dashboard_and_its_jobs_api_listen_on_the_heads_loopback_only():
    starts = [c for c in CLUSTER["head_start_ray_commands"] if "ray start" in c]
    assert starts and all("--dashboard-host=127.0.0.1" in c for c in starts)
    assert "0.0.0.0" not in (Path(__file__).resolve().parents[2] / "ray_cluster.yaml").read_text()
