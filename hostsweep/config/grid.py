"""The grid: cells and engine specs expanded from a resolved Study (pure).

A cell is one point of the grid's axes (CELL_AXES: sku, model, mode, tp, batch, ctx,
workload) measured with one protocol. Cells that share the engine axes (sku, model, mode,
tp) share one engine, so one worker serves them. A cell whose SKU cannot run its mode (in a multi-mode study) carries the reason in
`skip` and is recorded, never dispatched.
"""
from __future__ import annotations

import hashlib
import logging
import json
from dataclasses import asdict, dataclass, replace
from functools import cached_property
from itertools import product
from typing import Any, Mapping, Optional

from hostsweep.config.engine_args import (
    LEGACY_EAGER_ARGS, canonical_json, keyed_engine_args, resolved_engine_args, unsupported_reason,
)
from hostsweep.config.pairing import against_text, balanced_rounds
from hostsweep.config.resolve import Study
from hostsweep.config.schema import ConfigError, ModeConfig, ModelConfig, SkuConfig

log = logging.getLogger(__name__)
# The cell's identity, defined here once: every table, report, read-back and selection
# names a cell by these (a new axis is added here, as a field of EngineSpec or Cell of the
# same name, and in build_cells). Engine axes: one engine serves every cell that shares
# them. Load axes: what one engine is asked for, cell by cell.
ENGINE_AXES = ("sku", "model", "mode", "tp")
LOAD_AXES = ("batch", "ctx", "workload")
CELL_AXES = (*ENGINE_AXES, *LOAD_AXES)
# Logged with every cell beside its axes (MLflow params, cells.csv columns, in this
# order): the protocol (summary.json's params too) and how the engine runs. A measurement
# is the same only if these are too.
PROTOCOL_PARAMS = ("T", "reps", "warmups", "dtype", "engine")
ENGINE_PARAMS = ("tp_executor", "engine_args")
CELL_PARAMS = (*CELL_AXES, *PROTOCOL_PARAMS, *ENGINE_PARAMS)
# Logged only off their default (adaptive repetitions, several engine starts): a cell
# without them was measured with the default.
OPTIONAL_PARAMS = ("target_ci_pct", "target_mde_pct", "min_reps", "max_reps", "replicates", "side", "pair_against",
                   "pair_design")
INT_PARAMS = ("tp", "batch", "ctx", "T", "reps", "warmups")
# What a run logged before an axis existed stands for (cells read back from older sweeps).
LEGACY_AXIS_VALUES = {"mode": "eager", "workload": "random"}


@dataclass(frozen=True)
class EngineSpec:
    """What an engine is given, as data: the vllm.LLM arguments (all but `model` and
    `profiler_config`, which the worker adds) and what the harness itself needs to place,
    start and label it. One worker actor per distinct spec."""

    sku: str
    accelerator_type: str | None
    model: str
    model_source: str
    model_path: str | None
    shape_json: str | None  # the model's shape as canonical JSON (hashable)
    mode: str
    tp: int
    engine: str
    profile: bool  # started with the torch profiler configured (for the split)
    cpu_kvcache_gib: int
    tp_executor: str  # "mp" or "ray": how TP>1 ranks run on GPUs (placement.py)
    engine_args_json: str  # vllm.LLM(**engine_args) as canonical JSON (config.engine_args)
    random_weights: bool = False  # the worker writes random weights for the shape (engines/weights.py)
    debug_delay: str = ""  # "<phase>:<ms>": the test-only delay hook (config debug.), "" = none
    phases: bool = True  # phase scopes in the profiled pairs (split.phases; engines/vllm_plugin.py)
    # A paired study's side ("a" or "b", "" unpaired: config/pairing.py), and the Python its
    # workers run under ("" the driver's; pair.python for side b, through Ray's runtime_env).
    side: str = ""
    python: str = ""
    # The CPU build's LD_PRELOAD (engine.preload), as file names joined by ':' ("" = vLLM's own).
    preload: str = ""

    @property
    def label(self) -> str:
        return f"{self.sku}/{self.model}/{self.mode}/tp{self.tp}" + (f"/{self.side}" if self.side else "")

    @property
    def engine_args(self) -> dict[str, Any]:
        return json.loads(self.engine_args_json)

    @property
    def keyed_args(self) -> dict[str, Any]:
        """The engine arguments the user chose (mode and engine.engine_args)."""
        return keyed_engine_args(self.engine_args)

    @property
    def dtype(self) -> str:
        return str(self.engine_args["dtype"])

    @property
    def quantization(self) -> Optional[str]:
        return self.engine_args.get("quantization")


@dataclass(frozen=True)
class Cell:
    engine: EngineSpec
    batch: int
    ctx: int
    T: int
    warmups: int
    reps: int
    seed: int
    workload: str = "random"
    skip: Optional[str] = None  # why the SKU cannot run this mode; never part of the key
    # Adaptive repetitions: stop once the CI half-width is <= this % of the median, after
    # min_reps pairs; `reps` is then the most it may take (measure.max_reps).
    target_ci_pct: Optional[float] = None
    min_reps: int = 0
    # Or: stop once the cell can detect a slowdown of this % (measure.target_mde_pct; the
    # worker turns it into a CI target: measure/detectable.ci_target_for_mde).
    target_mde_pct: Optional[float] = None
    # Independent engine starts the cell is measured in (measure.replicates); its CI then
    # comes from a two-level bootstrap over them (measure/replicates.py).
    replicates: int = 1
    # A paired study's overrides of side b (pair.against as one string; the engine says the side).
    pair_against: str = ""
    # How its pair is measured: "rounds" (both sides back to back in every round) or "starts".
    pair_design: str = ""

    @cached_property  # asked many times a cell (plan, dispatch, worker); in __dict__, not a field
    def key(self) -> str:
        """Stable identity: equal for the same measurement, whatever run asks for it.

        The fields keys always held, then, each only when off its earlier default (so keys
        logged before it existed still match): the TP executor, the user's engine arguments
        (mode and engine.engine_args, canonical JSON), the workload, random weights and the
        adaptive-repetition rule. The sixth field was the mode's quantization; it is now
        inside the engine arguments and stays null."""
        e = self.engine
        fields: list[Any] = [e.sku, e.model, e.shape_json, e.model_path, e.mode, None, e.tp,
                             e.dtype, e.engine, self.batch, self.ctx, self.T, self.warmups, self.reps]
        if e.tp_executor != "mp":
            fields.append(e.tp_executor)
        if e.keyed_args != LEGACY_EAGER_ARGS:
            fields.append({"engine_args": e.keyed_args})
        if self.workload != "random":
            fields.append({"workload": self.workload})
        if e.random_weights:
            fields.append({"weights": "random"})
        if self.target_ci_pct is not None:
            fields.append({"target_ci_pct": self.target_ci_pct, "min_reps": self.min_reps})
        if self.target_mde_pct is not None:
            fields.append({"target_mde_pct": self.target_mde_pct, "min_reps": self.min_reps})
        if self.replicates != 1:
            fields.append({"replicates": self.replicates})
        if e.debug_delay:
            fields.append({"debug_delay": e.debug_delay})
        if e.preload:  # an allocator and OpenMP runtime are part of the host being measured
            fields.append({"preload": e.preload})
        if e.side:
            pair = {"side": e.side, "against": self.pair_against, "python": e.python}
            # paired rounds are another measurement than start pairs (start-pair keys stay as they were)
            fields.append({"pair": {**pair, "design": "rounds"} if self.pair_design == "rounds" else pair})
        identity = json.dumps(fields, sort_keys=True)
        digest = hashlib.sha1(identity.encode()).hexdigest()[:10]
        return f"{e.label}/b{self.batch}/ctx{self.ctx}/T{self.T}/{digest}"

    def params(self) -> dict[str, object]:
        """The parameters users filter by, as logged to MLflow and the cell table."""
        adaptive = {} if not self.adaptive else \
            {**({"target_ci_pct": self.target_ci_pct} if self.target_ci_pct is not None else
                {"target_mde_pct": self.target_mde_pct}), "min_reps": self.min_reps, "max_reps": self.reps}
        return {**{name: self.param(name) for name in CELL_PARAMS}, **adaptive,
                **({"replicates": self.replicates} if self.replicates != 1 else {}),
                **({"side": self.engine.side, "pair_against": self.pair_against, "pair_design": self.pair_design}
                   if self.engine.side else {})}

    @property
    def adaptive(self) -> bool:
        """Whether the cell stops by a target (a CI width or a detectable effect) within
        min_reps..reps pairs, rather than running exactly `reps`."""
        return self.target_ci_pct is not None or self.target_mde_pct is not None

    def param(self, name: str) -> Any:
        """One of CELL_PARAMS: the engine's value where the engine has one, else the cell's."""
        if name == "engine_args":  # the user's arguments, not every resolved one
            return canonical_json(self.engine.keyed_args)
        return getattr(self.engine, name) if hasattr(self.engine, name) else getattr(self, name)


def engine_spec(study: Study, sku: SkuConfig, tp: int, mode: Optional[ModeConfig] = None,
                model: Optional[ModelConfig] = None) -> EngineSpec:
    """The engine serving (sku, model, mode, tp), sized to the largest cell it serves:
    longest context plus T, widest batch."""
    cfg = study.config
    mode = mode if mode is not None else study.modes[0]
    model = model if model is not None else study.models[0]
    shape = model.shape
    args = resolved_engine_args(cfg, sku, mode, tp, study.longest_generate()[0], model)
    return EngineSpec(
        sku=sku.name,
        accelerator_type=sku.accelerator_type,
        model=model.name,
        model_source=model.source,
        model_path=model.path,
        shape_json=json.dumps(asdict(shape), sort_keys=True) if shape is not None else None,
        mode=mode.name,
        tp=tp,
        engine=cfg.engine.name,
        profile=cfg.split.enabled,
        cpu_kvcache_gib=cfg.engine.cpu_kvcache_gib,
        tp_executor=cfg.engine.tp_executor,
        engine_args_json=canonical_json(args),
        random_weights=model.load_format == "random",
        debug_delay=f"{cfg.debug.delay_phase}:{cfg.debug.delay_ms:g}" if cfg.debug.delay_ms > 0 else "",
        phases=cfg.split.enabled and cfg.split.phases,
        preload=":".join(study.preload) if sku.accelerator_type is None and cfg.engine.name == "vllm" else "",
    )


def engine_label(params: Mapping[str, object]) -> str:
    """The engine a cell ran on (its ENGINE_AXES), as the console, the design line and the
    summary name it: 'cpu/tiny-llama/eager/tp1'."""
    return f"{params.get('sku')}/{params.get('model')}/{params.get('mode')}/tp{params.get('tp')}"


def build_cells(study: Study) -> list[Cell]:
    """Every cell of the study, grouped by engine spec (SKU-major, then model, mode, TP,
    batch, ctx, workload). Cells of a mode their SKU cannot run carry the reason in `skip`.
    A paired study (pair.enabled or pair.against): side a's cells, then side b's (in paired rounds
    one engine start each, else pair.starts); the i-th engine group of one side is the partner
    of the other's i-th."""
    if study.side_b is None:
        return _side_cells(study)
    p = study.config.pair
    text = against_text(p.against)
    m = study.config.measure
    asked = m.max_reps if m.target_ci_pct is not None or m.target_mde_pct is not None else m.reps
    if p.design == "rounds" and balanced_rounds(asked) != asked:
        log.warning("pair.design=rounds: %d rounds rounded up to %d, a multiple of 4, so every cell meets each "
                    "(side order, T order) combination equally often", asked, balanced_rounds(asked))
    a = _side_cells(study, "a", "", text, p.starts, p.design)
    b = _side_cells(study.side_b, "b", p.python or "", text, p.starts, p.design)
    for cell_a, cell_b in zip(a, b):
        if (cell_a.skip is None) != (cell_b.skip is None):
            raise ConfigError(f"pair.against: side {'b' if cell_b.skip else 'a'} cannot run "
                              f"{(cell_b if cell_b.skip else cell_a).engine.label}: {cell_b.skip or cell_a.skip}")
    return a + b


def _side_cells(study: Study, side: str = "", python: str = "", pair_against: str = "",
                starts: Optional[int] = None, design: str = "") -> list[Cell]:
    cfg, m = study.config, study.config.measure
    adaptive = m.target_ci_pct is not None or m.target_mde_pct is not None
    reps = m.max_reps if adaptive else m.reps
    if design == "rounds":  # every (side order, T order) combination equally often (pairing.ROUND_CYCLE)
        reps = balanced_rounds(reps)
    rule = (None if m.target_ci_pct is None else float(m.target_ci_pct), m.min_reps) if adaptive else (None, 0)
    mde = None if m.target_mde_pct is None else float(m.target_mde_pct)
    cells = []
    for sku, model, mode, tp in product(study.skus, study.models, study.modes, cfg.tp):
        spec = engine_spec(study, sku, tp, mode, model)
        if side:
            spec = replace(spec, side=side, python=python)
        skip = unsupported_reason(mode, sku, spec.keyed_args)
        for batch, ctx, workload in product(cfg.batch, cfg.ctx, cfg.workload):
            cells.append(Cell(spec, batch, ctx, m.T, m.warmups, reps, m.seed, workload, skip, *rule,
                              target_mde_pct=mde, replicates=starts or m.replicates, pair_against=pair_against,
                              pair_design=design))
    return cells


def runnable(cells: list[Cell]) -> list[Cell]:
    """The cells to dispatch: all but the SKIPPED ones."""
    return [cell for cell in cells if cell.skip is None]


def group_by_engine(cells: list[Cell]) -> dict[EngineSpec, list[Cell]]:
    """Cells per engine spec, in grid order: each group runs on one worker."""
    groups: dict[EngineSpec, list[Cell]] = {}
    for cell in cells:
        groups.setdefault(cell.engine, []).append(cell)
    return groups


def partner_specs(cells: list[Cell]) -> dict[EngineSpec, EngineSpec]:
    """A paired study's engine groups, each mapped to its partner on the other side (the
    i-th group of side a with the i-th of side b, both ways); {} when unpaired."""
    groups = list(group_by_engine(cells))
    a = [spec for spec in groups if spec.side == "a"]
    b = [spec for spec in groups if spec.side == "b"]
    if len(a) != len(b):
        raise ValueError(f"a paired study needs as many engine groups on each side, got {len(a)} and {len(b)}")
    return {**dict(zip(a, b)), **dict(zip(b, a))}


def partner_keys(cells: list[Cell]) -> dict[str, str]:
    """Each paired cell's key mapped to its partner's: the cell of the partner group at the
    same load axes (batch, ctx, workload); {} when unpaired."""
    specs = partner_specs(cells)
    by_slot = {(c.engine, c.batch, c.ctx, c.workload): c.key for c in cells}
    return {c.key: by_slot[(specs[c.engine], c.batch, c.ctx, c.workload)] for c in cells
            if c.engine in specs and (specs[c.engine], c.batch, c.ctx, c.workload) in by_slot}


def rounds_partners(cells: list[Cell]) -> dict[EngineSpec, EngineSpec]:
    """A study's engine groups paired by rounds (pair.design=rounds), side a's spec mapped to
    its partner's: the partner's engine starts in side a's worker, which times both."""
    rounds = {c.engine for c in cells if c.pair_design == "rounds"}
    return {a: b for a, b in partner_specs(cells).items() if a.side == "a" and a in rounds}
