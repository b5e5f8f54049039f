"""engine.preload: TCMalloc and Intel OpenMP found on the machine, stated, keyed and put in
the engine's LD_PRELOAD while it starts (config/machine.py, config/resolve.py, engines)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from hostsweep.config import machine
from hostsweep.config.grid import build_cells
from tests.conftest import compose_typed


def folder_with(tmp_path: Path, *names: str) -> Path:
    folder = tmp_path / "lib"
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_bytes(b"")
    return folder


def test_the_preload_takes_what_the_machine_has_in_the_guides_order_and_names_what_it_lacks(tmp_path):
    both = folder_with(tmp_path, "libiomp5.so", "libtcmalloc_minimal.so.4")
    assert machine.cpu_preload([both]) == (["libtcmalloc_minimal.so.4", "libiomp5.so"], [])
    only_omp = folder_with(tmp_path / "x", "libiomp5.so")
    found, missing = machine.cpu_preload([only_omp])
    assert found == ["libiomp5.so"] and len(missing) == 1 and "libtcmalloc-minimal4" in missing[0]


def test_a_worker_node_lacking_a_preloaded_library_is_told_in_one_line(tmp_path):
    folder = folder_with(tmp_path, "libiomp5.so")
    assert machine.preload_paths(("libiomp5.so",), [folder]) == [str(folder / "libiomp5.so")]
    with pytest.raises(ValueError, match=r"libtcmalloc_minimal.so.4 not on this node .*engine.preload=none"):
        machine.preload_paths(("libtcmalloc_minimal.so.4", "libiomp5.so"), [folder])


@pytest.fixture
def libraries_here(tmp_path, monkeypatch):
    folder = folder_with(tmp_path, "libiomp5.so", "libtcmalloc_minimal.so.4")
    monkeypatch.setattr(machine, "library_folders", lambda: [folder])
    return folder


def test_a_cpu_study_states_its_preload_and_keys_its_cells_by_it(libraries_here):
    auto, none = compose_typed(["+sku=cpu"]), compose_typed(["+sku=cpu", "engine.preload=none"])
    assert auto.preload == ("libtcmalloc_minimal.so.4", "libiomp5.so")
    assert auto.preload_why.startswith("libtcmalloc_minimal.so.4:libiomp5.so (vLLM's CPU install guide)")
    assert none.preload == () and none.preload_why.startswith("none (engine.preload=none")
    with_it, without = build_cells(auto)[0], build_cells(none)[0]
    assert with_it.engine.preload == "libtcmalloc_minimal.so.4:libiomp5.so" and without.engine.preload == ""
    assert with_it.key != without.key  # another allocator is another host


def test_the_fake_engine_and_gpu_studies_preload_nothing_and_keep_their_keys(libraries_here):
    fake = build_cells(compose_typed(["+sku=cpu", "engine.name=fake"]))[0]
    gpu = compose_typed(["+sku=h100"])
    assert fake.engine.preload == "" and gpu.preload == () and gpu.preload_why == ""
    assert all(c.engine.preload == "" for c in build_cells(gpu))


def test_an_engine_starts_under_its_preload_and_the_worker_keeps_its_own_environment(libraries_here, monkeypatch):
    from hostsweep.engines.vllm_engine import engine_preload

    spec = build_cells(compose_typed(["+sku=cpu"]))[0].engine
    monkeypatch.setenv("LD_PRELOAD", "/opt/own.so")
    with engine_preload(spec):
        during = os.environ["LD_PRELOAD"]
        os.environ["LD_PRELOAD"] = during + ":/torch/libgomp.so"  # as vLLM's platform adds it
    assert during == f"{libraries_here}/libtcmalloc_minimal.so.4:{libraries_here}/libiomp5.so:/opt/own.so"
    assert os.environ["LD_PRELOAD"] == "/opt/own.so"
    monkeypatch.delenv("LD_PRELOAD")
    with engine_preload(build_cells(compose_typed(["+sku=cpu", "engine.preload=none"]))[0].engine):
        assert "LD_PRELOAD" not in os.environ
    assert "LD_PRELOAD" not in os.environ
