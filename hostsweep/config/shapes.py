"""Model shapes as Hugging Face config.json dicts, and their parameter counts (pure).

vLLM's `load_format="dummy"` builds random weights from a config.json alone, and decode
latency does not depend on weight values, so a shape is all a latency cell needs.
"""
from __future__ import annotations

from typing import Any

MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


def hf_config(shape: dict[str, Any], dtype: str = "bfloat16") -> dict[str, Any]:
    """The config.json that makes vLLM build this shape."""
    arch = shape["architecture"]
    if arch not in MODEL_TYPES:
        raise ValueError(f"architecture {arch!r} has no config template; known: {sorted(MODEL_TYPES)}")
    config: dict[str, Any] = {
        "architectures": [arch],
        "model_type": MODEL_TYPES[arch],
        "hidden_size": shape["hidden_size"],
        "intermediate_size": shape["intermediate_size"],
        "num_hidden_layers": shape["num_hidden_layers"],
        "num_attention_heads": shape["num_attention_heads"],
        "num_key_value_heads": shape["num_key_value_heads"],
        "head_dim": shape["head_dim"],
        "vocab_size": shape["vocab_size"],
        "max_position_embeddings": shape["max_position_embeddings"],
        "rope_theta": shape["rope_theta"],
        "rope_scaling": shape.get("rope_scaling"),
        "tie_word_embeddings": shape["tie_word_embeddings"],
        "rms_norm_eps": shape["rms_norm_eps"],
        "hidden_act": "silu",
        "torch_dtype": dtype if dtype != "auto" else "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "use_cache": True,
    }
    if arch == "LlamaForCausalLM":
        config["attention_bias"] = shape["attention_bias"]
        config["mlp_bias"] = False
    if arch == "Qwen2ForCausalLM":
        config["use_sliding_window"] = False
        config["sliding_window"] = None
    return config


def parameter_count(shape: dict[str, Any]) -> int:
    """Weights in the shape: embeddings, attention and MLP projections, norms, lm_head."""
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    q_width = shape["num_attention_heads"] * shape["head_dim"]
    kv_width = shape["num_key_value_heads"] * shape["head_dim"]
    attention = h * q_width + 2 * h * kv_width + q_width * h
    if shape.get("attention_bias"):
        attention += q_width + 2 * kv_width
    mlp = 3 * h * inter
    per_layer = attention + mlp + 2 * h  # two RMSNorm weight vectors
    embeddings = shape["vocab_size"] * h
    lm_head = 0 if shape["tie_word_embeddings"] else embeddings
    return layers * per_layer + embeddings + lm_head + h


def shape_from_hf_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The inverse of hf_config: a shape (ShapeConfig's fields) from a checkpoint's
    config.json, with the defaults Hugging Face applies to keys it may omit."""
    heads = hf["num_attention_heads"]
    return {
        "architecture": (hf.get("architectures") or ["?"])[0],
        "hidden_size": hf["hidden_size"],
        "intermediate_size": hf["intermediate_size"],
        "num_hidden_layers": hf["num_hidden_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": hf.get("num_key_value_heads", heads),
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
        "vocab_size": hf["vocab_size"],
        "max_position_embeddings": hf.get("max_position_embeddings", 2048),
        "tie_word_embeddings": hf.get("tie_word_embeddings", False),
    }
