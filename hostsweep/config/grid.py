"""The grid: cells and engine specs expanded from a resolved Study (pure).

A cell is one (sku, model, mode, tp, batch, ctx) point measured with one protocol.
Cells that share (sku, model, mode, tp) share one engine, so one worker serves them.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from itertools import product

from hostsweep.config.resolve import Study
from hostsweep.config.schema import ModelConfig, SkuConfig


@dataclass(frozen=True)
class EngineSpec:
    """Everything an engine needs to start; one worker actor per distinct spec."""

    sku: str
    accelerator_type: str | None
    model: str
    model_source: str
    model_path: str | None
    load_format: str
    shape_json: str | None  # the model's shape as canonical JSON (hashable)
    mode: str
    enforce_eager: bool
    quantization: str | None
    tp: int
    dtype: str
    max_model_len: int
    max_num_seqs: int
    engine: str
    profile: bool  # started with the torch profiler configured (for the split)
    cpu_kvcache_gib: int
    gpu_memory_utilization: float
    tp_executor: str  # "mp" or "ray": how TP>1 ranks run on GPUs (placement.py)

    @property
    def label(self) -> str:
        return f"{self.sku}/{self.model}/{self.mode}/tp{self.tp}"


@dataclass(frozen=True)
class Cell:
    engine: EngineSpec
    batch: int
    ctx: int
    T: int
    warmups: int
    reps: int
    seed: int

    @property
    def key(self) -> str:
        """Stable identity: equal for the same measurement, whatever run asks for it."""
        e = self.engine
        fields = [e.sku, e.model, e.shape_json, e.model_path, e.mode, e.quantization, e.tp,
                  e.dtype, e.engine, self.batch, self.ctx, self.T, self.warmups, self.reps]
        if e.tp_executor != "mp":  # appended only off the default, so earlier keys still match
            fields.append(e.tp_executor)
        identity = json.dumps(fields, sort_keys=True)
        digest = hashlib.sha1(identity.encode()).hexdigest()[:10]
        return f"{e.label}/b{self.batch}/ctx{self.ctx}/T{self.T}/{digest}"

    def params(self) -> dict[str, object]:
        """The parameters users filter by, as logged to MLflow and the cell table."""
        e = self.engine
        return {
            "sku": e.sku, "model": e.model, "mode": e.mode, "tp": e.tp,
            "batch": self.batch, "ctx": self.ctx, "T": self.T,
            "reps": self.reps, "warmups": self.warmups, "dtype": e.dtype, "engine": e.engine,
            "tp_executor": e.tp_executor,
        }


def engine_spec(study: Study, sku: SkuConfig, tp: int, model: ModelConfig | None = None) -> EngineSpec:
    """The engine serving (sku, model, tp), sized to the largest cell it serves: longest
    context plus T, widest batch."""
    cfg = study.config
    model = model if model is not None else study.models[0]
    shape = model.shape
    return EngineSpec(
        sku=sku.name,
        accelerator_type=sku.accelerator_type,
        model=model.name,
        model_source=model.source,
        model_path=model.path,
        load_format=model.load_format,
        shape_json=json.dumps(asdict(shape), sort_keys=True) if shape is not None else None,
        mode=cfg.mode.name,
        enforce_eager=cfg.mode.enforce_eager,
        quantization=cfg.mode.quantization,
        tp=tp,
        dtype=cfg.engine.dtype,
        max_model_len=max(cfg.ctx) + study.longest_generate()[0],
        max_num_seqs=max(cfg.batch),
        engine=cfg.engine.name,
        profile=cfg.split.enabled,
        cpu_kvcache_gib=cfg.engine.cpu_kvcache_gib,
        gpu_memory_utilization=cfg.engine.gpu_memory_utilization,
        tp_executor=cfg.engine.tp_executor,
    )


def build_cells(study: Study) -> list[Cell]:
    """Every cell of the study, grouped by engine spec (SKU-major, then model, TP, batch, ctx)."""
    cfg, m = study.config, study.config.measure
    cells = []
    for sku, model, tp in product(study.skus, study.models, cfg.tp):
        spec = engine_spec(study, sku, tp, model)
        for batch, ctx in product(cfg.batch, cfg.ctx):
            cells.append(Cell(spec, batch, ctx, m.T, m.warmups, m.reps, m.seed))
    return cells


def group_by_engine(cells: list[Cell]) -> dict[EngineSpec, list[Cell]]:
    """Cells per engine spec, in grid order: each group runs on one worker."""
    groups: dict[EngineSpec, list[Cell]] = {}
    for cell in cells:
        groups.setdefault(cell.engine, []).append(cell)
    return groups
