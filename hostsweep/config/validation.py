"""Input validation: every check that can fail before Ray or vLLM starts.

Each failure is a ConfigError whose message names the field, what was given and
what is allowed, so the CLI can print it as one line.
"""
from __future__ import annotations

from typing import Any, Iterable

from hostsweep.config.schema import (
    DTYPES, ENGINES, LOAD_FORMATS, MODEL_SOURCES, STAGES, TP_EXECUTORS, ConfigError, ModelConfig, SkuConfig,
    SweepConfig,
)


def positive_ints(field_name: str, value: Any) -> list[int]:
    """Normalize `4` or `[1, 2, 4]` to a sorted list of distinct positive ints."""
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if not values:
        raise ConfigError(f"{field_name} is empty; give one positive integer or a list of them")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ConfigError(f"{field_name} must be positive integers, got {v!r}")
    return sorted(set(values))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_choice(field_name: str, value: Any, allowed: Iterable[str]) -> None:
    if value not in allowed:
        raise ConfigError(f"{field_name}={value!r} is not allowed; allowed: {', '.join(allowed)}")


def check_measure(cfg: SweepConfig) -> None:
    m = cfg.measure
    if m.T < 2:
        raise ConfigError(
            f"measure.T must be >= 2 (step = (wall_T - wall_1) / (T - 1)), got {m.T}"
        )
    if m.warmups < 0:
        raise ConfigError(f"measure.warmups must be >= 0, got {m.warmups}")
    if m.reps < 2:
        raise ConfigError(f"measure.reps must be >= 2 for a confidence interval, got {m.reps}")
    if not 0.0 < m.ci_level < 1.0:
        raise ConfigError(f"measure.ci_level must be in (0, 1), got {m.ci_level}")
    if m.bootstrap_resamples < 100:
        raise ConfigError(
            f"measure.bootstrap_resamples must be >= 100, got {m.bootstrap_resamples}"
        )


def check_split(cfg: SweepConfig) -> None:
    if cfg.split.reps < 1:
        raise ConfigError(f"split.reps must be >= 1, got {cfg.split.reps}")
    if not 0.0 < cfg.split.host_bound_threshold < 1.0:
        raise ConfigError(f"split.host_bound_threshold must be in (0, 1), got {cfg.split.host_bound_threshold}")
    lin = cfg.linearity
    if lin.enabled:
        tokens = positive_ints("linearity.T", lin.T)
        if len(tokens) < 3 or min(tokens) < 2:
            raise ConfigError(f"linearity.T needs at least 3 distinct values >= 2, got {list(lin.T)}")
        if lin.reps < 1:
            raise ConfigError(f"linearity.reps must be >= 1, got {lin.reps}")


def check_tp(cfg: SweepConfig, sku: SkuConfig, model: ModelConfig) -> None:
    tps = cfg.tp
    shape = model.shape
    if shape is not None:
        heads = shape.num_attention_heads
        for tp in tps:
            if heads % tp:
                raise ConfigError(
                    f"tp={tp} does not divide the {heads} attention heads of model "
                    f"{model.name}; allowed tp: {', '.join(map(str, _divisors(heads)))}"
                )
    if sku.gpus_per_node and max(tps) > sku.gpus_per_node:
        raise ConfigError(
            f"tp={max(tps)} exceeds the {sku.gpus_per_node} GPUs of one {sku.name} node; "
            f"allowed tp: 1..{sku.gpus_per_node}"
        )


def check_context(cfg: SweepConfig, model: ModelConfig, longest_generate: tuple[int, str]) -> None:
    shape = model.shape
    if shape is None:
        return
    longest, field_name = longest_generate
    limit = shape.max_position_embeddings - longest
    if max(cfg.ctx) > limit:
        raise ConfigError(
            f"ctx={max(cfg.ctx)} plus {field_name}={longest} exceeds model {model.name}'s "
            f"max_position_embeddings={shape.max_position_embeddings}; allowed ctx <= {limit}"
        )


def check_capabilities(cfg: SweepConfig, sku: SkuConfig) -> None:
    """Refuse modes the SKU cannot run, instead of letting the engine fail obscurely."""
    mode = cfg.mode
    if mode.quantization and sku.accelerator_type is None:
        raise ConfigError(
            f"mode={mode.name} (quantization={mode.quantization}) needs a GPU SKU; "
            f"the vLLM CPU build cannot run it on sku={sku.name}"
        )
    if cfg.engine.tp_executor == "ray" and sku.accelerator_type is None:
        raise ConfigError(
            f"engine.tp_executor=ray places TP ranks on GPUs; sku={sku.name} has none "
            "(CPU TP runs its ranks with mp, on disjoint cores)"
        )


def validate(cfg: SweepConfig, skus: Iterable[SkuConfig], models: Iterable[ModelConfig],
             longest_generate: tuple[int, str]) -> None:
    """Check a config whose tp/batch/ctx lists are already normalized (config.resolve)."""
    _check_choice("stage", cfg.stage, STAGES)
    _check_choice("engine.name", cfg.engine.name, ENGINES)
    _check_choice("engine.dtype", cfg.engine.dtype, DTYPES)
    _check_choice("engine.tp_executor", cfg.engine.tp_executor, TP_EXECUTORS)
    models = list(models)
    for model in models:
        _check_choice("model.source", model.source, MODEL_SOURCES)
        _check_choice("model.load_format", model.load_format, LOAD_FORMATS)
    check_measure(cfg)
    check_split(cfg)
    if cfg.faults.max_retries < 0:
        raise ConfigError(f"faults.max_retries must be >= 0, got {cfg.faults.max_retries}")
    if cfg.faults.cell_timeout_s is not None and cfg.faults.cell_timeout_s <= 0:
        raise ConfigError(f"faults.cell_timeout_s must be positive or null, got {cfg.faults.cell_timeout_s}")
    for sku in skus:
        for model in models:
            check_tp(cfg, sku, model)
        check_capabilities(cfg, sku)
    for model in models:
        check_context(cfg, model, longest_generate)
