"""Shared fixtures: Hydra composition of the shipped config tree, and the CLI as a subprocess."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Hashable, Optional, TypeVar

import pytest
from hydra import compose, initialize_config_module
from omegaconf import DictConfig

from hostsweep.config.resolve import Study, resolve
from hostsweep.config.schema import register_configs

register_configs()

T = TypeVar("T")


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


def run_concurrently(jobs: dict[Hashable, Callable[[], T]]) -> dict[Hashable, T]:
    """Each job's result by its key, the jobs run side by side: CLI refusals are separate
    processes that mostly import, so a module runs them at once and its tests read them."""
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        futures = {key: pool.submit(job) for key, job in jobs.items()}
        return {key: future.result() for key, future in futures.items()}


@pytest.fixture(autouse=True)
def unit_tests_spawn_no_vllm_ranks(request, monkeypatch):
    """The engine-path all-reduce spawns vLLM ranks (tens of seconds, and its outcome is the
    machine's): only an integration test may reach it. A unit test that does fails at once,
    naming the fix."""
    if request.node.get_closest_marker("integration"):
        return
    import hostsweep.calibrate.engine_allreduce as engine_allreduce

    def refuse(*args, **kwargs):
        raise AssertionError("a unit test reached the real engine-path all-reduce: give its calibration an "
                             "all-reduce entry with path: engine, or mark the test integration")

    monkeypatch.setattr(engine_allreduce, "run_engine_allreduce", refuse)


@pytest.fixture(scope="session")
def empty_store_file(tmp_path_factory) -> Path:
    """An empty MLflow sqlite store, created once: MLflow creates and migrates a new one in
    about 5 s here, a copy opens at once. The CLI sweeps of tests/integration still have
    MLflow create theirs."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    folder = tmp_path_factory.mktemp("empty-store")
    SqlAlchemyStore(f"sqlite:///{folder}/mlflow.db", str(folder / "artifacts")).engine.dispose()
    return folder / "mlflow.db"


@pytest.fixture(scope="session")
def new_store(empty_store_file) -> Callable[[Path], str]:
    """`new_store(path)`: an empty MLflow sqlite store at `path` (a copy); its tracking URI."""
    def make(path: Path) -> str:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(empty_store_file, path)
        return f"sqlite:///{path}"

    return make


@pytest.fixture
def cpu_config() -> Study:
    """The embedded default, pinned to the CPU SKU whatever machine runs the tests."""
    return compose_typed(["+sku=cpu"])
