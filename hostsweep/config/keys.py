"""Every `key=value` on the command line names a key the schema knows, with or without `+`.

Hydra adds an unknown `+key` to the config and nothing reads it (`+mesure.T=5` ran the
default study at T=33), and refuses an unknown plain `key` over several lines with exit 1.
This check runs before Hydra composes anything and refuses both in one line, naming the
closest known key (pure: the schema's dataclasses are the list of keys).

Free-form mappings (`engine.engine_args`, `mode.engine_args`, the calibration's per-SKU
sections) are not the schema's to list. A new engine argument (`+engine.engine_args.K=V`)
is checked against the installed vLLM's fields when the study is resolved; one without
`+` must already be in the config, so it is checked here against the shipped snapshot of
vLLM's fields (a typo there is Hydra's multi-line error otherwise).
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from functools import lru_cache
from typing import Any, Optional, Union

from hostsweep.config.engine_args import check_engine_args
from hostsweep.config.schema import CONFIG_GROUPS, ConfigError, SweepConfig

# key prefixes whose next segment is a vLLM engine argument
ENGINE_ARGS = ("engine.engine_args", "mode.engine_args")
# Keys Hydra owns (hydra.run.dir, hydra.job.chdir, ...): Hydra checks those itself.
HYDRA_PREFIX = "hydra"


@dataclasses.dataclass(frozen=True)
class FreeMapping:
    """A dict-valued field: its keys are free; `value` is the schema under each key (None: anything)."""

    value: Optional[type]


def _unwrap(kind: Any) -> Any:
    """Optional[X] -> X."""
    if typing.get_origin(kind) is Union:
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        return args[0] if len(args) == 1 else Any
    return kind


def _node(kind: Any) -> Any:
    """What a field holds, for the walk: a dataclass, a FreeMapping, or None (a leaf)."""
    kind = _unwrap(kind)
    if dataclasses.is_dataclass(kind):
        return kind
    if typing.get_origin(kind) is dict:
        value = _unwrap(typing.get_args(kind)[1])
        return FreeMapping(value if dataclasses.is_dataclass(value) else None)
    return None


@lru_cache(maxsize=None)
def _fields(schema: type) -> dict[str, Any]:
    hints = typing.get_type_hints(schema)
    return {f.name: _node(hints[f.name]) for f in dataclasses.fields(schema)}


@lru_cache(maxsize=1)
def known_keys() -> tuple[str, ...]:
    """Every dotted key of the schema (nodes and leaves), e.g. 'measure', 'measure.T'."""
    keys: list[str] = []

    def walk(schema: type, prefix: str) -> None:
        for name, node in _fields(schema).items():
            keys.append(prefix + name)
            if isinstance(node, type):
                walk(node, f"{prefix}{name}.")

    walk(SweepConfig, "")
    return tuple(keys)


def _walk(key: str) -> tuple[Optional[int], Any]:
    """(index of the first segment of dotted `key` the schema lacks, the node that lacks it);
    (None, None) when the schema has the key or it lies inside a free-form mapping."""
    node: Any = SweepConfig
    for i, part in enumerate(key.split(".")):
        if isinstance(node, FreeMapping):
            if node.value is None:
                return None, None  # engine_args and the like: checked against vLLM's fields
            node = node.value  # this segment is a free key (a SKU name); the schema goes on below it
            continue
        if node is None or part not in _fields(node):  # below a leaf (measure.T.x), or no such field
            return i, node
        node = _fields(node)[part]
    return None, None


def unknown_part(key: str) -> Optional[str]:
    """The prefix of dotted `key` up to its first segment the schema lacks; None when the
    schema has the key (or it lies inside a free-form mapping)."""
    index, _ = _walk(key)
    return None if index is None else ".".join(key.split(".")[: index + 1])


def closest_key(key: str) -> Optional[str]:
    """The known key a typo most likely meant: the wrong segment replaced by its closest
    sibling (mesure.T -> measure.T, calibration.allreduce.h100.latncy_us -> ...latency_us),
    else the closest dotted key of the whole schema."""
    index, node = _walk(key)
    parts = key.split(".")
    if index is not None and isinstance(node, type):
        for sibling in difflib.get_close_matches(parts[index], list(_fields(node)), n=3, cutoff=0.6):
            guess = ".".join([*parts[:index], sibling, *parts[index + 1:]])
            if _walk(guess)[0] is None:
                return guess
    close = difflib.get_close_matches(key, known_keys(), n=1, cutoff=0.6)
    return close[0] if close else None


def override_key(arg: str) -> Optional[str]:
    """The config key an override sets or deletes (`+a.b=1`, `++a.b=1`, `~a.b`, `a.b=1`),
    or None for what is not a key override: flags, group choices with a package (`x@y=`) or a
    path (`hydra/job_logging=none`)."""
    if arg.startswith("-"):
        return None
    key = arg.split("=", 1)[0] if "=" in arg else (arg if arg.startswith("~") else "")
    key = key.lstrip("+~")
    if not key or "@" in key or "/" in key:
        return None
    return key


def check_known_keys(argv: list[str]) -> None:
    """ConfigError (one line, the closest known key) for the first override whose key
    the schema lacks. Config groups (`+sku=h200`) and Hydra's own keys are not checked here."""
    for arg in argv:
        key = override_key(arg)
        if key is None or key in CONFIG_GROUPS or key.split(".")[0] == HYDRA_PREFIX:
            continue
        if unknown_part(key) is None:
            where = next((p for p in ENGINE_ARGS if key.startswith(p + ".")), None)
            if where is not None and not arg.startswith("+"):
                check_engine_args({key[len(where) + 1:].split(".")[0]: None}, where)
            continue
        close = closest_key(key)
        hint = f"did you mean '{close}'?" if close else "every key: python -m hostsweep --cfg job"
        raise ConfigError(f"unknown key '{key}' in {arg}; {hint}")
