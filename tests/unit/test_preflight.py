"""Preflight pieces that the CLI tests (tests/test_cli.py) cannot reach: the machine lock
and what a killed sweep left behind, and a hub id whose model is already cached."""
from __future__ import annotations

import json
import subprocess
import sys

import psutil
import pytest

from hostsweep.config.schema import ConfigError
from hostsweep.record import preflight
from tests.conftest import compose_typed


def test_ray_processes_a_killed_sweep_left_are_killed_by_the_next_one(tmp_path, monkeypatch):
    monkeypatch.setattr(preflight, "MACHINE_LOCK", tmp_path / "lock")
    leftover = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    started = f"{psutil.Process(leftover.pid).create_time():.2f}"
    (tmp_path / "lock").write_text(json.dumps({"pid": 999999999, "daemons": [
        [leftover.pid, started], [bystander.pid, "12.00"]]}))  # a reused pid: start time differs
    try:
        lock = preflight.lock_machine(compose_typed(["+sku=cpu"]), tmp_path / "run")
        assert leftover.wait(timeout=10) == -9
        assert bystander.poll() is None
        preflight.record_cluster(lock, [bystander.pid])
        assert json.loads((tmp_path / "lock").read_text())["daemons"][0][0] == bystander.pid
        with pytest.raises(ConfigError, match=r"another sweep \(pid \d+, study default"):
            preflight.lock_machine(compose_typed(["+sku=cpu"]), tmp_path / "run2")
        lock.close()
    finally:
        bystander.kill()
        bystander.wait()


def test_a_hub_id_already_in_the_cache_needs_no_hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="no hub access"):
        preflight.check_checkpoint("org/model")
    (tmp_path / "hub" / "models--org--model").mkdir(parents=True)
    preflight.check_checkpoint("org/model")


def test_a_checkpoint_folder_needs_a_config_json(tmp_path):
    with pytest.raises(ConfigError, match="has no config.json"):
        preflight.check_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    preflight.check_checkpoint(str(tmp_path))
