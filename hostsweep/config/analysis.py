"""The config sections of the stages that read the store and judge (pure schema): the TP
model's calibration, selection, fit and comparison; the diff; the noise calibration. config/
schema.py composes them into SweepConfig, beside the sections of the sweep itself."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

# Where the fit stage takes each SKU's roofs and H(N) from (see FitConfig).
ROOF_SOURCES = ("auto", "datasheet", "measured")
HOST_SOURCES = ("auto", "calibration", "cells")
# Which all-reduce T_ar is fitted with (FitConfig.allreduce, AllReduceCalibration.path): the
# engine's own communicator, or the standalone torch.distributed microbenchmark (the TP study's
# method). The names match model/term_checks.ENGINE and STANDALONE.
ALLREDUCE_PATHS = ("engine", "standalone")


@dataclass
class AllReduceCalibration:
    """λ and β of t = λ + bytes/β, from an all-reduce measured on one SKU."""

    latency_us: float = MISSING
    bandwidth_gbps: float = MISSING
    # engine: through the communicator vLLM's TP group uses (calibrate/engine_allreduce.py);
    # standalone: a torch.distributed all_reduce (the TP study's method). A calibration that
    # records no path (a paper's reported values) is standalone.
    path: str = "standalone"
    method: str = ""  # what ran, e.g. the communicator and the path its trace showed, ranks, dtype


@dataclass
class HostCalibration:
    """H(N) = s0 + s1·(N − 1), the single-device framework-overhead line."""

    s0_ms: float = 0.0
    s1_ms: float = 0.0


@dataclass
class RoofsCalibration:
    """Achieved roofs from the roofs microbenchmark (the alternative to datasheet roofs)."""

    measured_tflops: float = MISSING
    measured_bandwidth_gbps: float = MISSING
    dtype: Optional[str] = None  # the GEMM's and copy's dtype (null: not recorded)
    matmul: str = ""  # the matmul path the GEMM took, where known (e.g. oneDNN on the CPU build)


@dataclass
class CalibrationConfig:
    """The measured (or reported) terms the TP model holds fixed; conf/calibration/*.yaml
    or a file written by `hostsweep-model allreduce|roofs|host --out`."""

    allreduce: dict[str, AllReduceCalibration] = field(default_factory=dict)  # by SKU
    host: HostCalibration = field(default_factory=HostCalibration)
    roofs: dict[str, RoofsCalibration] = field(default_factory=dict)  # by SKU
    # The paper's method recorded beside the engine path's: standalone all-reduce fits by SKU
    allreduce_standalone: dict[str, AllReduceCalibration] = field(default_factory=dict)
    # One roof per (SKU, dtype) for a study whose cells mix dtypes, keyed "<sku>/<dtype>"
    roofs_by_dtype: dict[str, RoofsCalibration] = field(default_factory=dict)


@dataclass
class SelectConfig:
    """Which measured cells the fit and compare stages read back from MLflow."""

    experiment: Optional[str] = None  # null: the study's experiment (tracking.experiment or hostsweep-<study>)
    parent_run: Optional[str] = None  # only the cells of this sweep (its parent run id)
    filter: Optional[str] = None  # an MLflow search filter, e.g. "params.model = 'tiny-llama'"


@dataclass
class FitConfig:
    """The TP model fit (hostsweep.model.study_fit.FitOptions) and where its fixed terms
    come from. Defaults follow the TP study [2] (README.md#references): train on the lowest TP
    degree of one SKU, H pinned."""

    train_sku: Optional[str] = None  # null: the only SKU selected
    train_tp: Any = None  # int or list; null: the lowest TP degree of train_sku
    mode: str = "eager"  # the mode whose cells are fitted and judged (the TP study: eager)
    form: str = "fixed_microbench"  # the host form of the logged model (hostsweep.model.hostforms.FORMS)
    g_mode: str = "pinned"  # pinned: one g with H = S(N) (as the TP study); joint: g refitted per form
    bound: str = "microbench"  # falsification bound H: microbench S(N), or conservative (lowest k-invariant fit)
    margin: float = 1.0  # MAPE points a verdict's CI must clear
    utilization: float = 0.9  # memory fraction of the a-priori in-regime rule
    resamples: int = 2000  # paired-bootstrap resamples per held-out group
    seed: int = 0
    # Roofs of T_cmp per SKU: datasheet (conf/sku), measured (calibration roofs), or auto:
    # datasheet where the SKU has them, measured otherwise (the CPU).
    roofs: str = "auto"
    # T_ar: engine (the all-reduce through vLLM's own communicator for the SKU and TP degree) or
    # standalone (a torch.distributed all-reduce, the TP study's method); both are recorded
    allreduce: str = "engine"
    # H(N): calibration (its host section), cells (fitted to host_ms of the train SKU's
    # TP-1 split cells), or auto: the calibration's when it has one (non-zero), else the cells'.
    host: str = "auto"
    host_model: Optional[str] = None  # cells: only this model's TP-1 cells (null: every model's)
    # Measure the terms the calibration lacks (all-reduce of a SKU with TP>1 cells, measured
    # roofs) on the SKU (here, or as a Ray task with ray.address), logged to experiment
    # "calibration". false: a missing term is an error.
    calibrate: bool = True
    calibration_file: Optional[str] = None  # a YAML from `hostsweep-model allreduce|roofs|host --out`, over `calibration`
    models_experiment: str = "models"  # where the fitted model is logged
    # Leave the cells the sweep flagged unstable (tag stable=false) out of the fit, H(N) and
    # the comparison, and say how many and why; cells without the tag count as stable.
    exclude_unstable: bool = True
    # SD (%) of the step between engine starts on the measuring machine: the held-out groups
    # were measured in other starts than the training ones, so a verdict's interval must hold
    # it (model/verdict.StartShift). conf/config.yaml takes diff.noise_floor_pct, the same fact.
    start_floor_pct: Any = None  # auto (the newest noise calibration's), null or a percentage
    # What an auto start_floor_pct is with no noise calibration of the cells' machine: a preset's
    # own measured floor (generalize-cpu), null: none
    start_floor_fallback_pct: Optional[float] = None


@dataclass
class NoiseConfig:
    """The noise calibration (hostsweep/stages/noise.py): this machine's floors measured."""

    aas: int = 3  # paired A/As by rounds, each with fresh engine instances: the instance floor
    starts: int = 3  # engine starts per side of one A/A by start pairs: the between-start floor; 0: none
    confidence: float = 0.8  # of the floors' one-sided upper bounds
    experiment: str = "noise"  # where calibrations are logged, and looked up


@dataclass
class CompareConfig:
    """The comparison report (hostsweep/stages/compare.py)."""

    fit_run: Optional[str] = None  # report on this logged fit (its fit.json) instead of fitting now
    ui_port: int = 5000  # the port in the printed UI link


@dataclass
class DiffConfig:
    """Two studies (or sweeps) cell by cell: ratio head/base with CIs, tested verdicts and a
    release gate (hostsweep/stages/diff.py, docs/diff.md)."""

    base: Optional[str] = None  # a study name, or a sweep's parent run id
    head: Optional[str] = None  # the same, for the side judged against base
    threshold_pct: float = 5.0  # `same` needs the ratio's CI inside ±this; slower/faster need the ratio beyond it
    # What slower/faster mean (compare/rules.py): significant = the change is real (Holm against
    # no change at alpha) and its ratio beyond the threshold; margin = sure it is beyond the threshold
    rule: str = "significant"
    # slower: exit 1 when a cell's step_ms is slower; slower_overall: when the geometric mean is;
    # inconclusive: or inconclusive
    fail_on: Optional[str] = None
    # The gate refuses (exit 2) when a gated cell's MDE under the rule exceeds this x threshold_pct
    max_mde_factor: Optional[float] = 3.0
    quantities: list[str] = field(default_factory=lambda: ["step_ms", "device_ms", "host_ms"])
    filter: Optional[str] = None  # an MLflow search filter applied to both sides
    ci_level: float = 0.95
    alpha: float = 0.05  # the gate's family-wise error over the cells it judges (Holm)
    # The step's spread (SD, %) between engine starts, widening one-start sides; and the ratio's
    # SD (%) between two engine instances, widening paired-rounds CIs. auto: the newest noise
    # calibration (stage=noise) of the machine and engine the cells ran on, else the defaults
    # (none; 1.5); a number or null is used as given (compare/floors.py, docs/diff.md)
    noise_floor_pct: Any = "auto"
    instance_floor_pct: Any = "auto"
    floor_bound: str = "upper"  # which of a calibration's numbers an auto floor takes: upper (its bound) or point
    # canary: each step ratio also shown divided by the sides' speed-canary ratio, beside the
    # raw one, which keeps the verdicts (compare/canary.py); null: raw ratios only
    normalize: Optional[str] = None
    experiment: Optional[str] = None  # where the diff run is logged; null: the head's experiment
    ui_port: int = 5000
