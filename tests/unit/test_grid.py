"""The grid: cells, engine grouping, engine sizing and stable cell keys."""
from __future__ import annotations

import hashlib
import json
from dataclasses import replace

import pytest

from hostsweep.config.grid import build_cells, group_by_engine
from tests.conftest import compose_typed


def test_default_grid_is_batch_by_ctx_on_one_engine():
    cells = build_cells(compose_typed(["+sku=cpu"]))
    assert [(c.batch, c.ctx) for c in cells] == [(1, 128), (1, 512), (2, 128), (2, 512), (4, 128), (4, 512)]
    assert len(group_by_engine(cells)) == 1


def test_each_tp_degree_gets_its_own_engine():
    cells = build_cells(compose_typed(["+sku=h100", "model=llama-3.1-70b", "tp=[2,4]", "batch=[1,8]", "ctx=[2048]"]))
    groups = group_by_engine(cells)
    assert sorted(spec.tp for spec in groups) == [2, 4]
    assert all(len(group) == 2 for group in groups.values())


def test_engine_is_sized_to_its_largest_cell():
    cells = build_cells(compose_typed(["+sku=cpu", "batch=[1,3]", "ctx=[100,300]", "measure.T=17"]))
    args = cells[0].engine.engine_args
    assert args["max_model_len"] == 300 + 17
    assert args["max_num_seqs"] == 3


def test_cell_key_is_stable_and_distinguishes_measurements():
    a = build_cells(compose_typed(["+sku=cpu"]))
    b = build_cells(compose_typed(["+sku=cpu"]))
    assert [c.key for c in a] == [c.key for c in b]
    assert len({c.key for c in a}) == len(a)
    assert replace(a[0], reps=3).key != a[0].key
    assert a[0].key.startswith("cpu/tiny-llama/eager/tp1/b1/ctx128/T33/")


def test_tp_executor_is_part_of_the_key_only_off_the_mp_default():
    """Runs logged before engine.tp_executor existed were mp runs: their keys must still match."""
    (mp,) = build_cells(compose_typed(["+sku=h100", "model=llama-3.1-8b", "tp=2", "batch=1", "ctx=128"]))
    (ray_cell,) = build_cells(compose_typed(["+sku=h100", "model=llama-3.1-8b", "tp=2", "batch=1", "ctx=128",
                                             "engine.tp_executor=ray"]))
    e = mp.engine
    legacy = json.dumps([e.sku, e.model, e.shape_json, e.model_path, e.mode, e.quantization, e.tp, e.dtype,
                         e.engine, mp.batch, mp.ctx, mp.T, mp.warmups, mp.reps], sort_keys=True)
    assert mp.key.endswith(hashlib.sha1(legacy.encode()).hexdigest()[:10])
    assert ray_cell.key != mp.key
    assert (mp.params()["tp_executor"], ray_cell.params()["tp_executor"]) == ("mp", "ray")


def test_duplicate_grid_values_collapse():
    cells = build_cells(compose_typed(["+sku=cpu", "batch=[2,2,1]", "ctx=128"]))
    assert [c.batch for c in cells] == [1, 2]


def test_a_study_spanning_skus_and_tp_degrees_has_one_engine_per_pair():
    cells = build_cells(compose_typed(["+experiment=tp70b"]))
    groups = group_by_engine(cells)
    assert sorted((s.sku, s.tp) for s in groups) == [("h100", 2), ("h100", 4), ("h200", 2), ("h200", 4)]
    assert len(cells) == 48 and all(len(g) == 12 for g in groups.values())
    assert {s.accelerator_type for s in groups} == {"H100", "H200"}


def test_unknown_sku_in_a_list_names_the_allowed_ones():
    import pytest

    from hostsweep.config.schema import ConfigError

    with pytest.raises(ConfigError, match="unknown sku 'h300' in skus; allowed sku values: cpu, h100, h200"):
        build_cells(compose_typed(["skus=[h100,h300]"]))


def test_a_mode_the_sku_cannot_run_is_a_skipped_cell_in_a_multi_mode_study():
    from hostsweep.config.grid import runnable

    cells = build_cells(compose_typed(["skus=[cpu,h100]", "model=llama-3.2-1b", "modes=[eager,fp8,graph]",
                                       "batch=1", "ctx=128"]))
    skipped = {(c.engine.sku, c.engine.mode): c.skip for c in cells if c.skip}
    assert list(skipped) == [("cpu", "fp8")]
    assert skipped[("cpu", "fp8")] == "mode fp8 needs CUDA compute capability >= 8.9; sku cpu has no GPU"
    assert len(runnable(cells)) == 5  # graph on the CPU is the compiled path, not an error


def test_a_single_mode_some_sku_cannot_run_is_refused_before_anything_starts():
    import pytest

    from hostsweep.config.schema import ConfigError

    with pytest.raises(ConfigError, match="^mode fp8 needs CUDA compute capability >= 8.9; sku cpu has no GPU$"):
        build_cells(compose_typed(["skus=[h100,cpu]", "model=llama-3.2-1b", "mode=fp8"]))
    with pytest.raises(ConfigError, match="sku cpu has no GPU"):  # nothing would run on the CPU
        build_cells(compose_typed(["+sku=cpu", "modes=[fp8]"]))


def test_compute_capability_below_the_modes_need_is_named():
    from hostsweep.config.engine_args import unsupported_reason
    from hostsweep.config.options import load_mode
    from hostsweep.config.schema import SkuConfig

    a100 = SkuConfig(name="a100", accelerator_type="A100", compute_capability=8.0)
    assert unsupported_reason(load_mode("fp8"), a100) == \
        "mode fp8 needs CUDA compute capability >= 8.9; sku a100 has compute capability 8.0"
    assert unsupported_reason(load_mode("fp8"), SkuConfig(name="l4", accelerator_type="L4", compute_capability=8.9)) is None
    assert unsupported_reason(load_mode("graph"), SkuConfig(name="cpu")) is None


# Keys logged by earlier versions (the eager ones recomputed by the code of e111443, before
# the house move; the modes ones as modes introduced them): a resumed study finds its cells
# only if these never change. A new field joins a key only when off its old default.
# The dtype is part of a key and a CPU sku's default follows the CPU's flags (bfloat16 with
# AVX-512 BF16, else float32), so the CPU rows pin the dtype the keys were logged with; the
# preload too (engine.preload=auto keys its CPU cells by the libraries this machine has; the
# keys were logged before it, without one: none).
PINNED_KEYS = [
    (["+sku=cpu", "engine.dtype=bfloat16", "engine.preload=none"], "cpu/tiny-llama/eager/tp1/b1/ctx128/T33/2265fdaab9", "cpu/tiny-llama/eager/tp1/b4/ctx512/T33/25d9e9b360"),
    (["+experiment=tp70b"], "h100/llama-3.1-70b/eager/tp2/b1/ctx512/T33/c7b9c98425",
     "h200/llama-3.1-70b/eager/tp4/b8/ctx4096/T33/7cbb3add61"),
    (["+sku=h200", "tp=4", "model=llama-3.1-8b", "modes=[eager,graph]"], "h200/llama-3.1-8b/eager/tp4/b1/ctx128/T33/419e750a98",
     "h200/llama-3.1-8b/graph/tp4/b4/ctx512/T33/85b42584c2"),
    (["+sku=cpu", "engine.dtype=bfloat16", "engine.preload=none", "modes=[spec-ngram]", "workload=[repeat]"], "cpu/tiny-llama/spec-ngram/tp1/b1/ctx128/T33/6483750ec2",
     "cpu/tiny-llama/spec-ngram/tp1/b4/ctx512/T33/a5a110b6a9"),
]


@pytest.mark.parametrize("cpu_flags", [set(), {"avx512_bf16"}], ids=["cpu-without-bf16", "cpu-with-bf16"])
def test_cell_keys_of_shipped_configurations_never_change(monkeypatch, cpu_flags):
    # Whatever CPU runs the tests: the keys must not depend on the machine's flags.
    monkeypatch.setattr("hostsweep.config.resolve.cpu_flags", lambda: cpu_flags)
    for overrides, first, last in PINNED_KEYS:
        cells = build_cells(compose_typed(overrides))
        assert (cells[0].key, cells[-1].key) == (first, last), overrides


def test_the_cpu_default_dtype_follows_the_cpus_bf16_support(monkeypatch):
    monkeypatch.setattr("hostsweep.config.resolve.cpu_flags", lambda: set())
    study = compose_typed(["+sku=cpu"])
    assert {c.engine.dtype for c in build_cells(study)} == {"float32"}
    assert study.dtype_why == "float32: this CPU has no AVX-512 BF16"  # what the console and summary.json say
    monkeypatch.setattr("hostsweep.config.resolve.cpu_flags", lambda: {"avx512_bf16"})
    study = compose_typed(["+sku=cpu"])
    assert {c.engine.dtype for c in build_cells(study)} == {"bfloat16"}
    assert study.dtype_why == "bfloat16: this CPU has AVX-512 BF16"
    assert compose_typed(["+sku=cpu", "engine.dtype=float32"]).dtype_why == "float32: engine.dtype was given"
