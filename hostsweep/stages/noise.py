"""`stage=noise`: this machine's noise floors measured on the study's grid and engine, logged to
MLflow, and found again by every diff and TP verdict whose floors are `auto` (the default).

    python -m hostsweep stage=noise
    python -m hostsweep stage=noise +sku=h200 noise.aas=5

It runs noise.aas paired A/As by rounds (pair.enabled=true, pair.design=rounds), each a sweep
of its own, so each starts fresh engine instances: the geometric mean of each is one draw of
what two instances of one configuration differ by (the instance floor). Then, unless
noise.starts=0, one A/A by start pairs (pair.design=starts, noise.starts engine starts a
side): its between-start spread (the between-start floor). Both are SDs from few draws, so
each comes with its one-sided upper bound at noise.confidence (compare/floors.py); the run
`noise-<host>-<study>` in experiment noise.experiment holds them (metrics), the machine and
engine (tags: host, device, vLLM version) and noise/noise.md. The A/As are measured with no
floor of their own (diff.*_floor_pct=null, resume=false), as experiments
hostsweep-<study>-noise-aa<i> and hostsweep-<study>-noise-starts.

The store's side lives here too (a stage module is the one place that may reach both the
store and the pure compare/floors.py): the calibration run logged, and newest_calibration,
which the diff and fit stages call for their auto floors.
"""
from __future__ import annotations

import copy
import json
import logging
import math
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional

from mlflow.tracking import MlflowClient
from omegaconf import DictConfig, open_dict
from scipy import stats

from hostsweep.compare.floors import (MACHINE_KEYS, FloorEstimate, MachineEngine, NoiseCalibration,
                                      instance_floor, start_floor)
from hostsweep.config.pairing import default_reps
from hostsweep.config.redact import redact
from hostsweep.config.schema import ConfigError
from hostsweep.config.stages import StageInfo
from hostsweep.record.reports import ReportRun
from hostsweep.record.store import quiet_mlflow
from hostsweep.record.views import open_ui_line
from hostsweep.run.dispatch import WorkerBackend

STAGE = StageInfo(name="noise", help="measure this machine's noise floors (paired A/As), log them for auto floors",
                  sections=("noise", "measure", "split", "linearity", "engine", "ray", "faults", "output", "report"),
                  docs="diff.md")

log = logging.getLogger(__name__)


# The store's side: calibrations logged, and the newest of a machine and engine found.

KIND = "noise_calibration"
TAGS = {"host": "noise.host", "device": "noise.device", "engine": "noise.engine"}
FLOORS = ("instance", "start")


def _quoted(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def floor_metrics(calibration: NoiseCalibration) -> dict[str, float]:
    """A calibration's floors as run metrics: <floor>_floor_pct, _upper_pct, _df, and the confidence."""
    metrics: dict[str, float] = {}
    for name in FLOORS:
        estimate: Optional[FloorEstimate] = getattr(calibration, name)
        if estimate is not None:
            metrics |= {f"{name}_floor_pct": estimate.pct, f"{name}_floor_upper_pct": estimate.upper_pct,
                        f"{name}_floor_df": estimate.df, "confidence": estimate.confidence}
    return metrics


def open_calibration_run(uri: str, experiment: str, where: MachineEngine, study: str) -> ReportRun:
    """The calibration's run, opened once its A/As are measured (a calibration that measured no
    floor logs nothing), tagged with the machine and engine it holds for."""
    return ReportRun(uri, experiment, f"noise-{where.host}-{study}",
                     {"hostsweep.kind": KIND, **{tag: getattr(where, field) for field, tag in TAGS.items()}})


def log_noise_calibration(run: ReportRun, calibration: NoiseCalibration, params: dict[str, object], folder: Path,
                          note: str) -> None:
    run.log(folder, params, floor_metrics(calibration), note)
    run.finish()


def _estimate(metrics: dict[str, float], name: str) -> Optional[FloorEstimate]:
    try:
        values = [metrics[f"{name}_floor_{part}"] for part in ("pct", "upper_pct", "df")] + [metrics["confidence"]]
    except KeyError:
        return None
    return FloorEstimate(*(float(v) for v in values)) if math.isfinite(float(values[0])) else None


def newest_calibration(uri: str, experiment: str, where: Optional[MachineEngine]) -> Optional[NoiseCalibration]:
    """The newest FINISHED noise calibration of `where` in the store, or None (none logged, no
    such experiment, the store unreadable: a lookup never stops a diff, it says so and the
    floors fall back to their defaults)."""
    if where is None:
        return None
    try:
        client = MlflowClient(uri)
        found = client.get_experiment_by_name(experiment)
        if found is None:
            return None
        conditions = [f"tags.`hostsweep.kind` = '{KIND}'", "attributes.status = 'FINISHED'",
                      *(f"tags.`{tag}` = {_quoted(getattr(where, field))}" for field, tag in TAGS.items())]
        runs = client.search_runs([found.experiment_id], " and ".join(conditions), max_results=1,
                                  order_by=["attributes.start_time DESC"])
    except Exception as exc:  # noqa: BLE001 - the store answers the diff's own reads; a lookup is optional
        log.warning("could not look up noise calibrations in %s: %s", experiment, exc)
        return None
    if not runs:
        return None
    run = runs[0]
    created = datetime.fromtimestamp(run.info.start_time / 1000, tz=timezone.utc).strftime("%Y-%m-%d")
    metrics = dict(run.data.metrics)
    return NoiseCalibration(run.info.run_id, created, where, _estimate(metrics, "instance"), _estimate(metrics, "start"))


def check_noise(cfg: Any) -> None:
    """The noise section (a one-line ConfigError); pair.* is refused already, as any section a
    stage does not declare (config/stages.py): a calibration is A/As, nothing changed between sides."""
    n = cfg.noise
    if n.aas < 1:
        raise ConfigError(f"noise.aas must be >= 1 (paired A/As by rounds: the instance floor), got {n.aas}")
    if n.starts != 0 and n.starts < 2:
        raise ConfigError(f"noise.starts must be 0 (no between-start floor) or >= 2 engine starts a side, got {n.starts}")
    if not 0.5 <= n.confidence < 1:
        raise ConfigError(f"noise.confidence must be in [0.5, 1), got {n.confidence}")


def aa_config(raw_cfg: DictConfig, study: str, design: str, starts: Optional[int], reps: int,
              start_first: str = "a") -> DictConfig:
    """One A/A of the calibration: the study's grid and engine, paired, `reps` timed pairs a
    cell (rounds, or pairs a start), no floors, no split, not resumed."""
    cfg = copy.deepcopy(raw_cfg)  # the composed config, its schema and interpolations kept
    with open_dict(cfg):
        cfg.study = study
        cfg.stage = "sweep"
        cfg.resume = False
        cfg.pair.enabled = True
        cfg.pair.design = design
        cfg.pair.starts = starts
        cfg.pair.start_first = start_first
        cfg.measure.reps = reps
        cfg.split.enabled = False  # the floors are the step's; the split's profiled pairs would only add time
        cfg.diff.noise_floor_pct = None
        cfg.diff.instance_floor_pct = None
        cfg.diff.fail_on = None
    return cfg


@dataclass
class AaOutcome:
    """What one A/A of the calibration gave: its diff.json (None when it made none) and exit code."""

    name: str
    code: int
    diff: Optional[dict]

    def geomean_log(self) -> Optional[float]:
        ratio = ((self.diff or {}).get("summary", {}).get("step_ms", {}) or {}).get("geomean_ratio")
        return math.log(ratio) if isinstance(ratio, (int, float)) and ratio > 0 else None

    def geomean_se(self) -> Optional[float]:
        """The geometric mean's sampling SE (log) from its rounds' CI at that CI's exact coverage."""
        step = ((self.diff or {}).get("summary", {}).get("step_ms", {}) or {})
        low, high, coverage = (step.get(k) for k in ("ci_low", "ci_high", "ci_coverage"))
        if not all(isinstance(v, (int, float)) for v in (low, high, coverage)) or not (0 < low <= high and 0 < coverage < 1):
            return None
        return (math.log(high) - math.log(low)) / (2 * float(stats.norm.ppf(0.5 + coverage / 2)))

    def shared(self) -> dict:
        return (self.diff or {}).get("shared", {}) or {}


Backends = Optional[Callable[[Path], WorkerBackend]]  # one backend per A/A (its folder); None: Ray's


def measure_aa(raw_cfg: DictConfig, name: str, design: str, starts: Optional[int], reps: int, run_dir: Path,
               backends: Backends, start_first: str = "a") -> AaOutcome:
    """One A/A of the calibration swept (its own study, run folder and engine starts), and its diff."""
    folder = run_dir / name
    print(f"\nnoise calibration: {name} ({'paired rounds' if design == 'rounds' else f'{starts} start pairs a side'})")
    from hostsweep.stages import sweep  # the sweep's modules only when measuring: diff and fit import this one

    code = sweep.run(aa_config(raw_cfg, f"{raw_cfg.study}-noise-{name}", design, starts, reps, start_first), folder,
                     backends(folder) if backends else None)
    written = folder / "diff" / "diff.json"
    return AaOutcome(name, code, json.loads(written.read_text()) if written.is_file() else None)


def machine_of(outcomes: list[AaOutcome]) -> Optional[MachineEngine]:
    """The machine and engine every A/A's cells ran on (their shared provenance), or None."""
    seen = {tuple(o.shared().get(k) for k in MACHINE_KEYS) for o in outcomes if o.diff}
    if len(seen) != 1 or None in next(iter(seen)):
        return None
    return MachineEngine(*next(iter(seen)))


def document(calibration: NoiseCalibration, draws: list[AaOutcome], starts: Optional[AaOutcome], cfg: Any,
             rounds: int) -> str:
    def floor(name: str, estimate: Optional[FloorEstimate], why: str) -> str:
        return f"- {name}: " + (estimate.text() if estimate else f"not measured ({why})")

    lines = [f"# Noise calibration of {calibration.where.text()}", "",
             f"Run {calibration.run_id}, {calibration.created}; grid of study {cfg.study}, "
             f"{rounds} rounds an A/A.", "",
             floor("instance floor (diff.instance_floor_pct)", calibration.instance, "no paired A/A made a diff"),
             floor("between-start floor (diff.noise_floor_pct, fit.start_floor_pct)", calibration.start,
                   "noise.starts=0" if starts is None else "its A/A by start pairs made no between-start estimate"),
             "", "Each floor's upper bound is what a diff or TP verdict whose floor is `auto` uses "
             "(diff.floor_bound=point: the estimate). The instance floor is the A/As' geometric means' "
             "mean square less their rounds' sampling variance (compare/floors.py).", "",
             "| A/A | exit | geometric mean | its sampling SE (log) | between-start SD |", "|---|---|---|---|---|"]
    for o in [*draws, *([starts] if starts else [])]:
        g = o.geomean_log()
        sd = (o.diff or {}).get("noise_floor_pct")
        se = o.geomean_se()
        lines.append(f"| {o.name} | {o.code} | {'' if g is None else f'{math.exp(g):.4f}'} | "
                     f"{'' if se is None else f'{se:.4f}'} | {'' if sd is None else f'{sd:.2f} %'} |")
    return "\n".join(lines) + "\n"


def run(raw_cfg: DictConfig, run_dir: Path, backends: Backends = None) -> int:
    from hostsweep.stages import sweep

    quiet_mlflow()
    # The A/As by rounds take a gate's rounds unless measure.reps is given: the floors are for
    # gated diffs (config/pairing.default_reps), and more rounds pin each draw down better.
    given = raw_cfg.measure.reps
    rounds = int(given) if given is not None else default_reps("rounds", gated=True)
    study = sweep.resolve_sweep(raw_cfg)  # the grid, engine and diff section checked before anything starts
    cfg = study.config
    check_noise(cfg)
    n = cfg.noise
    # the A/As alternate which side's engine starts first in their shared worker
    draws = [measure_aa(raw_cfg, f"aa{i + 1}", "rounds", None, rounds, run_dir, backends, "ab"[i % 2])
             for i in range(n.aas)]
    starts = measure_aa(raw_cfg, "starts", "starts", int(n.starts), cfg.measure.reps, run_dir, backends) \
        if n.starts else None
    outcomes = [*draws, *([starts] if starts else [])]
    where = machine_of(outcomes)
    usable = [o for o in draws if o.geomean_log() is not None and o.geomean_se() is not None]
    instance = instance_floor([o.geomean_log() for o in usable], n.confidence, [o.geomean_se() for o in usable])
    start = start_floor((starts.diff or {}).get("noise_floor_pct"), (starts.diff or {}).get("noise_floor_df") or 0,
                        n.confidence) if starts else None
    if where is None or (instance is None and start is None):
        print(f"hostsweep: error: the noise calibration measured no floor (A/A exit codes "
              f"{', '.join(f'{o.name} {o.code}' for o in outcomes)}); nothing logged: see each A/A's console above",
              file=sys.stderr)
        return 1
    run = open_calibration_run(cfg.tracking.uri, n.experiment, where, cfg.study)
    calibration = NoiseCalibration(run.run_id, datetime.now().strftime("%Y-%m-%d"), where, instance, start)
    folder = run_dir / "noise"
    folder.mkdir(parents=True, exist_ok=True)
    text = document(calibration, draws, starts, cfg, rounds)
    (folder / "noise.md").write_text(text)
    params = {"study": cfg.study, "aas": n.aas, "starts": n.starts, "confidence": n.confidence,
              "reps": rounds, "a_a_exit_codes": ",".join(f"{o.name}:{o.code}" for o in outcomes)}
    log_noise_calibration(run, calibration, params, folder, text)
    print(f"\n{text}\nlogged as run {run.run_name} ({run.run_id}) of experiment {n.experiment!r} in "
          f"{redact(cfg.tracking.uri)}: every diff and TP verdict of this machine and engine whose floors are "
          f"auto now uses it\n{open_ui_line(cfg.tracking.uri, cfg.diff.ui_port)}")
    return max(o.code for o in outcomes)
