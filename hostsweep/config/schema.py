"""Config schemas (dataclasses), their Hydra registration, and input validation.

Schema lives here, values live in conf/*.yaml. Validation raises ConfigError naming
the field and the allowed values, before any cluster or engine starts.
"""
from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

CONFIG_GROUPS = ("sku", "model", "mode", "experiment")


class ConfigError(ValueError):
    """Bad user input, reported as one line before anything expensive starts."""


@dataclass
class ShapeConfig:
    architecture: str = MISSING
    hidden_size: int = MISSING
    intermediate_size: int = MISSING
    num_hidden_layers: int = MISSING
    num_attention_heads: int = MISSING
    num_key_value_heads: int = MISSING
    head_dim: int = MISSING
    vocab_size: int = MISSING
    max_position_embeddings: int = MISSING
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    rms_norm_eps: float = 1e-5
    rope_scaling: Optional[dict[str, Any]] = None


@dataclass
class ModelConfig:
    name: str = MISSING
    source: str = "shape"  # "shape": built from `shape`; "checkpoint": hub id or directory
    path: Optional[str] = None
    load_format: str = "dummy"
    shape: Optional[ShapeConfig] = None


@dataclass
class SkuConfig:
    name: str = MISSING
    accelerator_type: Optional[str] = None  # Ray's accelerator type; None for the CPU
    device_memory_gib: Optional[float] = None
    peak_bf16_tflops: Optional[float] = None
    mem_bandwidth_gbps: Optional[float] = None
    interconnect: str = ""
    interconnect_gbps: Optional[float] = None
    gpus_per_node: int = 0


@dataclass
class ModeConfig:
    name: str = MISSING
    enforce_eager: bool = True
    quantization: Optional[str] = None


@dataclass
class MeasureConfig:
    T: int = 33
    warmups: int = 2
    reps: int = 12
    bootstrap_resamples: int = 2000
    ci_level: float = 0.95
    seed: int = 0


@dataclass
class SplitConfig:
    """Device/host split from profiled T=1 / T pairs, separate from the timed reps."""

    enabled: bool = True
    reps: int = 1  # profiled pairs per cell; device_ms is their median
    host_bound_threshold: float = 0.5  # host_frac at or above this is "host-bound"
    top_ops: int = 15
    keep_traces: bool = False  # traces are large; off unless asked for
    pyspy: bool = False  # py-spy thread states of the engine tree (skipped if py-spy is absent)
    pyspy_seconds: float = 3.0


@dataclass
class LinearityConfig:
    """Opt-in: wall and kernel time over a decade of T, to check the two-point slope."""

    enabled: bool = False
    T: list[int] = field(default_factory=lambda: [8, 16, 32, 64, 128, 256, 512])
    reps: int = 3  # unprofiled generates per T; their median wall is used


@dataclass
class EngineConfig:
    name: str = "vllm"  # "vllm", or "fake" (simulated timings, for tests and dry runs)
    # "auto": bfloat16 on GPUs and on CPUs with native bf16 (avx512_bf16/AMX); float32 on
    # other CPUs, where vLLM's emulated bf16 makes prefill ~6x slower (seen on AVX2 here).
    dtype: str = "auto"
    cpu_kvcache_gib: int = 1  # whole GiB: vLLM parses VLLM_CPU_KVCACHE_SPACE as an int
    gpu_memory_utilization: float = 0.9
    # How a TP-k engine on GPUs runs its ranks: "mp" (vLLM's single-node default) or
    # "ray" (vLLM's Ray executor, ranks in the worker's placement group). See placement.py.
    tp_executor: str = "mp"


@dataclass
class RayConfig:
    address: Optional[str] = None
    # Local cluster only: start Ray's daemons pinned to the last core, away from the
    # cores vLLM binds compute to; workers take every core back before their engine starts.
    confine_daemons: bool = True
    # Local cluster only: Ray's daemons run under SCHED_IDLE; the raylet only where its
    # workers may leave that policy (cluster.connect).
    idle_daemons: bool = True
    feasibility_timeout_s: float = 10.0


@dataclass
class FaultsConfig:
    cell_timeout_s: Optional[float] = None  # a cell running longer is FAILED and its worker replaced
    max_retries: int = 1  # retries of a cell whose worker died mid-measurement


@dataclass
class TrackingConfig:
    uri: str = "sqlite:///outputs/mlflow.db"
    experiment: Optional[str] = None


@dataclass
class OutputConfig:
    cells_file: str = "cells.csv"


@dataclass
class SweepConfig:
    study: str = "default"
    sku: Optional[SkuConfig] = None
    # Several SKUs in one sweep (dispatched concurrently), e.g. skus=[h100,h200]; when
    # set it replaces `sku`.
    skus: Optional[list[str]] = None
    model: ModelConfig = MISSING
    mode: ModeConfig = MISSING
    # int or list of ints: Hydra users write `tp=4` as well as `tp=[2,4]`.
    tp: Any = 1
    batch: Any = field(default_factory=lambda: [1])
    ctx: Any = field(default_factory=lambda: [128])
    measure: MeasureConfig = field(default_factory=MeasureConfig)
    split: SplitConfig = field(default_factory=SplitConfig)
    linearity: LinearityConfig = field(default_factory=LinearityConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    # Skip cells whose key already has a FINISHED run in the study's experiment, so a
    # rerun after Ctrl-C or a crash measures only what is missing. resume=false remeasures.
    resume: bool = True
    output: OutputConfig = field(default_factory=OutputConfig)


def register_configs() -> None:
    """Register the schemas so every YAML in conf/ is type-checked on composition."""
    store = ConfigStore.instance()
    store.store(name="hostsweep_schema", node=SweepConfig)
    store.store(group="sku", name="sku_schema", node=SkuConfig)
    store.store(group="model", name="model_schema", node=ModelConfig)
    store.store(group="mode", name="mode_schema", node=ModeConfig)


def group_options(group: str) -> list[str]:
    """The YAML options shipped for one config group, e.g. ['cpu', 'h100', 'h200']."""
    folder = resources.files("hostsweep.conf").joinpath(group)
    if not folder.is_dir():
        return []
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def check_option(group: str, option: str, where: str = "") -> None:
    """ConfigError naming the group and its allowed values if `option` is not shipped."""
    allowed = group_options(group)
    if option not in allowed:
        raise ConfigError(f"unknown {group} '{option}'{where}; allowed {group} values: {', '.join(allowed)}")


def check_group_overrides(argv: list[str]) -> None:
    """Reject `sku=…`, `model=…`, `mode=…`, `experiment=…` options that do not exist.

    Hydra reports these itself, but over many lines; this gives one line naming the
    field and the allowed values, before Hydra composes anything.
    """
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        group = key.lstrip("+~")
        if group not in CONFIG_GROUPS or not value or value == "null":
            continue
        for option in value.split(","):  # multirun sweeps list options with commas
            check_option(group, option)


def _load_option(group: str, name: str, schema: type) -> Any:
    """conf/<group>/<name>.yaml outside Hydra composition, typed by its schema."""
    text = resources.files("hostsweep.conf").joinpath(group, f"{name}.yaml").read_text()
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.create(text)))


def load_sku(name: str) -> SkuConfig:
    """Load conf/sku/<name>.yaml onto the schema."""
    return _load_option("sku", name, SkuConfig)


def load_model_shape(name: str) -> dict[str, Any]:
    """The shape of a shipped model option (conf/model/<name>.yaml) as a plain dict."""
    model: ModelConfig = _load_option("model", name, ModelConfig)
    if model.shape is None:
        raise ConfigError(f"model {name} has no shipped shape (a checkpoint option)")
    return asdict(model.shape)


def local_sku_name() -> str:
    """The kind of this machine: the first GPU's SKU when nvidia-smi sees one, else cpu."""
    if shutil.which("nvidia-smi") is None:
        return "cpu"
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return "cpu"
    for option in group_options("sku"):
        if option != "cpu" and option.upper() in out.upper():
            return option
    return "cpu"


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def default_dtype(gpu: bool, flags: set[str]) -> str:
    """bfloat16 where the hardware computes it natively, float32 on other CPUs."""
    if gpu or flags & {"avx512_bf16", "amx_bf16"}:
        return "bfloat16"
    return "float32"


def sweep_skus(cfg: SweepConfig) -> list[SkuConfig]:
    """The SKUs a sweep spans: the `skus` list when given, else the single `sku`."""
    if cfg.skus:
        for name in cfg.skus:
            check_option("sku", name, " in skus")
        return [load_sku(name) for name in dict.fromkeys(cfg.skus)]
    if cfg.sku is None:
        raise ConfigError("no SKU: give +sku=NAME or skus=[...]")
    return [cfg.sku]


def to_sweep_config(cfg: DictConfig) -> SweepConfig:
    """Typed config from Hydra's DictConfig; fills the SKU with the local kind if absent."""
    typed: SweepConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    if typed.sku is None:
        typed.sku = load_sku(local_sku_name())
    if typed.engine.dtype == "auto":
        any_gpu = any(s.accelerator_type is not None for s in sweep_skus(typed))
        typed.engine.dtype = default_dtype(any_gpu, cpu_flags())
    if typed.model.source == "checkpoint" and typed.model.shape is None:
        typed.model.shape = _shape_from_checkpoint(typed.model.path)
    return typed


def _shape_from_checkpoint(path: Optional[str]) -> Optional[ShapeConfig]:
    """Read a local checkpoint's config.json; a hub id is resolved on the worker instead."""
    if not path:
        raise ConfigError("model.path is required with model=checkpoint (a hub id or a directory)")
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return None
    hf = json.loads(config_file.read_text())
    heads = hf["num_attention_heads"]
    return ShapeConfig(
        architecture=hf.get("architectures", ["?"])[0],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads", heads),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        vocab_size=hf["vocab_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
    )
