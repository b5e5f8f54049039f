"""A sweep config resolved once: Hydra's DictConfig typed, the SKUs loaded, the grid lists
normalized, the dtype and a checkpoint's shape filled in, and everything validated.

The entry point calls `resolve` once; everything downstream receives the Study and never
re-reads conf/ or re-validates.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Collection, Optional

from omegaconf import DictConfig, OmegaConf, open_dict

from hostsweep.config.machine import cpu_flags, cpu_preload, default_dtype, dtype_reason, local_sku_name
from hostsweep.config.options import check_option, load_mode, load_model, load_sku
from hostsweep.config.pairing import (
    DEFAULT_STARTS, check_pair, check_side_python, check_sides, choose_design, default_reps, side_b_raw,
    unpaired_pair_keys,
)
from hostsweep.config.schema import ConfigError, ModeConfig, ModelConfig, ShapeConfig, SkuConfig, SweepConfig
from hostsweep.config.shapes import shape_from_hf_config
from hostsweep.config.validation import names, positive_ints, validate
from hostsweep.config.vllm_fields import ENGINE_ARG_FIELDS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Study:
    """A validated sweep config. `config.tp`, `.batch` and `.ctx` are sorted lists of
    distinct positive ints, `config.workload` a list of workloads; `skus`, `models` and
    `modes` are the SKUs, models and modes it spans, loaded."""

    config: SweepConfig
    skus: tuple[SkuConfig, ...]
    models: tuple[ModelConfig, ...] = ()
    modes: tuple[ModeConfig, ...] = ()
    # A paired A/B study (pair.against): its side b, resolved on its own (config/pairing.py).
    side_b: Optional["Study"] = None
    # The engine's dtype and why: 'float32: this CPU has no AVX-512 BF16' (engine.dtype=auto,
    # config/machine.dtype_reason) or 'bfloat16: engine.dtype was given'. The console, the
    # figures and summary.json say it: the same command runs another dtype on another CPU.
    dtype_why: str = ""
    # The CPU build's LD_PRELOAD (engine.preload: file names, config/machine.cpu_preload) and
    # what the console and summary.json say of it ("" where no CPU engine runs).
    preload: tuple[str, ...] = ()
    preload_why: str = ""

    @property
    def name(self) -> str:
        return self.config.study

    @property
    def experiment(self) -> str:
        """The study's MLflow experiment: tracking.experiment, or hostsweep-<study>."""
        return self.config.tracking.experiment or f"hostsweep-{self.name}"

    def longest_generate(self) -> tuple[int, str]:
        """The most tokens any generate of a cell asks for, and the field that asks."""
        cfg = self.config
        if cfg.linearity.enabled and max(cfg.linearity.T) > cfg.measure.T:
            return max(cfg.linearity.T), "linearity.T"
        return cfg.measure.T, "measure.T"


def _skus(cfg: SweepConfig) -> tuple[SkuConfig, ...]:
    """The `skus` list when given, else `+sku=`, else this machine's kind."""
    if cfg.skus:
        for name in cfg.skus:
            check_option("sku", name, " in skus")
        return tuple(load_sku(name) for name in dict.fromkeys(cfg.skus))
    return (cfg.sku if cfg.sku is not None else load_sku(local_sku_name()),)


def _modes(cfg: SweepConfig) -> tuple[ModeConfig, ...]:
    """The `modes` list when given (the one named like `mode` keeps its overrides), else `mode`."""
    if not cfg.modes:
        return (cfg.mode,)
    for name in cfg.modes:
        check_option("mode", name, " in modes")
    return tuple(cfg.mode if name == cfg.mode.name else load_mode(name) for name in dict.fromkeys(cfg.modes))
def _models(cfg: SweepConfig) -> tuple[ModelConfig, ...]:
    """The `models` list when given (the one named like `model` keeps its overrides), else `model`;
    a local checkpoint's shape filled in from its config.json."""
    if cfg.models:
        for name in cfg.models:
            check_option("model", name, " in models")
        models = tuple(cfg.model if name == cfg.model.name else load_model(name) for name in dict.fromkeys(cfg.models))
    else:
        models = (cfg.model,)
    for model in models:
        if model.source == "checkpoint" and model.shape is None:
            model.shape = _checkpoint_shape(model.path)
    return models


def _checkpoint_shape(path: Optional[str]) -> Optional[ShapeConfig]:
    """A local checkpoint's shape from its config.json; a hub id is resolved by vLLM."""
    if not path:
        raise ConfigError("model.path is required with model=checkpoint (a hub id or a directory)")
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return None
    return ShapeConfig(**shape_from_hf_config(json.loads(config_file.read_text())))


def _preload(cfg: SweepConfig, skus: tuple[SkuConfig, ...]) -> tuple[tuple[str, ...], str]:
    """engine.preload resolved on this machine (the engines' node on a local cluster)."""
    if cfg.engine.name != "vllm" or all(s.accelerator_type is not None for s in skus):
        return (), ""
    if cfg.engine.preload == "none":
        return (), "none (engine.preload=none: vLLM preloads PyTorch's libgomp only)"
    found, missing = cpu_preload()
    lacking = f"; not found: {', '.join(missing)}" if missing else ""
    if not found:
        return (), f"none{lacking}"
    return tuple(found), f"{':'.join(found)} (vLLM's CPU install guide){lacking}"


def resolve(raw: DictConfig, engine_fields: Collection[str] = ENGINE_ARG_FIELDS) -> Study:
    """Type, normalize and validate the composed config; ConfigError on bad input.

    `engine_fields` are the keys engine_args may hold: vLLM's EngineArgs fields, from the
    installed vLLM where the driver has one (stages pass them), else the shipped snapshot.
    A paired study's `raw` is given the paired design's measure settings, so the config a
    sweep logs says what ran."""
    cfg: SweepConfig = OmegaConf.to_object(raw)  # type: ignore[assignment]
    reps_given = cfg.measure.reps is not None
    if not reps_given:  # an unpaired study's; a gated paired one in rounds takes more below
        cfg.measure.reps = default_reps(None, gated=False)
        with open_dict(raw):  # the logged config says what ran
            raw.measure.reps = cfg.measure.reps
    skus, modes = _skus(cfg), _modes(cfg)
    cfg.tp, cfg.batch, cfg.ctx = (positive_ints(name, getattr(cfg, name)) for name in ("tp", "batch", "ctx"))
    cfg.workload = names("workload", cfg.workload)
    if cfg.engine.dtype == "auto":
        any_gpu = any(s.accelerator_type is not None for s in skus)
        cfg.engine.dtype = default_dtype(any_gpu, cpu_flags())
        dtype_why = f"{cfg.engine.dtype}: {dtype_reason(any_gpu, cpu_flags())}"
    else:
        dtype_why = f"{cfg.engine.dtype}: engine.dtype was given"
    models = _models(cfg)
    preload, preload_why = _preload(cfg, skus)
    study = Study(cfg, skus, models, modes, dtype_why=dtype_why, preload=preload, preload_why=preload_why)
    validate(cfg, skus, models, modes, study.longest_generate(), engine_fields)
    if not cfg.pair.paired:
        unpaired_pair_keys(cfg.pair)
        return study
    check_pair(cfg)
    # The start pairs are a paired study's re-measure: a side's group is not timed again in
    # periods, nor its first cell alone at the group's end, within a start (half the cost).
    cfg.measure.remeasure_unstable, cfg.measure.replicate_first = 0, False
    with open_dict(raw):
        raw.measure.remeasure_unstable, raw.measure.replicate_first = 0, False
    try:
        side_b = resolve(side_b_raw(raw, cfg.pair.against), engine_fields)
    except ConfigError as exc:
        message = str(exc)
        raise ConfigError(message if message.startswith("pair.") else f"pair.against (side b): {message}") from None
    check_sides(study, side_b)
    check_side_python(cfg.pair.python)
    design = choose_design(study, side_b)
    starts = 1 if design == "rounds" else (cfg.pair.starts or DEFAULT_STARTS)
    split = cfg.split.enabled and design != "rounds"
    if cfg.split.enabled and not split:
        # Both engines live in one process, whose front-end hooks the profiled pairs need one engine to own.
        log.warning("pair.design=rounds: the split (split.enabled) is not measured in paired rounds; "
                    "pair.design=starts measures it")
    reps = cfg.measure.reps if reps_given else default_reps(design, gated=cfg.diff.fail_on is not None)
    if reps != cfg.measure.reps:
        log.info("diff.fail_on=%s gates paired rounds: %d rounds a cell, not %d (measure.reps not given: %d rounds "
                 "find a change of twice the threshold in too few cells; docs/diff.md#gating-a-release-in-ci)",
                 cfg.diff.fail_on, reps, cfg.measure.reps, cfg.measure.reps)
    for side in (cfg, side_b.config):
        side.pair.design, side.pair.starts, side.split.enabled = design, starts, split
        side.measure.reps = reps
    with open_dict(raw):
        raw.pair.design, raw.pair.starts, raw.split.enabled = design, starts, split
        raw.measure.reps = reps
    return replace(study, side_b=side_b)
