"""Config composition for every group option, and every bad input rejected up front."""
from __future__ import annotations

from pathlib import Path

import pytest

from hostsweep.config.machine import default_dtype, dtype_reason
from hostsweep.config.options import check_group_overrides, group_options
from hostsweep.config.schema import ConfigError
from hostsweep.config.grid import build_cells
from tests.conftest import compose_raw, compose_typed


@pytest.mark.parametrize("group", ["sku", "model", "mode"])
def test_every_group_option_composes_onto_the_schema(group):
    options = group_options(group)
    assert options, f"no options shipped for {group}"
    for option in options:
        overrides = [f"+sku={option}" if group == "sku" else f"{group}={option}"]
        if option == "checkpoint":
            overrides.append("model.path=meta-llama/Llama-3.1-8B")
        cfg = compose_raw(overrides)
        assert cfg[group].name == option


def test_shipped_options_include_the_seed_models_and_skus():
    assert {"cpu", "h100", "h200"} <= set(group_options("sku"))
    assert {"llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "llama-3.1-70b",
            "qwen2.5-14b", "qwen2.5-32b", "tiny-llama", "small-llama"} <= set(group_options("model"))
    assert "eager" in group_options("mode")


def test_plus_sku_and_top_level_tp_compose_exactly_as_written():
    study = compose_typed(["+sku=h200", "tp=4", "model=llama-3.1-8b"])
    (sku,) = study.skus
    assert sku.name == "h200" and sku.accelerator_type == "H200"
    assert study.config.tp == [4]  # normalized to a list once, at resolution
    assert study.config.engine.dtype == "bfloat16"  # auto resolves to bf16 on GPU SKUs
    assert {c.engine.tp for c in build_cells(study)} == {4}


def test_without_plus_sku_the_sku_is_the_local_kind(monkeypatch):
    monkeypatch.setattr("hostsweep.config.resolve.local_sku_name", lambda: "cpu")
    (sku,) = compose_typed([]).skus
    assert sku.name == "cpu" and sku.accelerator_type is None


@pytest.mark.parametrize("gpu,flags,expected", [
    (True, set(), "bfloat16"),
    (False, {"avx2", "avx512_bf16"}, "bfloat16"),
    (False, {"amx_bf16"}, "bfloat16"),
    (False, {"avx2", "fma"}, "float32"),
])
def test_auto_dtype_uses_bf16_only_where_native(gpu, flags, expected):
    assert default_dtype(gpu, flags) == expected


@pytest.mark.parametrize("gpu,flags,why", [
    (True, set(), "GPUs compute bfloat16 natively"),
    (False, {"avx2", "avx512_bf16"}, "this CPU has AVX-512 BF16"),
    (False, {"amx_bf16", "avx512_bf16"}, "this CPU has AVX-512 BF16 and AMX BF16"),
    (False, {"avx2", "avx512f"}, "this CPU has no AVX-512 BF16"),
])
def test_the_dtype_reason_names_the_flag_the_choice_followed(gpu, flags, why):
    assert dtype_reason(gpu, flags) == why
    # the reason and the choice agree: a reason naming a bf16 feature goes with bfloat16
    assert ("no AVX-512" in why) == (default_dtype(gpu, flags) == "float32")


@pytest.mark.parametrize("argv,field", [
    (["+sku=h300"], "sku"),
    (["model=llama-9b"], "model"),
    (["mode=turbo"], "mode"),
    (["model=tiny-llama,nope", "-m"], "model"),
])
def test_unknown_group_option_names_field_and_allowed_values(argv, field):
    with pytest.raises(ConfigError) as err:
        check_group_overrides(argv)
    message = str(err.value)
    assert field in message and "allowed" in message
    assert "\n" not in message
    for allowed in group_options(field):
        assert allowed in message


def test_known_group_options_and_plain_keys_pass_the_override_check():
    check_group_overrides(["+sku=h200", "tp=4", "model=llama-3.1-8b", "mode=eager", "--cfg", "job"])


@pytest.mark.parametrize("overrides,field", [
    (["+sku=cpu", "tp=3"], "tp=3"),                                  # 8 heads
    (["+sku=h200", "model=llama-3.1-70b", "tp=16"], "tp=16"),         # > GPUs per node
    (["+sku=cpu", "batch=[0]"], "batch"),
    (["+sku=cpu", "batch=[1,-2]"], "batch"),
    (["+sku=cpu", "ctx=0"], "ctx"),
    (["+sku=cpu", "ctx=[4090]"], "max_position_embeddings"),        # 4090 + 33 > 4096
    (["+sku=cpu", "measure.T=1"], "measure.T"),
    (["+sku=cpu", "measure.reps=1"], "measure.reps"),
    (["+sku=cpu", "engine.name=tgi"], "engine.name"),
    (["+sku=h100", "model=llama-3.1-8b", "tp=2", "engine.tp_executor=nccl"], "engine.tp_executor"),
    (["+sku=cpu", "tp=2", "engine.tp_executor=ray"], "engine.tp_executor=ray"),  # no GPUs to place ranks on
])
def test_bad_input_raises_one_line_naming_the_field(overrides, field):
    with pytest.raises(ConfigError) as err:
        compose_typed(overrides)
    assert field in str(err.value)
    assert "\n" not in str(err.value)


def test_tp_error_lists_the_allowed_divisors():
    with pytest.raises(ConfigError, match=r"allowed tp: 1, 2, 4, 8"):
        compose_typed(["+sku=cpu", "tp=3"])


def test_context_at_the_limit_is_accepted():
    assert compose_typed(["+sku=cpu", "ctx=[4063]"]).config.ctx == [4063]  # 4063 + 33 == 4096


def test_quantized_mode_is_refused_on_cpu_before_any_engine_starts():
    with pytest.raises(ConfigError, match="mode fp8 needs CUDA compute capability >= 8.9; sku cpu has no GPU"):
        compose_typed(["+sku=cpu", "mode=fp8"])
    with pytest.raises(ConfigError, match="needs a GPU SKU"):
        compose_typed(["+sku=cpu", "+engine.engine_args.quantization=fp8"])


def test_checkpoint_directory_supplies_the_shape(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,'
        ' "num_hidden_layers": 2, "num_attention_heads": 6, "vocab_size": 100,'
        ' "max_position_embeddings": 512}'
    )
    study = compose_typed(["+sku=cpu", "model=checkpoint", f"model.path={tmp_path}", "tp=3", "ctx=[64]"])
    assert study.config.model.shape.num_attention_heads == 6 and study.config.model.shape.head_dim == 64 // 6
    with pytest.raises(ConfigError, match="allowed tp: 1, 2, 3, 6"):
        compose_typed(["+sku=cpu", "model=checkpoint", f"model.path={tmp_path}", "tp=4", "ctx=[64]"])


def test_a_clusters_tracking_server_is_the_default_when_its_head_exports_it(monkeypatch):
    """ray_cluster.yaml's head exports HOSTSWEEP_TRACKING_URI for the drivers it runs; a
    given tracking.uri still wins, and without it the local sqlite store is the default."""
    monkeypatch.delenv("HOSTSWEEP_TRACKING_URI", raising=False)
    assert compose_typed(["+sku=cpu"]).config.tracking.uri == "sqlite:///outputs/mlflow.db"
    monkeypatch.setenv("HOSTSWEEP_TRACKING_URI", "http://10.0.0.5:5000")
    assert compose_typed(["+sku=cpu"]).config.tracking.uri == "http://10.0.0.5:5000"
    assert compose_typed(["+sku=cpu", "tracking.uri=sqlite:///x.db"]).config.tracking.uri == "sqlite:///x.db"


def test_a_servers_artifact_destination_is_a_folder_or_store_uri_and_only_beside_its_database(monkeypatch):
    monkeypatch.delenv("HOSTSWEEP_TRACKING_URI", raising=False)
    db = "tracking.uri=postgresql+psycopg2://mlflow:secret@127.0.0.1:5432/mlflow"
    assert compose_typed(["+sku=cpu", db, "tracking.artifacts=s3://bucket/hostsweep"]).config.tracking.artifacts == (
        "s3://bucket/hostsweep")
    compose_typed(["+sku=cpu", db, "tracking.artifacts=/srv/mlartifacts"])
    with pytest.raises(ConfigError, match="an absolute folder or a URI") as err:
        compose_typed(["+sku=cpu", db, "tracking.artifacts=mlartifacts"])
    assert "secret" not in str(err.value)
    with pytest.raises(ConfigError, match="the server keeps the artifacts itself"):
        compose_typed(["+sku=cpu", "tracking.uri=http://10.0.0.5:5000", "tracking.artifacts=s3://bucket/x"])


def schema_keys_missing_from(conf: dict) -> list[str]:
    """The schema's keys (SweepConfig, its sections recursively) a config tree does not name;
    the Hydra groups (sku, model, mode, calibration) have their own files."""
    import dataclasses
    import typing

    from hostsweep.config import schema

    def walk(cls, node, prefix: str) -> list[str]:
        hints, missing = typing.get_type_hints(cls), []
        for f in dataclasses.fields(cls):
            key = prefix + f.name
            if not prefix and f.name in ("sku", "model", "mode", "calibration"):
                continue
            if not isinstance(node, dict) or f.name not in node:
                missing.append(key)
            elif dataclasses.is_dataclass(hints[f.name]):
                missing += walk(hints[f.name], node[f.name], key + ".")
        return missing

    return walk(schema.SweepConfig, conf, "")


def test_every_schema_key_is_in_the_shipped_config_with_its_comment():
    """docs/configuring.md says every key is in conf/config.yaml: a key added to the schema
    alone is caught here. tracking.uri is the one left out on purpose: its default is the
    schema's interpolation of HOSTSWEEP_TRACKING_URI, which a value in the YAML would hide."""
    import yaml

    conf = yaml.safe_load((Path(__file__).resolve().parents[2] / "conf" / "config.yaml").read_text())
    assert schema_keys_missing_from(conf) == ["tracking.uri"]
    assert "measure.warmups" in schema_keys_missing_from({**conf, "measure": {"T": 33}})


@pytest.mark.parametrize("override, needle", [
    ("diff.threshold_pct=-5", "diff.threshold_pct must be in (0, 100), got -5.0"),
    ("diff.alpha=0.9", "diff.alpha must be in (0, 0.5], got 0.9"),
    ("diff.fail_on=slowest", "diff.fail_on='slowest' is not allowed"),
    ("diff.quantities=[]", "diff.quantities must name at least one metric"),
])
def test_a_sweep_refuses_a_bad_diff_section_before_anything_starts(override, needle):
    """A sweep's paired diff and its gate read diff.*: a bad value there once ran a whole
    default sweep (86 s) and exited 0."""
    from hostsweep.config.schema import ConfigError
    from hostsweep.stages.sweep import resolve_sweep
    from tests.conftest import compose_raw

    with pytest.raises(ConfigError) as refused:
        resolve_sweep(compose_raw(["+sku=cpu", "engine.name=fake", override]))
    assert needle in str(refused.value) and "\n" not in str(refused.value)
