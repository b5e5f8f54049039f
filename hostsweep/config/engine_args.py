"""Engine arguments as data: what a cell's engine is given, checked against vLLM's own field
list and resolved once per (sku, mode, tp) (pure).

A mode's `engine_args` and `engine.engine_args` go to `vllm.LLM(**engine_args)` unchanged,
the way vLLM's own benchmarks build `LLM(**asdict(EngineArgs))`. The harness owns the keys in
HARNESS_OWNED (they follow from the grid, the protocol or another config field) and refuses
them in user engine_args, so there is one way to set each.
"""
from __future__ import annotations

import difflib
import json
from typing import Any, Collection, Mapping, Optional

from hostsweep.config.schema import ConfigError, ModeConfig, ModelConfig, SkuConfig, SweepConfig
from hostsweep.config.vllm_fields import ENGINE_ARG_FIELDS

# Key -> what sets it. The worker adds `model` (the materialized shape's folder) and
# `profiler_config` (its trace folder); the rest is resolved here.
HARNESS_OWNED: dict[str, str] = {
    "model": "model= / model.path (shapes are materialized by the worker)",
    "tensor_parallel_size": "tp",
    "dtype": "engine.dtype",
    "load_format": "model.load_format",
    "max_model_len": "the grid (largest ctx + T)",
    "max_num_seqs": "the grid (largest batch)",
    "enable_prefix_caching": "the protocol (off: repeated prompts would skip their prefill)",
    "skip_tokenizer_init": "the protocol (prompts are token ids)",
    "seed": "the protocol (0)",
    "profiler_config": "split.enabled",
    "distributed_executor_backend": "engine.tp_executor",
    "gpu_memory_utilization": "engine.gpu_memory_utilization",
    "per_request_spec_decode_metrics": "the harness (summary whenever speculative_config is set)",
    "worker_extension_cls": "the harness (TP>1 ranks report their all-reduce path)",
}
# Mixed into TP>1 vLLM workers so each rank can say which all-reduce it uses.
WORKER_EXTENSION = "hostsweep.engines.vllm_ext.HostsweepWorkerExtension"
# What mode `eager` gave the engine before engine_args existed: cells with exactly these
# user arguments keep their earlier keys (config.grid.Cell.key).
LEGACY_EAGER_ARGS: dict[str, Any] = {"enforce_eager": True}


def canonical_json(value: Any) -> str:
    """One string per value: sorted keys, no spaces (hashable, and stable across runs)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def check_engine_args(args: Mapping[str, Any], where: str, fields: Collection[str] = ENGINE_ARG_FIELDS) -> None:
    """ConfigError for a key vLLM's EngineArgs lacks (naming the closest one) or one the
    harness owns (naming what sets it)."""
    for key in args:
        if key in HARNESS_OWNED:
            raise ConfigError(f"{where}.{key} is set by {HARNESS_OWNED[key]}; remove it from {where}")
        if key not in fields:
            close = difflib.get_close_matches(key, sorted(fields), n=1, cutoff=0.5)
            hint = f"did you mean '{close[0]}'?" if close else "see vllm.engine.arg_utils.EngineArgs"
            raise ConfigError(f"{where}.{key} is not a vLLM engine argument; {hint}")


def user_engine_args(mode: ModeConfig, cfg: SweepConfig) -> dict[str, Any]:
    """The mode's engine_args plus engine.engine_args; a key both set differently is refused."""
    merged = dict(mode.engine_args)
    for key, value in cfg.engine.engine_args.items():
        if key in merged and merged[key] != value:
            raise ConfigError(
                f"engine.engine_args.{key}={value!r} contradicts mode {mode.name}'s "
                f"engine_args.{key}={merged[key]!r}; change it in the mode (mode.engine_args.{key})"
            )
        merged[key] = value
    return merged


def num_speculative_tokens(args: Mapping[str, Any]) -> int:
    """Draft tokens per cycle of a speculative engine (0 without speculation)."""
    spec = args.get("speculative_config") or {}
    return int(spec.get("num_speculative_tokens", 0)) if isinstance(spec, Mapping) else 0


def resolved_engine_args(cfg: SweepConfig, sku: SkuConfig, mode: ModeConfig, tp: int,
                         longest_generate: int, model: Optional[ModelConfig] = None) -> dict[str, Any]:
    """Every vllm.LLM argument of one engine but `model` and `profiler_config`; `model` is
    one of the study's models (default: `cfg.model`)."""
    model = model if model is not None else cfg.model
    args = user_engine_args(mode, cfg)
    max_model_len = max(cfg.ctx) + longest_generate + num_speculative_tokens(args)
    if model.shape is not None:  # the speculative margin must not exceed the model's limit
        max_model_len = min(max_model_len, model.shape.max_position_embeddings)
    # "random" weights are written by the worker as a safetensors checkpoint (engines/weights.py).
    load_format = "safetensors" if model.load_format == "random" else model.load_format
    args.update(
        tensor_parallel_size=tp, dtype=cfg.engine.dtype, load_format=load_format,
        max_model_len=max_model_len, max_num_seqs=max(cfg.batch), enable_prefix_caching=False,
        skip_tokenizer_init=True, seed=0,
    )
    if sku.accelerator_type is not None:
        args["gpu_memory_utilization"] = cfg.engine.gpu_memory_utilization
    if tp > 1:
        # GPUs: ranks on the k GPUs of the worker's placement group, by mp or by vLLM's Ray
        # executor (run/placement.py). CPUs: mp, ranks bound to disjoint cores.
        args["distributed_executor_backend"] = cfg.engine.tp_executor if sku.accelerator_type else "mp"
        args["worker_extension_cls"] = WORKER_EXTENSION
    if "speculative_config" in args:
        args["per_request_spec_decode_metrics"] = "summary"  # acceptance counts per request
    return args


def keyed_engine_args(args: Mapping[str, Any]) -> dict[str, Any]:
    """The arguments a user chose (mode and engine.engine_args): what a cell key hashes beside
    the fields it always held. Harness-owned ones follow from those fields or from sizing."""
    return {k: v for k, v in args.items() if k not in HARNESS_OWNED}


def unsupported_reason(mode: ModeConfig, sku: SkuConfig, args: Optional[Mapping[str, Any]] = None) -> Optional[str]:
    """Why the SKU cannot run the mode (one line), or None when it can."""
    need = mode.min_compute_capability
    have = sku.compute_capability
    if need is not None and (have is None or have < need):
        has = f"compute capability {have}" if have is not None else "no GPU"
        return f"mode {mode.name} needs CUDA compute capability >= {need}; sku {sku.name} has {has}"
    quantization = (args if args is not None else mode.engine_args).get("quantization")
    if quantization and sku.accelerator_type is None:
        return (f"mode {mode.name} (quantization={quantization}) needs a GPU SKU; "
                f"the vLLM CPU build cannot run it on sku {sku.name}")
    return None
