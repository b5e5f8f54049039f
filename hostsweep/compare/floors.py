"""The noise floors a diff and the TP verdict widen their intervals by, measured on the machine
at hand (`stage=noise`) and found again by the stages that use them (pure).

Two floors, both the SD (%) of a log step ratio that nothing within one engine start shows:
- the instance floor (diff.instance_floor_pct): what two engine instances of one configuration
  differ by. Each paired A/A by rounds starts one instance a side, so its geometric mean is one
  draw of that ratio (0 expected: nothing changed) plus its rounds' sampling error, which the
  rounds' own CI already holds: the floor is the draws' mean square less their sampling
  variance, on as many degrees of freedom as A/As.
- the between-start floor (diff.noise_floor_pct, fit.start_floor_pct): the step's SD between
  engine starts, from an A/A by start pairs (compare/start_pairs.NoiseFloor, pooled per group).

An SD from three draws is itself uncertain (its 80 % upper bound is 1.7x the estimate), so a
calibration states the one-sided upper confidence bound (chi-square on the draws' df) beside
the estimate, and the floors it hands on are the upper bound unless diff.floor_bound=point.

A floor set to `auto` (the default) is the newest calibration of the machine and engine the
cells ran on, else the documented default; a number or null given for it is used as given.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
from scipy import stats

AUTO = "auto"
# What a floor is without a calibration (docs/diff.md, "Noise floors"): the RMS of three paired
# A/As' instance effects on the CPU build; no between-start floor (a one-start side is then
# judged on its replicate-first re-measures).
DEFAULT_INSTANCE_FLOOR_PCT = 1.5
DEFAULT_NOISE_FLOOR_PCT: Optional[float] = None
FLOOR_BOUNDS = ("upper", "point")  # diff.floor_bound: which of a calibration's numbers the floors take
# The cell tags (and a diff's shared provenance keys) that name the machine and engine a calibration holds for
MACHINE_KEYS = ("hostname", "device_name", "vllm_version")
CALIBRATE_COMMAND = "python -m hostsweep stage=noise"


def floor_text(pct: float) -> str:
    """A noise floor as typed back into diff.noise_floor_pct: two significant digits, rounded up."""
    if pct <= 0:
        return "0"
    step = 10.0 ** (math.floor(math.log10(pct)) - 1)
    return f"{math.ceil(round(pct / step, 6)) * step:.{max(0, 1 - math.floor(math.log10(pct)))}f}"


def floor_setting(value: Any, key: str) -> Any:
    """A floor key's value checked: AUTO, None, or a percentage in [0, 100); ValueError naming
    the key otherwise (the stage makes it a one-line ConfigError)."""
    if value is None or value == AUTO:
        return value
    try:
        pct = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key} must be auto, null or a percentage in [0, 100), got {value!r}") from None
    if not 0 <= pct < 100:
        raise ValueError(f"{key} must be auto, null or a percentage in [0, 100), got {value!r}")
    return pct


def floor_bound(value: Any) -> str:
    """diff.floor_bound checked: one of FLOOR_BOUNDS; ValueError naming the key otherwise."""
    if value not in FLOOR_BOUNDS:
        raise ValueError(f"floor_bound={value!r} is not allowed; allowed: {', '.join(FLOOR_BOUNDS)}")
    return value


def sd_upper_pct(pct: float, df: float, confidence: float) -> float:
    """The one-sided upper confidence bound of an SD (%) estimated on df degrees of freedom:
    df s^2 / sigma^2 is chi-square(df), so sigma <= s sqrt(df / chi2_{1-confidence}(df)) with
    probability `confidence` (inf with no df)."""
    if not df > 0:
        return math.inf
    return pct * math.sqrt(df / float(stats.chi2.ppf(1 - confidence, df)))


@dataclass(frozen=True)
class FloorEstimate:
    """One floor as a calibration measured it: the SD (%), its upper bound at `confidence`, on
    `df` degrees of freedom."""

    pct: float
    upper_pct: float
    df: float
    confidence: float

    def value(self, use: str) -> float:
        return self.upper_pct if use == "upper" else self.pct

    def text(self) -> str:
        return (f"{self.pct:.2f} % (upper {self.confidence:.0%} bound {self.upper_pct:.2f} %, "
                f"{self.df:g} df)")


def instance_floor(log_ratios: Sequence[float], confidence: float,
                   sampling_ses: Optional[Sequence[float]] = None) -> Optional[FloorEstimate]:
    """The instance floor from paired A/As by rounds: each A/A's geometric-mean log ratio g_i is
    one draw of the log ratio between two instances plus its rounds' sampling error, so
    E[g^2] = sigma^2 + se_i^2 (the mean is 0 by design: every draw is a degree of freedom). The
    floor is what the rounds' own CI cannot hold: sigma^2 = mean(g^2) - mean(se^2), floored at
    0, and its upper bound K mean(g^2) / chi2_{1-confidence}(K) - mean(se^2) (the se taken as
    known). Without sampling_ses the draws' RMS (errs wide). None without a finite draw."""
    pairs = [(g, 0.0 if sampling_ses is None else sampling_ses[i]) for i, g in enumerate(log_ratios)
             if g is not None and math.isfinite(g)]
    pairs = [(g, se) for g, se in pairs if se is not None and math.isfinite(se)]
    if not pairs:
        return None
    draws, ses = (np.asarray(x, dtype=float) for x in zip(*pairs))
    k, mean_square, sampling = draws.size, float(np.mean(draws ** 2)), float(np.mean(ses ** 2))
    upper_var = k * mean_square / float(stats.chi2.ppf(1 - confidence, k)) - sampling
    as_pct = lambda var: math.expm1(math.sqrt(max(var, 0.0))) * 100  # noqa: E731
    return FloorEstimate(as_pct(mean_square - sampling), as_pct(upper_var), float(k), confidence)


def start_floor(pct: Optional[float], df: float, confidence: float) -> Optional[FloorEstimate]:
    """The between-start floor from an A/A by start pairs (its NoiseFloor's SD and df)."""
    if pct is None or not math.isfinite(pct) or not df > 0:
        return None
    return FloorEstimate(pct, sd_upper_pct(pct, df, confidence), float(df), confidence)


@dataclass(frozen=True)
class MachineEngine:
    """What a calibration holds for: the host, its device (the CPU's model or the GPU's name) and
    the engine (its vLLM version; `fake` for the fake engine)."""

    host: str
    device: str
    engine: str

    def text(self) -> str:
        return f"{self.host} ({self.device}, vLLM {self.engine})"


@dataclass(frozen=True)
class NoiseCalibration:
    """A noise calibration as logged: where and when, and its two floors (either may be missing)."""

    run_id: str
    created: str  # YYYY-MM-DD
    where: MachineEngine
    instance: Optional[FloorEstimate]
    start: Optional[FloorEstimate]


@dataclass(frozen=True)
class ResolvedFloors:
    """The floors in force, as numbers (None: none), and the one line that says where each came from."""

    noise_floor_pct: Optional[float]
    instance_floor_pct: Optional[float]
    line: str


def _given(value: Any) -> str:
    return "null" if value is None else f"{float(value):g}"


def _one_floor(name: str, key: str, setting: Any, default: Optional[float], measured: Optional[FloorEstimate],
               use: str) -> tuple[Optional[float], str]:
    """One floor in force and how the floors line names it."""
    if setting != AUTO:
        shown = "none" if setting is None else f"{float(setting):g} %"
        return (None if setting is None else float(setting)), f"{name} {shown} ({key}={_given(setting)}, given)"
    if measured is not None:
        value = float(floor_text(measured.value(use)))  # as typed back: two digits, rounded up
        bound = f"upper {measured.confidence:.0%} bound" if use == "upper" else "estimate"
        return value, f"{name} {value:g} % ({bound}, {measured.df:g} df)"
    return default, f"{name} {'none' if default is None else f'{default:g} %'} (default)"


def _source(settings: Sequence[Any], calibration: Optional[NoiseCalibration],
            looked_for: Optional[MachineEngine]) -> str:
    """Which calibration the auto floors came from, or the command that would make one."""
    if AUTO not in settings:
        return ""
    if calibration is not None:
        return f"; calibrated {calibration.created} on {calibration.where.text()}, run {calibration.run_id}"
    on = f" of {looked_for.text()}" if looked_for else ""
    return f"; no noise calibration{on} in this store: measure this machine's with {CALIBRATE_COMMAND}"


def resolve_floors(noise_setting: Any, instance_setting: Any, calibration: Optional[NoiseCalibration],
                   use: str = "upper", looked_for: Optional[MachineEngine] = None) -> ResolvedFloors:
    """The diff's floors in force: a given number or null as given; AUTO from the calibration
    (its upper bound, or its estimate with use=point) where it measured that floor, else the
    documented default. The line names the source of each, and, when a default stands in for
    an auto floor, the command that measures this machine's."""
    instance, instance_text = _one_floor("instance floor", "diff.instance_floor_pct", instance_setting,
                                         DEFAULT_INSTANCE_FLOOR_PCT, calibration.instance if calibration else None, use)
    noise, noise_text = _one_floor("between-start floor", "diff.noise_floor_pct", noise_setting,
                                   DEFAULT_NOISE_FLOOR_PCT, calibration.start if calibration else None, use)
    line = f"floors: {instance_text}, {noise_text}" + _source((noise_setting, instance_setting), calibration, looked_for)
    return ResolvedFloors(noise, instance, line)


def resolve_start_floor(setting: Any, calibration: Optional[NoiseCalibration], use: str = "upper",
                        looked_for: Optional[MachineEngine] = None,
                        fallback: Optional[float] = DEFAULT_NOISE_FLOOR_PCT) -> tuple[Optional[float], str]:
    """fit.start_floor_pct in force (the TP verdict's between-start floor) and its line; an auto
    floor with no calibration takes `fallback` (fit.start_floor_fallback_pct: a preset's own
    measured floor, none by default)."""
    value, text = _one_floor("between-start floor", "fit.start_floor_pct", setting, fallback,
                             calibration.start if calibration else None, use)
    return value, f"floors: {text}" + _source((setting,), calibration, looked_for)


def machine_engine(cells: Any) -> Optional[MachineEngine]:
    """The machine and engine a table of cells ran on (their hostname, device_name and
    vllm_version tags), or None when the cells hold none or several: a calibration is looked
    up for one machine and one engine only."""
    found = []
    for column in MACHINE_KEYS:
        if column not in getattr(cells, "columns", ()):
            return None
        values = {str(v) for v in cells[column].dropna() if str(v) not in ("", "nan", "None")}
        if len(values) != 1:
            return None
        found.append(values.pop())
    return MachineEngine(*found)
