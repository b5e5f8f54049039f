"""Model shapes: parameter counts against published sizes, and the config.json vLLM reads."""
from __future__ import annotations

from dataclasses import asdict

import pytest

from hostsweep.config.shapes import hf_config, parameter_count
from tests.conftest import compose_typed

# Parameter counts published on the models' cards / computed by transformers.
PUBLISHED = {
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "qwen2.5-14b": 14_770_033_664,
    "qwen2.5-32b": 32_763_876_352,
}


@pytest.mark.parametrize("model,count", sorted(PUBLISHED.items()))
def test_shipped_shape_has_the_published_parameter_count(model, count):
    shape = asdict(compose_typed(["+sku=cpu", f"model={model}"]).config.model.shape)
    assert parameter_count(shape) == count


def test_cpu_shapes_are_about_a_decade_apart():
    tiny = parameter_count(asdict(compose_typed(["+sku=cpu", "model=tiny-llama"]).config.model.shape))
    small = parameter_count(asdict(compose_typed(["+sku=cpu", "model=small-llama"]).config.model.shape))
    assert 8 <= small / tiny <= 15


@pytest.mark.parametrize("model,model_type", [("llama-3.1-8b", "llama"), ("qwen2.5-14b", "qwen2")])
def test_hf_config_carries_the_shape_and_architecture(model, model_type):
    shape = asdict(compose_typed(["+sku=cpu", f"model={model}"]).config.model.shape)
    config = hf_config(shape, "bfloat16")
    assert config["model_type"] == model_type
    assert config["architectures"] == [shape["architecture"]]
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"):
        assert config[key] == shape[key]


def test_hf_config_rejects_an_unknown_architecture():
    with pytest.raises(ValueError, match="MistralForCausalLM"):
        hf_config({"architecture": "MistralForCausalLM"})
