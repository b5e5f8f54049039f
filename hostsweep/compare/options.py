"""What a diff is asked (DiffOptions, checked from the diff config section) and the words its
rows use: verdicts, designs, sides, where a CI came from, and which flags touch a step's own
number (pure)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
import pandas as pd

from hostsweep.compare.floors import MachineEngine, NoiseCalibration, floor_bound, floor_setting, resolve_floors
from hostsweep.compare.match import text
from hostsweep.compare.rules import DEFAULT_RULE, RULES, null_pct
from hostsweep.config.schema import ConfigError, DiffConfig
from hostsweep.measure.stability import ANNOTATIONS

NORMALIZE = ("canary",)  # diff.normalize's values (None: raw ratios only)
VERDICTS = ("faster", "slower", "same", "inconclusive")
FAIL_ON = ("slower", "slower_overall", "inconclusive")  # slower_overall: the geometric mean judged under the rule
GATED = "step_ms"  # the quantity fail_on judges: the one with raw pairs on both sides
RAW, SUMMARY, HOST_FIXED, POINT = ("raw pairs", "summary CIs (approximate: no raw_timings.csv)",
                                   "step pairs minus device_ms, its CI propagated", "point only (no raw pairs)")
PAIRED, PAIRED_HOST = "paired engine starts", "paired engine starts minus device_ms, its CI propagated"
PAIRED_ROUNDS, PAIRED_ROUNDS_HOST = "paired rounds", "paired rounds, device_ms held fixed"
# A cell is judged by paired rounds from this many matched rounds: the fewest whose order
# statistics reach a 95 % CI of the median ([min, max] of 6 covers 96.9 %), and a sign test
# that can reject at all (p >= 1/64 below it even when every round agrees).
MIN_ROUNDS = 6
# A sequential cell with a one-start side and no between-start component (no noise floor, fewer
# than 2 starts): its pairs' CI holds one engine start's noise only, which the machine's drift
# between studies exceeds, so it is inconclusive for this, whatever its pairs say.
NO_BETWEEN = "no between-start estimate"
# How a row's CI and p-values were made: a Student t on d, se, df; the exact sign test and
# order-statistic CI of a paired-rounds cell; none (point only).
TESTS = ("t", "sign", "")
DESIGNS = ("paired", "sequential")  # a cell's design: both sides in one sweep, starts alternated; or measured apart
SIDES = ("a", "b")  # a paired study's sides (param `side`): a the study as given, b with pair.against
# Reasons that do not touch the step's own number: a cell unstable only for these is judged
# as stable on step_ms (its host_ms stays unstable).
NOT_STEP_REASONS = frozenset({"split_impossible", "split_implausible"})
RawPairs = Union[np.ndarray, Sequence[np.ndarray]]  # one start's pairs, or one array per start
# A run's pairs timed in paired rounds: one row per pair, the columns of
# record/read/sides.ROUND_COLUMNS (pair_round, step_ms, canary_ms, replicate, period, round).
RawRounds = pd.DataFrame


@dataclass(frozen=True)
class DiffOptions:
    threshold_pct: float = 5.0
    quantities: tuple[str, ...] = ("step_ms", "device_ms", "host_ms")
    level: float = 0.95
    alpha: float = 0.05
    noise_floor_pct: Optional[float] = None  # between-start spread (SD, %) for one-start sides
    fail_on: Optional[str] = None
    normalize: Optional[str] = None  # "canary": each step ratio also divided by the sides' canary ratio
    # The SD (%) of the ratio between two engine instances of one configuration: what a paired
    # A/A by rounds shows as its geometric mean's shift. Each side of paired rounds is one
    # instance, shared by every round and cell, so the rounds CI cannot hold it; it is added.
    instance_floor_pct: Optional[float] = None
    rule: str = DEFAULT_RULE  # what slower/faster mean (compare/rules.py): significant or margin
    # A gate refuses (exit 2) when a gated cell's MDE under the rule exceeds this many times the
    # threshold: it could not have seen the change its line names. None: no bound.
    max_mde_factor: Optional[float] = 3.0
    floors_line: str = ""  # where the floors came from (compare/floors.resolve_floors), for the reader

    @property
    def null_pct(self) -> float:
        """Where the slower/faster tests put their null (rules.null_pct)."""
        return null_pct(self.rule, self.threshold_pct)

    @property
    def max_mde_pct(self) -> float:
        """The largest MDE (%) a gated cell may have before the gate refuses (inf: no bound)."""
        return math.inf if self.max_mde_factor is None else self.max_mde_factor * self.threshold_pct

    @property
    def instance_var(self) -> float:
        """instance_floor_pct as a variance of the log ratio (0 when not given)."""
        return math.log1p(self.instance_floor_pct / 100) ** 2 if self.instance_floor_pct else 0.0

    def check(self) -> None:
        """ValueError naming the field (the stage makes it a one-line ConfigError)."""
        if not 0 < self.threshold_pct < 100:
            raise ValueError(f"threshold_pct must be in (0, 100), got {self.threshold_pct}")
        if not 0.5 <= self.level < 1:
            raise ValueError(f"ci_level must be in [0.5, 1), got {self.level}")
        if not 0 < self.alpha <= 0.5:
            raise ValueError(f"alpha must be in (0, 0.5], got {self.alpha}")
        if self.noise_floor_pct is not None and not 0 <= self.noise_floor_pct < 100:
            raise ValueError(f"noise_floor_pct must be in [0, 100) or null, got {self.noise_floor_pct}")
        if self.instance_floor_pct is not None and not 0 <= self.instance_floor_pct < 100:
            raise ValueError(f"instance_floor_pct must be in [0, 100) or null, got {self.instance_floor_pct}")
        if not self.quantities:
            raise ValueError("quantities must name at least one metric, e.g. [step_ms]")
        if self.fail_on is not None and self.fail_on not in FAIL_ON:
            raise ValueError(f"fail_on={self.fail_on!r} is not allowed; allowed: null, {', '.join(FAIL_ON)}")
        if self.rule not in RULES:
            raise ValueError(f"rule={self.rule!r} is not allowed; allowed: {', '.join(RULES)}")
        if self.max_mde_factor is not None and not self.max_mde_factor > 0:
            raise ValueError(f"max_mde_factor must be > 0 or null, got {self.max_mde_factor}")
        if self.normalize is not None and self.normalize not in NORMALIZE:
            raise ValueError(f"normalize={self.normalize!r} is not allowed; allowed: null, {', '.join(NORMALIZE)}")


def diff_options(cfg: DiffConfig, calibration: Optional[NoiseCalibration] = None,
                 looked_for: Optional[MachineEngine] = None) -> DiffOptions:
    """The diff section (config/schema.DiffConfig) as DiffOptions, checked: a bad value is a
    one-line ConfigError naming the key. A sweep checks it before anything starts (its paired
    diff and its gate read it), the diff stage before it reads a run. The floors set to `auto`
    take the calibration's (compare/floors.py), else their documented defaults; floors_line says which."""
    try:
        noise, instance = (floor_setting(getattr(cfg, k), k) for k in ("noise_floor_pct", "instance_floor_pct"))
        floor_bound(cfg.floor_bound)
    except ValueError as exc:
        raise ConfigError(f"diff.{exc}") from None
    floors = resolve_floors(noise, instance, calibration, cfg.floor_bound, looked_for)
    options = DiffOptions(float(cfg.threshold_pct), tuple(cfg.quantities), float(cfg.ci_level), float(cfg.alpha),
                          floors.noise_floor_pct, cfg.fail_on, cfg.normalize, floors.instance_floor_pct, str(cfg.rule),
                          None if cfg.max_mde_factor is None else float(cfg.max_mde_factor), floors.line)
    try:
        options.check()
    except ValueError as exc:
        raise ConfigError(f"diff.{exc}") from None
    return options


def stable_flag(value: Any) -> Optional[bool]:
    """A cell's `stable` tag, param or metric as True/False; None when the cell has none."""
    word = text(value).strip().lower()
    if word in ("false", "0", "no"):
        return False
    if word in ("true", "1", "yes"):
        return True
    return None


def by_rounds(cells: pd.DataFrame) -> pd.Series:
    """The rows judged over paired rounds: those with matched rounds, whether by the sign test
    widened by diff.instance_floor_pct or not (both test "sign")."""
    if "rounds" not in cells:
        return pd.Series(False, index=cells.index)
    return pd.to_numeric(cells["rounds"], errors="coerce").fillna(0) > 0


def finite_value(row: Mapping[str, Any], name: str) -> Optional[float]:
    try:
        value = float(row.get(name))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def step_unstable(flags: tuple[Optional[bool], Optional[bool]], reasons: tuple[str, str]) -> bool:
    """Whether either side is unstable for its own step: a cell flagged only split_impossible is
    not (its step is fine; the split is what failed), nor one flagged only for what its whole
    group met (measure/stability.ANNOTATIONS, as older runs recorded them among the reasons):
    the fit keeps such cells, and the gate does not fail on them either."""
    for flag, why in zip(flags, reasons):
        named = {r.strip() for r in why.split(",") if r.strip()}
        if flag is False and (not named or named - NOT_STEP_REASONS - set(ANNOTATIONS)):
            return True
    return False



def device_error(row: Mapping[str, Any]) -> tuple[float, float]:
    """(variance in ms^2, df) of a cell's device_ms, read back from its t-interval over the
    split's profiled pairs (device_ci_low_ms/high_ms at the cell's ci_level, split_pairs - 1
    df); (0, inf) when the cell logged none: then device_ms is held fixed, as it was before the
    split had a CI."""
    low, high = finite_value(row, "device_ci_low_ms"), finite_value(row, "device_ci_high_ms")
    pairs = finite_value(row, "split_pairs")
    if low is None or high is None or high <= low or pairs is None or pairs < 2:
        return 0.0, math.inf
    level = finite_value(row, "ci_level") or 0.95
    from scipy import stats  # the options module stays light for the CLI's checker

    se = (high - low) / (2 * float(stats.t.ppf(0.5 + level / 2, pairs - 1)))
    return se ** 2, pairs - 1.0
