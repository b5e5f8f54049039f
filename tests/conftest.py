"""Shared fixtures: Hydra composition of the shipped config tree, and the CLI as a subprocess."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
from hydra import compose, initialize_config_module
from omegaconf import DictConfig

from hostsweep.config.resolve import Study, resolve
from hostsweep.config.schema import register_configs

register_configs()


def compose_raw(overrides: list[str]) -> DictConfig:
    with initialize_config_module("hostsweep.conf", version_base="1.3"):
        return compose("config", overrides=overrides)


def compose_typed(overrides: list[str]) -> Study:
    """The resolved, validated study (raises ConfigError on bad input)."""
    return resolve(compose_raw(overrides))


def run_hostsweep(args: list[str], cwd: Path, timeout: float = 120, pythonpath: Optional[Path] = None,
                  env: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess:
    """`python -m hostsweep ARGS` in `cwd`; `pythonpath` is put first on PYTHONPATH, `env` added."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if pythonpath is not None:
        env["PYTHONPATH"] = f"{pythonpath}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return subprocess.run([sys.executable, "-m", "hostsweep", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def cpu_config() -> Study:
    """The embedded default, pinned to the CPU SKU whatever machine runs the tests."""
    return compose_typed(["+sku=cpu"])
