"""A paired A/B study's second side, from the study and Hydra overrides (pure but for one
subprocess that asks side b's Python what it holds).

`+pair.against.mode=graph` names side b as overrides of the study, the keys the command
line sets, under pair.against, so a user says "against what" the way they said "what". Side a is the study as
given; side b is the same study with the overrides applied, resolved and validated on its
own. Only what changes the engine may differ (ALLOWED_KEYS): the grid's load axes and the
protocol are the study's, so each cell of side a has one partner in side b, timed with the
same protocol. `pair.python` runs side b's workers under another environment's Python
(another vLLM or torch release) through Ray's runtime_env.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import subprocess
from pathlib import Path
from typing import Any, Mapping, Optional

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from hostsweep.config.options import check_option, load_mode, load_model, load_sku
from hostsweep.config.schema import ConfigError

# What side b may change: the engine, never the grid's load axes or the protocol (a cell of
# one side is compared with the cell of the other at the same batch, ctx and workload,
# timed the same way).
ALLOWED_KEYS = ("mode", "modes", "model", "models", "tp", "sku", "skus", "engine", "debug")
GROUP_LOADERS = {"mode": load_mode, "model": load_model, "sku": load_sku}
# What side b's Python must hold: the worker's own code and Ray at the driver's release.
SIDE_MODULES = ("ray", "hostsweep", "vllm")
# rounds: both engines on one node (one worker, or a partner worker: run/sides.py), a cell's
# two sides timed back to back in every round; starts: engine starts alternated ABBA; auto:
# rounds where the sides can share a node.
PAIR_DESIGNS = ("auto", "rounds", "starts")
DEFAULT_STARTS = 3
# Paired rounds meet every (side order, T order) combination once in this many rounds
# (measure/protocol.side_a_first), so a study's rounds are rounded up to a multiple of it:
# with 30 rounds a slot met them 8/8/7/7 times and a switch cost did not cancel exactly.
ROUND_CYCLE = 4


# measure.reps when not given: 12 timed pairs a cell; 40 rounds in paired rounds gated by
# diff.fail_on. A floored rounds cell's sign test (compare/stats.py) at 12 rounds finds a true
# +10 % in 0.07-0.63 of cells, at 40 in 0.99 (benchmarks/gate_rule.py, RESULTS.md): a gate's
# default must be able to see what its threshold names, and its console says which it took.
DEFAULT_REPS, GATED_ROUNDS = 12, 40


def default_reps(design: Optional[str], gated: bool) -> int:
    """measure.reps for a study that did not give it: GATED_ROUNDS for paired rounds (design
    'rounds') under a gate (diff.fail_on), else DEFAULT_REPS."""
    return GATED_ROUNDS if design == "rounds" and gated else DEFAULT_REPS


def balanced_rounds(rounds: int) -> int:
    """rounds rounded up to a multiple of ROUND_CYCLE (config/grid.py applies it to paired rounds)."""
    return -(-int(rounds) // ROUND_CYCLE) * ROUND_CYCLE
# Two engines on one GPU share its memory: their vLLM gpu_memory_utilization must fit beside each other.
SHARED_GPU_MEMORY = 0.95


def flat_overrides(against: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """pair.against's nested keys as dotted ones ({'debug': {'delay_ms': 0.6}} ->
    {'debug.delay_ms': 0.6}); a config group named by a string stays one key (mode: graph)."""
    flat: dict[str, Any] = {}
    for key, value in against.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flat_overrides(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def against_text(against: Mapping[str, Any]) -> str:
    """Side b's overrides as one canonical string (a cell param, part of the cell key):
    'debug.delay_ms=0.6 debug.delay_phase=sample'; '' for a paired A/A."""
    return " ".join(f"{k}={v if isinstance(v, str) else json.dumps(v)}"
                    for k, v in sorted(flat_overrides(against).items()))


def side_b_raw(raw: DictConfig, against: Mapping[str, Any]) -> DictConfig:
    """The study's composed config with side b's overrides applied (config groups reloaded
    from conf/, keys set as the command line sets them); pair is cleared on it."""
    side = copy.deepcopy(raw)
    OmegaConf.set_struct(side, True)
    for key, value in flat_overrides(against).items():
        if key.split(".")[0] not in ALLOWED_KEYS:
            raise ConfigError(f"pair.against.{key}: {key} is what both sides share; side b may change only the "
                              f"engine: {', '.join(ALLOWED_KEYS)}")
        if key in GROUP_LOADERS:
            check_option(key, str(value), f" in pair.against.{key}")
            with open_dict(side):
                side[key] = OmegaConf.structured(GROUP_LOADERS[key](str(value)))
            continue
        # vLLM's arguments take any key (checked against the engine's fields); elsewhere the schema's only
        free = ".engine_args." in f".{key}"
        try:
            with open_dict(side) if free else contextlib.nullcontext():
                OmegaConf.update(side, key, value, merge=True)
        except OmegaConfBaseException as exc:
            raise ConfigError(f"pair.against.{key}: {str(exc).splitlines()[0]}") from None
    with open_dict(side):
        side.pair.enabled, side.pair.against = False, {}
        # the study's, not side b's own
        side.pair.python, side.pair.starts, side.pair.design, side.pair.start_first = None, None, "auto", "a"
    return side


def check_side_python(python: Optional[str]) -> None:
    """pair.python must be a Python whose environment holds the worker's code and Ray at the
    driver's release (Ray refuses workers of another); a one-line ConfigError otherwise. It
    asks that Python without importing anything heavy (find_spec and package metadata)."""
    if python is None:
        return
    path = Path(python)
    if not path.is_file() or not os.access(path, os.X_OK):
        raise ConfigError(f"pair.python={python}: no executable there (side b's Python: the interpreter of an "
                          "environment holding another vLLM or torch release)")
    probe = ("import importlib.util as u, importlib.metadata as m, json; "
             f"mods={list(SIDE_MODULES)!r}; "
             "print(json.dumps({'missing': [n for n in mods if u.find_spec(n) is None], "
             "'ray': m.version('ray') if u.find_spec('ray') else None}))")
    try:
        # from the root folder: the current one (a checkout) would lend it hostsweep
        out = subprocess.run([str(path), "-c", probe], capture_output=True, text=True, timeout=60, check=True,
                             cwd=Path(path.anchor)).stdout
        found = json.loads(out.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        raise ConfigError(f"pair.python={python}: it did not answer what it holds ({type(exc).__name__})") from None
    if found["missing"]:
        raise ConfigError(f"pair.python={python}: its environment lacks {', '.join(found['missing'])} "
                          f"(side b's workers need {', '.join(SIDE_MODULES)})")
    from importlib.metadata import version

    if found["ray"] != version("ray"):
        raise ConfigError(f"pair.python={python}: its Ray is {found['ray']}, the driver's {version('ray')}; "
                          "Ray runs workers of its own release only")


def unpaired_pair_keys(p: Any) -> None:
    """A study that is not paired takes no side-b keys: pair.python (or pair.starts, pair.design)
    without pair.enabled=true or pair.against would run an unpaired sweep and say nothing."""
    given = [f"pair.{key}={getattr(p, key)}" for key, unset in (("python", None), ("starts", None), ("design", "auto"),
                                                                        ("start_first", "a"))
             if getattr(p, key) != unset]
    if given:
        raise ConfigError(f"{', '.join(given)} set for a study that is not paired: add pair.enabled=true (an A/A, or "
                          "side b in another Python with pair.python) or +pair.against.KEY=V, or drop "
                          f"{'them' if len(given) > 1 else 'it'}")


def check_pair(cfg: Any) -> None:
    """The pair section of a paired study (pair.enabled or pair.against), before side b is resolved."""
    p = cfg.pair
    if p.design not in PAIR_DESIGNS:
        raise ConfigError(f"pair.design must be one of {', '.join(PAIR_DESIGNS)}, got {p.design!r}")
    if p.start_first not in ("a", "b"):
        raise ConfigError(f"pair.start_first must be a or b (the side whose engine starts first), got {p.start_first!r}")
    if p.starts is not None and p.starts < 2:
        raise ConfigError(f"pair.starts must be >= 2 (engine starts per side: the paired CI has starts - 1 degrees "
                          f"of freedom), got {p.starts}")
    if cfg.measure.replicates != 1:
        raise ConfigError("measure.replicates and pair.starts both set engine starts: a paired study "
                          f"(pair.against) takes pair.starts only, got measure.replicates={cfg.measure.replicates}")
    if cfg.stage != "sweep":
        raise ConfigError(f"pair.against is the sweep's (stage=sweep), not stage={cfg.stage}'s: the sweep of a paired "
                          "study ends with its paired diff")


def engine_groups(study: Any) -> int:
    """How many engines a resolved study starts per replicate: one per (sku, model, mode, tp)."""
    return len(study.skus) * len(study.models) * len(study.modes) * len(study.config.tp)


def check_sides(a: Any, b: Any) -> None:
    """Each engine group of one side needs a partner on the other (they pair in grid order)."""
    if engine_groups(a) != engine_groups(b):
        raise ConfigError(f"pair.against: side a has {engine_groups(a)} engine group(s), side b {engine_groups(b)}; "
                          "each engine group of one side needs a partner on the other (e.g. tp=[1,2] against tp=4 "
                          "does not pair: give side b as many)")


def rounds_refusal(a: Any, b: Any, asked: bool) -> Optional[str]:
    """Why the sides cannot be measured in paired rounds, or None. Both engines live on one
    node: in one worker, or, on CPU nodes, side b's in a partner worker of its own where it
    runs under another Python (pair.python) or at another TP degree (run/sides.py). `asked`:
    pair.design=rounds was given (on a GPU the user then vouches for the memory split)."""
    gpu = any(s.accelerator_type is not None for s in (*a.skus, *b.skus))
    if [s.name for s in a.skus] != [s.name for s in b.skus]:
        return "the sides differ in SKU, so their engines need other nodes"
    if gpu and a.config.pair.python:
        return ("side b runs under another Python (pair.python): on GPUs its engine would need a partner worker "
                "with GPUs of its own, which paired rounds do not place yet")
    if gpu and list(a.config.tp) != list(b.config.tp):
        return "the sides differ in TP, so on GPUs their engines need other GPUs"
    if gpu:
        if not asked:
            return ("on a GPU both engines would share its memory (give each side engine.gpu_memory_utilization "
                    "that fit together, then pair.design=rounds)")
        total = a.config.engine.gpu_memory_utilization + b.config.engine.gpu_memory_utilization
        if total > SHARED_GPU_MEMORY:
            return (f"both engines share each GPU, and their engine.gpu_memory_utilization add up to {total:g} "
                    f"(> {SHARED_GPU_MEMORY}): lower it, for example engine.gpu_memory_utilization=0.45 for both")
    return None


def choose_design(a: Any, b: Any) -> str:
    """The paired design a study is measured in (rounds or starts), from pair.design. auto:
    paired rounds unless the sides cannot share a node (rounds_refusal) or the study asks
    for what only start pairs take (pair.starts, adaptive stopping, linearity); rounds asked for
    where it cannot be is a one-line ConfigError."""
    p, m = a.config.pair, a.config.measure
    why = rounds_refusal(a, b, asked=p.design == "rounds")
    if why is None and p.starts is not None:
        why = (f"pair.starts={p.starts} is the starts design's: paired rounds start each side's engine once and "
               "pair within it (measure.reps rounds); drop pair.starts")
    if why is None and (m.target_ci_pct is not None or m.target_mde_pct is not None):
        why = ("measure.target_ci_pct / target_mde_pct stop a cell by its own CI; paired rounds time both sides "
               "measure.reps rounds each (give measure.reps)")
    if why is None and a.config.linearity.enabled:
        why = "linearity.enabled: the linearity check runs on one engine per worker"
    if p.design == "rounds" and why:
        raise ConfigError(f"pair.design=rounds: {why}; pair.design=starts pairs engine starts instead")
    return p.design if p.design != "auto" else ("starts" if why else "rounds")
