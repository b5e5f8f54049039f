"""Random weights for a model shape, written as a safetensors checkpoint (model.load_format=random).

vLLM's dummy loader fills every tensor from the same seed, so a Llama's LM head gets the
embedding's values whether or not the shape ties them: the next-token score is then a
symmetric form of the current token, and greedy decoding falls into a 2-cycle within two
tokens whatever the prompt (each step climbs the same symmetric score, so no longer cycle
exists). Any prompt is then n-gram friendly. Here each tensor gets its own seed, with the
dummy loader's range (uniform ±1e-3); with an untied LM head the next token is then close to
a random function of the current one, whose orbits run tens of tokens before repeating, so
random prompts get few n-gram hits and the model's own text (workload=repeat) gets many.
Decode latency does not depend on weight values, so timings match the dummy loader's.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

RANGE = 1e-3  # vLLM's dummy loader draws uniform(-1e-3, 1e-3)


def tensor_shapes(shape: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names and sizes of a Llama or Qwen2 shape (what vLLM loads)."""
    h, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    q = shape["num_attention_heads"] * shape["head_dim"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    qwen = shape["architecture"] == "Qwen2ForCausalLM"
    tensors: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    if not shape["tie_word_embeddings"]:
        tensors["lm_head.weight"] = (vocab, h)
    for layer in range(shape["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        tensors.update({
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })
        if qwen or shape.get("attention_bias"):
            tensors.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                            p + "self_attn.v_proj.bias": (kv,)})
        if shape.get("attention_bias") and not qwen:
            tensors[p + "self_attn.o_proj.bias"] = (h,)
    return tensors


def write_random_weights(shape: dict[str, Any], dtype: str, folder: Path, seed: int = 0) -> Path:
    """model.safetensors in `folder`: every tensor uniform(±RANGE) from its own seed."""
    import torch  # lazy: only workers write weights
    from safetensors.torch import save_file

    torch_dtype = getattr(torch, dtype if dtype != "auto" else "bfloat16")
    tensors = {}
    for index, (name, size) in enumerate(sorted(tensor_shapes(shape).items())):
        generator = torch.Generator().manual_seed(seed * 100_003 + index)
        values = torch.rand(size, generator=generator) * (2 * RANGE) - RANGE
        tensors[name] = values.to(torch_dtype)
    path = folder / "model.safetensors"
    partial = folder / f".model.safetensors.{os.getpid()}"
    save_file(tensors, str(partial))
    os.replace(partial, path)  # atomic: workers sharing the folder never read half a file
    return path
