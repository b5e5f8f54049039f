"""What a worker returns for a cell, and what is recorded of it: the result types, the
metrics and tags its MLflow run gets, and its flat row in the cell table (pure).

Every recorder (MLflow, cells.csv, the printed table) derives from these functions, so a
metric has one name and one definition.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Collection, Optional, Sequence

import numpy as np
import pandas as pd

from hostsweep.config.schema import LinearityConfig, MeasureConfig, SplitConfig, SweepConfig
from hostsweep.measure.detectable import cell_mde_pct
from hostsweep.measure.phases import phase_metrics
from hostsweep.measure.protocol import CellMeasurement
from hostsweep.measure.periods import DesignRecord
from hostsweep.measure.speculative import SpecResult, spec_metrics
from hostsweep.measure.split import LinearityResult, SplitResult
from hostsweep.measure.stability import Stability, StabilityRules, between_replicate_spread_pct
from hostsweep.measure.threadstates import idle_fraction

# A cell's status: measured, failed while measuring, or never dispatched because its SKU
# cannot run its mode (recorded as an MLflow run with status KILLED and tag skipped=true).
STATUSES = ("FINISHED", "FAILED", "SKIPPED")


@dataclass(frozen=True)
class MeasureOptions:
    """How a worker analyses a cell beyond its timed reps: the study's measure, split and
    linearity sections, exactly as configured (no field is copied by hand)."""

    measure: MeasureConfig = field(default_factory=MeasureConfig)
    split: SplitConfig = field(default_factory=SplitConfig)
    linearity: LinearityConfig = field(default_factory=LinearityConfig)
    # Where workers keep each cell's timed pairs until it is reported (run/rounds.py), so a
    # rerun continues a killed sweep's cells; the sweep sets it, None keeps none.
    rounds_dir: Optional[str] = None

    @classmethod
    def of(cls, cfg: SweepConfig) -> "MeasureOptions":
        return cls(cfg.measure, cfg.split, cfg.linearity)

    @property
    def linearity_T(self) -> tuple[int, ...]:
        """The decade of T the linearity check sweeps; empty when it is off."""
        return tuple(sorted(set(self.linearity.T))) if self.linearity.enabled else ()

    @property
    def pyspy_seconds(self) -> float:
        return self.split.pyspy_seconds if self.split.pyspy else 0.0


def stability_rules_of(options: MeasureOptions) -> StabilityRules:
    """The stability thresholds and test level of these options (measure.*)."""
    return StabilityRules.of(options.measure)


@dataclass(frozen=True)
class CellResult:
    key: str
    params: dict[str, object]
    status: str  # one of STATUSES
    measurement: Optional[CellMeasurement]
    error: Optional[str]
    host: dict[str, str] = field(default_factory=dict)
    duration_s: float = 0.0
    split: Optional[SplitResult] = None
    linearity: Optional[LinearityResult] = None
    traces: dict[str, bytes] = field(default_factory=dict)  # file name -> gzipped trace
    thread_states: Optional[pd.DataFrame] = None  # py-spy view of the engine process tree
    spec: Optional[SpecResult] = None  # acceptance and cycles of a speculative engine
    attempt: int = 1  # 1 + the times this cell was lost (worker or engine died, timed out) and retried
    retry_reasons: tuple[str, ...] = ()  # why each earlier attempt was lost
    # Wall-clock (epoch seconds) of the measurement on the worker: the cell run's start and
    # end in MLflow, so its Duration is the measurement's, not the logging's. 0: unknown.
    started_at: float = 0.0
    ended_at: float = 0.0
    log_tail: str = ""  # the end of the worker's log, shipped with a FAILED cell (remote nodes)
    stability: Optional[Stability] = None  # the stability verdict (measure/stability.py)
    earlier_timings: tuple = ()  # per earlier attempt, the timed pairs a re-measure replaced


def skipped_result(key: str, params: dict[str, object], reason: str) -> CellResult:
    """The record of a cell whose SKU cannot run its mode: no measurement, the reason."""
    return CellResult(key=key, params=params, status="SKIPPED", measurement=None, error=reason)


# Percentiles of the per-rep step times a cell reports beside its median (vLLM's latency
# benchmark reports 10/25/50/75/90/99 of its iterations; 99 means nothing with 12 reps).
STEP_PERCENTILES = (10, 25, 75, 90)
# Decimals a metric is kept to: times to the microsecond (what a wall-clock difference over
# T-1 steps resolves), host_frac to 1e-3 (as printed), other ratios to 1e-4, R² to 1e-6; the
# rest 6 significant digits.
TIME_DECIMALS = 3


@functools.lru_cache(maxsize=1024)
def _decimals(name: str) -> Optional[int]:
    """The decimals a metric keeps, None: 6 significant digits (a few dozen names, each
    looked up once: a resume rounds every metric of 10,000 runs read back)."""
    if name.endswith(("_ms", "_s")):
        return TIME_DECIMALS
    if name.startswith("r2_"):
        return 6
    if name.endswith("_frac") or name.startswith("host_frac_ci_"):  # host_frac's CI as host_frac
        return 3
    if name.endswith(("_overhead", "_rate", "_disagreement")):
        return 4
    return None


def format_ci(low: Optional[float], high: Optional[float], digits: int) -> str:
    """'[0.46, 0.72]': every printed CI (console, table, reports) from the same rounded
    metrics (round_metric), so one cell's interval reads the same wherever it is printed."""
    return f"[{low:.{digits}f}, {high:.{digits}f}]" if low is not None and high is not None else ""


def round_metric(name: str, value: float) -> float:
    """A metric rounded to what the measurement resolves, so tables read at a glance."""
    if not math.isfinite(value):
        return value
    decimals = _decimals(name)
    return float(f"{value:.6g}") if decimals is None else round(value, decimals)


def linear_percentiles(values: Sequence[float], percents: Sequence[float]) -> list[float]:
    """np.percentile(values, percents) with its default (linear) method, to the bit, in
    plain Python: for a cell's few values numpy's call costs more than the rest of the
    cell's metrics (it ran twice per cell in the driver). NaN anywhere gives NaN, as numpy."""
    ordered = sorted(values)
    if any(math.isnan(v) for v in ordered):
        return [math.nan] * len(percents)
    last = len(ordered) - 1
    found = []
    for percent in percents:
        virtual = last * (percent / 100)  # numpy's virtual index for 'linear'
        below = min(max(math.floor(virtual), 0), last)
        a, b = ordered[below], ordered[min(below + 1, last)]
        t = virtual - below
        # numpy's _lerp: from the nearer end, so t near 1 lands on b exactly
        found.append(b - (b - a) * (1 - t) if t >= 0.5 else a + (b - a) * t)
    return found


def step_percentiles(m: CellMeasurement) -> dict[str, float]:
    """step_p10_ms … step_p90_ms over the timed reps (linear interpolation, numpy's default)."""
    steps = [r.step_s * 1e3 for r in m.reps]
    if not steps:
        return {}
    return {f"step_p{q}_ms": v for q, v in zip(STEP_PERCENTILES, linear_percentiles(steps, STEP_PERCENTILES))}


def cell_metrics(result: CellResult) -> dict[str, float]:
    """Every metric of a cell, rounded (round_metric): what MLflow, cells.csv and the
    printed table show."""
    return {name: round_metric(name, value) for name, value in _raw_metrics(result).items()}


def _raw_metrics(result: CellResult) -> dict[str, float]:
    m = result.measurement
    if m is None:
        return {}
    metrics = {
        "step_ms": m.step_ms, "step_ci_low_ms": m.step_ci_low_ms, "step_ci_high_ms": m.step_ci_high_ms,
        **step_percentiles(m),
        "wall_1_ms": m.wall_1_ms, "wall_T_ms": m.wall_T_ms, "cell_duration_s": result.duration_s,
        "timed_s": m.timed_s, "reps_used": float(len(m.reps)), "ci_half_width_pct": m.ci_half_width_pct,
    }
    if not math.isnan(m.ci_coverage):  # what the CI is guaranteed; below measure.ci_level: too few pairs
        metrics["ci_coverage"] = m.ci_coverage
    metrics["mde_pct"] = mde_of(m, result.stability)
    metrics.update(stability_metrics(result.stability))
    if result.split is not None:
        sp = result.split
        metrics.update(device_ms=sp.device_ms, host_ms=sp.host_ms, host_frac=sp.host_frac,
                       overlap_gap_ms=sp.overlap_gap_ms, profiled_step_ms=sp.profiled_step_ms,
                       profiler_overhead=sp.profiler_overhead, kernels_per_step=sp.kernels_per_step,
                       split_s=sp.split_s, split_overhead_s=sp.split_overhead_s)
        if sp.kernel_source == "cuda":
            metrics.update(copy_ms=sp.copy_ms, copy_bytes_per_step=sp.copy_bytes,
                           launches_per_step=sp.launches_per_step)
        metrics.update(split_ci_metrics(sp))
        metrics.update(allreduce_metrics(sp))
        if sp.phases is not None:
            metrics.update(phase_metrics(sp.phases, sp.profiled_step_ms - sp.device_ms))
        if not split_is_possible(result):  # impossible or implausible: no host number to plot, fit or diff
            for name in ("host_ms", "host_ci_low_ms", "host_ci_high_ms", "host_frac", "host_frac_ci_low",
                         "host_frac_ci_high", "attributed_frac"):
                metrics.pop(name, None)
    if result.thread_states is not None and not result.thread_states.empty:
        metrics["pyspy_idle_frac"] = idle_fraction(result.thread_states)
    if result.spec is not None:
        metrics.update(spec_metrics(result.spec, m.step_ms, result.split.host_ms if result.split else None))
    if result.linearity is not None:
        lin = result.linearity
        metrics.update(r2_wall=lin.r2_wall, r2_kernel=lin.r2_kernel,
                       slope_disagreement=lin.slope_disagreement, linearity_slope_fit_ms=lin.slope_fit_ms)
    return metrics


def mde_of(m: CellMeasurement, stability: Optional[Stability]) -> float:
    """The cell's minimum detectable effect in % (measure/detectable.py): the smallest slowdown
    a diff gate at alpha 0.05 finds 80 % of the time against a study of equal noise."""
    return cell_mde_pct(m.step_ms, m.step_ci_low_ms, m.step_ci_high_ms,
                        m.ci_coverage if math.isfinite(m.ci_coverage) else 0.95,
                        len(stability.start_medians_ms) if stability is not None else 1,
                        stability.design.period_medians_ms if stability is not None and stability.design else (),
                        stability.replicate_step_ms if stability is not None else None)


def split_is_possible(result: CellResult) -> bool:
    """Whether the cell's split may be shown as a host_frac and a regime: not flagged
    split_impossible or split_implausible (measure/stability.py)."""
    return result.stability is None or not {"split_impossible", "split_implausible"} & set(result.stability.reasons)


def allreduce_metrics(sp: SplitResult) -> dict[str, float]:
    """The all-reduce in situ of a TP > 1 cell (measure/split.py): rank 0's ms per step with
    its CI over the profiled pairs, the least and most of the ranks' means (a rank that reaches
    the all-reduce first waits for the others inside it), its calls per step. None at TP-1.
    Named apart from the fit's allreduce_ms, the calibrated T_ar (model/study_fit.py)."""
    if len(sp.per_rank_allreduce_ms) < 2:
        return {}
    metrics = {"allreduce_insitu_ms": sp.allreduce_insitu_ms,
               "allreduce_insitu_rank_min_ms": min(sp.per_rank_allreduce_ms),
               "allreduce_insitu_rank_max_ms": max(sp.per_rank_allreduce_ms),
               "allreduces_per_step": sp.allreduces_per_step}
    if sp.allreduce_insitu_ci is not None:
        metrics["allreduce_insitu_ci_low_ms"], metrics["allreduce_insitu_ci_high_ms"] = sp.allreduce_insitu_ci
    return metrics


def split_ci_metrics(sp: SplitResult) -> dict[str, float]:
    """The split's CIs over its profiled pairs (absent below 3 pairs), its pair count and the
    physical floor of its device time (measure/split_stats.py)."""
    metrics = {"split_pairs": float(sp.pairs), "device_floor_ms": sp.device_floor_ms}
    for name, ci in (("device", sp.device_ci), ("host", sp.host_ci), ("profiled_step", sp.profiled_step_ci)):
        if ci is not None:
            metrics[f"{name}_ci_low_ms"], metrics[f"{name}_ci_high_ms"] = ci
    if sp.host_frac_ci is not None:
        metrics["host_frac_ci_low"], metrics["host_frac_ci_high"] = sp.host_frac_ci
    return metrics


def stability_metrics(stability: Optional[Stability]) -> dict[str, float]:
    """A cell's contention record and re-measure count (measure/stability.py)."""
    if stability is None:
        return {}
    metrics = {"stability_attempts": float(stability.attempts)}
    c = stability.contention
    if c is not None:
        metrics.update(foreign_cpu_frac=c.foreign_cpu_frac, foreign_cpu_frac_max=c.foreign_cpu_frac_max,
                       engine_cpu_frac=c.engine_cpu_frac, steal_frac=c.steal_frac, load1_max=c.load1_max)
    if stability.replicate_step_ms is not None:
        metrics["replicate_step_ms"] = stability.replicate_step_ms
    if len(stability.start_medians_ms) > 1:
        metrics["replicates"] = float(len(stability.start_medians_ms))
        metrics["replicate_spread_pct"] = between_replicate_spread_pct([[m] for m in stability.start_medians_ms])
    metrics.update(design_metrics(stability.design))
    return metrics


def design_metrics(design: Optional[DesignRecord]) -> dict[str, float]:
    """What the group's design says of the cell (measure/periods.py): its periods and how far
    they spread, the pairs its estimate rests on, the rounds left out, the speed canary."""
    if design is None:
        return {}
    metrics = {"periods": float(design.periods), "clean_pairs": float(design.clean_pairs),
               "contended_rounds": float(design.contended_rounds)}
    if len(design.period_medians_ms) > 1:
        metrics["period_spread_pct"] = between_replicate_spread_pct([[m] for m in design.period_medians_ms])
    if design.canary_ms is not None:
        metrics["canary_ms"] = design.canary_ms
    if design.canary_shift_pct is not None:
        metrics["canary_shift_pct"] = design.canary_shift_pct
    if design.common_shift_pct is not None:
        metrics["common_shift_pct"] = design.common_shift_pct
    if design.gpu_canary_ms is not None:
        metrics["gpu_canary_ms"] = design.gpu_canary_ms
    if design.warmup_rounds:
        metrics["warmup_rounds"] = float(design.warmup_rounds)
    if design.canary_r is not None and design.canary_explains_pct is not None:
        metrics["canary_r"], metrics["canary_explains_pct"] = design.canary_r, design.canary_explains_pct
    return metrics


# A cell's stability verdict as tags and cell-table columns: "true"/"false", the rules of its
# own number it broke, comma-separated (empty when stable), and what its whole group met
# (group_annotations: machine_speed, group_trend, replicate; no cell's flag), and why each
# period after the first was taken (remeasured_for: 'ci_width;drift', a period each). Absent
# on cells logged before the verdict; the last two absent on cells logged before them.
STABILITY_TAGS = ("stable", "unstable_reasons", "group_annotations", "remeasured_for")


def stability_tags(result: CellResult) -> dict[str, str]:
    if result.stability is None or result.measurement is None:
        return {}
    s = result.stability
    return {"stable": str(s.stable).lower(), "unstable_reasons": ",".join(s.reasons),
            "group_annotations": ",".join(s.annotations),
            "remeasured_for": ";".join(s.design.remeasured_for) if s.design is not None else ""}


SPLIT_TAGS = ("kernel_source", "regime")
# What vLLM made of the engine arguments and which prompts a cell decoded (provenance tags,
# also cell-table columns).
ENGINE_TAGS = ("compilation_mode", "cudagraph_mode", "cudagraph_capture_sizes", "allreduce_backend",
               "ld_preload", "prompt_digest")


def split_tags(result: CellResult) -> dict[str, str]:
    if result.split is None:
        return {}
    if not split_is_possible(result):
        return {"kernel_source": result.split.kernel_source}
    return dict(zip(SPLIT_TAGS, (result.split.kernel_source, result.split.regime)))


# The optional analyses a cell may carry, each proven by a metric only it produces.
PART_METRICS = {"split": "device_ms", "linearity": "r2_wall", "pyspy": "pyspy_idle_frac"}


def requested_parts(options: MeasureOptions) -> set[str]:
    """The optional analyses a sweep with these options asks of every cell."""
    asked = {"split": options.split.enabled, "linearity": bool(options.linearity_T),
             "pyspy": options.pyspy_seconds > 0}
    return {part for part, on in asked.items() if on}


def missing_parts(options: MeasureOptions, metrics: Collection[str]) -> list[str]:
    """What a finished cell lacks of what these options ask for; `metrics`: the names of
    the metrics it logged (or its metrics by name)."""
    return sorted(part for part in requested_parts(options) if PART_METRICS[part] not in metrics)


# Where a cell was measured and with what: worker tags (hostname, device, the engine's
# versions) and the driver's (hostsweep, Ray, git SHA), as cell-table columns named like
# the MLflow tags. `hostname`/`device_name`, never `host`/`device`, which read like host_ms.
PROVENANCE_COLUMNS = ("hostname", "device_name", "hostsweep_version", "vllm_version", "torch_version",
                      "ray_version", "git_sha")


def cell_row(result: CellResult, run_id: str, provenance: Optional[dict[str, str]] = None,
             metrics: Optional[dict[str, float]] = None) -> dict[str, object]:
    """One flat row per cell: params, the metrics and tags its MLflow run gets, provenance,
    and its run id. Metrics a cell does not have are absent (empty in the CSV).
    `provenance`: the driver's tags (versions, git SHA), for columns the worker lacks;
    `metrics`: cell_metrics(result), when the caller has them already."""
    tags = {**(provenance or {}), **result.host}
    return {
        **result.params,
        "status": result.status,
        **(cell_metrics(result) if metrics is None else metrics),
        **split_tags(result),
        **stability_tags(result),
        **{k: result.host[k] for k in ENGINE_TAGS if k in result.host},
        **{k: tags.get(k, "") for k in PROVENANCE_COLUMNS},
        "cell_key": result.key,
        "mlflow_run_id": run_id,
        "error": (result.error or "").splitlines()[0] if result.error else "",
    }


def logged_row(params: dict[str, str], metrics: dict[str, float], tags: dict[str, str],
               run_id: str) -> dict[str, object]:
    """cell_row's columns for a FINISHED cell read back from its MLflow run (a resumed
    sweep's earlier cells, whichever hostsweep version logged them): provenance from its
    tags, metrics rounded as cell_row's."""
    return {
        **params,
        "status": "FINISHED",
        **{name: round_metric(name, value) for name, value in metrics.items()},
        **{k: tags[k] for k in SPLIT_TAGS + STABILITY_TAGS + ENGINE_TAGS if k in tags},
        **{k: tags.get(k, "") for k in PROVENANCE_COLUMNS},
        "cell_key": tags["cell_key"],
        "mlflow_run_id": run_id,
        "error": "",
    }
