"""The options shipped under conf/ (SKUs, models, modes, presets, calibrations), read
outside Hydra composition and checked by name, with one-line errors naming what exists.
"""
from __future__ import annotations

from dataclasses import asdict
from importlib import resources
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hostsweep.config.redact import error_line
from hostsweep.config.schema import CONFIG_GROUPS, CalibrationConfig, ConfigError, ModeConfig, ModelConfig, SkuConfig


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


def load_mode(name: str) -> ModeConfig:
    """Load conf/mode/<name>.yaml onto the schema."""
    return _load_option("mode", name, ModeConfig)
def load_model(name: str) -> ModelConfig:
    """Load conf/model/<name>.yaml onto the schema."""
    return _load_option("model", name, ModelConfig)


def load_model_shape(name: str) -> dict[str, Any]:
    """The shape of a shipped model option (conf/model/<name>.yaml) as a plain dict."""
    model = load_model(name)
    if model.shape is None:
        raise ConfigError(f"model {name} has no shipped shape (a checkpoint option)")
    return asdict(model.shape)


def load_calibration(name_or_path: str) -> CalibrationConfig:
    """A calibration YAML, typed by its schema: a file path, or a shipped name under
    conf/calibration/ (e.g. seed002-h100)."""
    path = Path(name_or_path)
    if path.is_file():
        text = path.read_text()
    else:
        check_option("calibration", name_or_path)
        text = resources.files("hostsweep.conf").joinpath("calibration", f"{name_or_path}.yaml").read_text()
    try:
        merged = OmegaConf.merge(OmegaConf.structured(CalibrationConfig), OmegaConf.create(text))
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except OmegaConfBaseException as exc:
        raise ConfigError(f"calibration {name_or_path}: {error_line(exc)}") from None
