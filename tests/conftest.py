"""Shared fixtures: Hydra composition of the shipped config tree."""
from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module
from omegaconf import DictConfig

from hostsweep.config import SweepConfig, register_configs, to_sweep_config

register_configs()


def compose_raw(overrides: list[str]) -> DictConfig:
    with initialize_config_module("hostsweep.conf", version_base="1.3"):
        return compose("config", overrides=overrides)


def compose_typed(overrides: list[str]) -> SweepConfig:
    return to_sweep_config(compose_raw(overrides))


@pytest.fixture
def cpu_config() -> SweepConfig:
    """The embedded default, pinned to the CPU SKU whatever machine runs the tests."""
    return compose_typed(["+sku=cpu"])
