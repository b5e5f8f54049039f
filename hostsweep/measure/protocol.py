"""Per-step decode time by differencing, with medians and their order-statistic CIs (pure).

For one cell the same generate runs with T=1 and with T tokens. Load, warm-up and
prefill are identical in both, so (wall_T - wall_1) / (T - 1) is the average cost of
one steady-state decode step. Pairs are interleaved, and their order alternates, so
slow drift on a shared machine lands on both members of a pair.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import numpy as np

from hostsweep.config.schema import MeasureConfig
from hostsweep.measure.intervals import look_level, median_ci, median_ci_bounds, sequential_coverage

if TYPE_CHECKING:  # a cell is only read here
    from hostsweep.config.grid import Cell


# A callable that runs the cell's generate with the given number of output tokens
# and returns its wall time in seconds. The worker builds it around an engine.
TimedGenerate = Callable[[int], float]
# Told before each pair: ("warm-up" or "rep", k, n), 1-based; the worker shows it as its phase.
PairHook = Callable[[str, int, int], None]
# Asked after each timed pair, with the pairs so far: may the cell stop now?
StopRule = Callable[[Sequence["RepTiming"]], bool]


@dataclass(frozen=True)
class Contention:
    """What else the machine did while one timed pair ran (run/contention.py measures it).
    Fractions are of the whole machine's CPU time over the pair's interval."""

    foreign_cpu_frac: float  # CPU used by processes outside the engine tree and the sweep's daemons
    engine_cpu_frac: float  # CPU used by the engine's own process tree (the worker included)
    steal_frac: float  # time the hypervisor ran other guests on this machine's CPUs
    load1: float  # the 1-minute load average at the pair's end


@dataclass(frozen=True)
class RepTiming:
    rep: int
    t1_first: bool  # whether the T=1 generate ran before the T generate in this pair
    wall_1_s: float
    wall_T_s: float
    step_s: float
    round: int = -1  # the round the pair ran in (interleaved_rounds); -1 in records from before rounds
    contention: Optional[Contention] = None  # None where the machine could not be observed
    replicate: int = 0  # the engine start it was measured in (measure.replicates), 0-based
    # The group's measurement period (0-based): a re-measure times the whole group again
    # in a period of its own (measure/group.py); (period, round) names a round.
    period: int = 0
    canary_ms: Optional[float] = None  # the speed canary timed right after the pair (run/canary.py)
    # A paired study measured in paired rounds (pair.design=rounds): the round's id, shared by
    # the pairs of a cell's two sides timed back to back in it; "" otherwise.
    pair_round: str = ""
    gpu_canary_ms: Optional[float] = None  # the canary's fixed GPU kernel, where the worker sees a CUDA device


@dataclass(frozen=True)
class CellMeasurement:
    step_ms: float
    step_ci_low_ms: float
    step_ci_high_ms: float
    wall_1_ms: float
    wall_T_ms: float
    reps: tuple[RepTiming, ...]
    timed_s: float = 0.0  # wall time of the warm-ups and timed pairs (the worker sets it)
    # What the CI is guaranteed to cover: its exact order-statistic coverage (a lower bound
    # over the looks of an adaptive cell; the nominal level across engine starts). Below the
    # level asked for when a cell has too few pairs (fewer than 6 at 95 %). nan: not recorded.
    ci_coverage: float = float("nan")

    @property
    def ci_half_width_pct(self) -> float:
        """Half the CI's width as a percentage of the median step (what target_ci_pct bounds)."""
        return half_width_pct(self.step_ms, self.step_ci_low_ms, self.step_ci_high_ms)


def half_width_pct(median: float, low: float, high: float) -> float:
    return (high - low) / 2.0 / abs(median) * 100.0 if median else float("inf")


def step_time(wall_1_s: float, wall_T_s: float, T: int) -> float:
    """Seconds per decode step from one (T=1, T) pair."""
    if T < 2:
        raise ValueError(f"T must be >= 2 for differencing, got {T}")
    return (wall_T_s - wall_1_s) / (T - 1)


# The T a prefill-bound cell is pointed to is rounded up to a multiple of this, plus one.
T_STEP = 32


def prefill_bound_T(wall_1_ms: float, step_ms: float, T: int) -> Optional[int]:
    """The T at which a cell's T − 1 decode steps would outlast its T=1 generate (rounded up
    to a multiple of T_STEP, plus one), when the cell's own T falls short of that; None when
    its T is enough or a number is missing. Both generates of a pair carry the prefill and a
    pair's step is their difference over T − 1: where one prefill outlasts the T − 1 steps,
    the prefill's noise is most of the pair's (docs/measurement.md#choosing-t)."""
    if not (np.isfinite(wall_1_ms) and np.isfinite(step_ms)) or step_ms <= 0 or wall_1_ms <= (T - 1) * step_ms:
        return None
    return int(np.ceil(wall_1_ms / step_ms / T_STEP)) * T_STEP + 1


def side_a_first(k: int, slot: int) -> bool:
    """In paired rounds, whether side a's pair runs first in round k of a slot. The T order
    flips every round (interleaved_rounds: t1_first when k is even); the side order flips
    every two rounds, offset by the slot, so within every four rounds each slot meets all
    four (side order, T order) combinations. Flipped together, as they once were, the
    generate that follows the other engine's was always side a's T generate and side b's
    T=1 generate: a cost of switching engines then raised one side's step and lowered the
    other's in every round alike, which no number of rounds averages away."""
    return (k // 2 + slot) % 2 == 0


def time_pair(timed_generate: TimedGenerate, T: int, rep: int, t1_first: bool) -> RepTiming:
    """One timed (T=1, T) pair, its T=1 generate first or second."""
    if t1_first:
        wall_1 = timed_generate(1)
        wall_T = timed_generate(T)
    else:
        wall_T = timed_generate(T)
        wall_1 = timed_generate(1)
    return RepTiming(rep, t1_first, wall_1, wall_T, step_time(wall_1, wall_T, T))


def run_protocol(timed_generate: TimedGenerate, T: int, warmups: int, reps: int,
                 on_pair: Optional[PairHook] = None, stop: Optional[StopRule] = None) -> list[RepTiming]:
    """One cell: warm up, then time up to `reps` (T=1, T) pairs alternating which runs first;
    warm-up pairs are discarded. With `stop`, the pairs end early once it says the ones so
    far suffice. (The rounds of interleaved_rounds with a single cell.)"""
    tell = on_pair or (lambda kind, k, n: None)
    for warmup in range(warmups):
        tell("warm-up", warmup + 1, warmups)
        timed_generate(1)
        timed_generate(T)
    rounds = interleaved_rounds([reps], lambda i, k, t1_first: time_pair(timed_generate, T, k, t1_first), seed=0,
                                stops=[stop], on_round=lambda r, active: tell("rep", r, reps))
    return list(rounds.timings[0])


# One timed pair of cell `index` (its k-th, 0-based), T=1 first or not: the worker builds it.
PairRunner = Callable[[int, int, bool], RepTiming]
# Told at the start of each round: (round 1-based, cells still measuring).
RoundHook = Callable[[int, int], None]


def round_order(cells: Sequence[int], round_index: int, seed: int) -> list[int]:
    """The order the cells of one round are measured in: a shuffle seeded by (seed, round),
    so a run can be replayed and no cell always runs first (right after another cell's
    generate, or right after a pause)."""
    order = list(cells)
    np.random.default_rng([seed, round_index]).shuffle(order)
    return order


@dataclass(frozen=True)
class Rounds:
    """The timed pairs of a group of cells measured in interleaved rounds."""

    timings: tuple[tuple[RepTiming, ...], ...]  # per cell, in the order measured
    orders: tuple[tuple[int, ...], ...]  # per round, the cells in the order they ran


def interleaved_rounds(reps: Sequence[int], pair: PairRunner, seed: int,
                       stops: Optional[Sequence[Optional[StopRule]]] = None,
                       on_round: Optional[RoundHook] = None,
                       done: Optional[Sequence[Sequence[RepTiming]]] = None,
                       on_pair: Optional[Callable[[int, RepTiming], None]] = None) -> Rounds:
    """Time the cells' pairs in rounds, one pair of every cell still measuring per round,
    in a seeded shuffled order: slow drift and a neighbour's bursts then land on every cell
    alike instead of on whichever cell was running (asv's interleaved rounds). A cell leaves
    the rotation after reps[i] pairs, or once its stop rule says its pairs suffice. Each
    cell's pairs alternate which generate runs first, as run_protocol's do. `done`: pairs
    an earlier run measured (a killed sweep's); the rounds continue after them. `on_pair`
    hears of each pair as soon as it is measured (cell index, the pair with its round)."""
    rule = stops or [None] * len(reps)
    timings: list[list[RepTiming]] = [list(d) for d in done] if done else [[] for _ in reps]
    active = [i for i, n in enumerate(reps)
              if len(timings[i]) < n and not (timings[i] and rule[i] and rule[i](timings[i]))]
    orders: list[tuple[int, ...]] = []
    round_index = 1 + max((t.round for cell in timings for t in cell), default=-1)
    while active:
        if on_round is not None:
            on_round(round_index + 1, len(active))
        order = round_order(active, round_index, seed)
        for i in order:
            k = len(timings[i])
            timing = pair(i, k, k % 2 == 0)
            timings[i].append(dataclasses.replace(timing, rep=k, round=round_index))
            if on_pair is not None:
                on_pair(i, timings[i][-1])
        orders.append(tuple(order))
        active = [i for i in active if len(timings[i]) < reps[i] and not (rule[i] and rule[i](timings[i]))]
        round_index += 1
    return Rounds(tuple(tuple(t) for t in timings), tuple(orders))


# Adaptive repetitions look at the CI every this many pairs from measure.min_reps on.
LOOK_EVERY = 4


def adaptive_looks(target_pct: Optional[float], min_reps: int, max_reps: int) -> tuple[int, ...]:
    """The pair counts an adaptive cell may stop at: min_reps, then every LOOK_EVERY pairs,
    and max_reps; () for a cell without a target (it runs its reps and looks once)."""
    if target_pct is None:
        return ()
    if min_reps < 1 or max_reps < min_reps:
        raise ValueError(f"max_reps must be >= min_reps >= 1, got min_reps={min_reps}, max_reps={max_reps}")
    return (*range(min_reps, max_reps, LOOK_EVERY), max_reps)


def narrow_enough(steps: np.ndarray, target_pct: float, level: float) -> np.ndarray:
    """Whether the median CI (at `level`, over the last axis) of each row of steps has a
    half-width of at most target_pct % of its median; never where that level is out of reach."""
    low, high, coverage = median_ci_bounds(steps, level)
    median = np.median(steps, axis=-1)
    return (coverage >= level - 1e-12) & ((high - low) / 2.0 <= target_pct / 100.0 * np.abs(median))


def ci_target_rule(target_pct: float, min_reps: int, max_reps: int, level: float) -> StopRule:
    """Stop at the first planned look (adaptive_looks) whose median CI, taken at the looks'
    common stricter level (intervals.look_level: the error split across the looks), has a
    half-width of at most `target_pct` % of the median. Looking only there, at that level,
    keeps the coverage of the CI reported at the stop >= level for any noise (a CI checked
    after every pair and reported at the first narrow one can stop on luck).
    summarize(..., looks) reports that same CI, so the logged half-width is the one that
    stopped the cell."""
    looks = adaptive_looks(target_pct, min_reps, max_reps)
    each = look_level(level, looks)

    def enough(timings: Sequence[RepTiming]) -> bool:
        if len(timings) not in looks:
            return False
        steps = np.array([t.step_s for t in timings]) * 1e3
        return bool(narrow_enough(steps, target_pct, each))

    return enough


def adaptive_stops(samples: np.ndarray, looks: Sequence[int], target_pct: float,
                   each: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ci_target_rule over many simulated cells at once (one row of steps each): per row the
    pair count it stops at (the first look whose CI at `each` is narrow enough, else the
    last look) and the CI it reports there. What the coverage tests and
    benchmarks/gate_calibration.py simulate the rule with."""
    rows = len(samples)
    used, low, high = np.zeros(rows, int), np.full(rows, np.nan), np.full(rows, np.nan)
    live = np.ones(rows, bool)
    for n in looks:
        lo, hi, _ = median_ci_bounds(samples[:, :n], each)
        stop = live & (narrow_enough(samples[:, :n], target_pct, each) | (n == looks[-1]))
        used[stop], low[stop], high[stop] = n, lo[stop], hi[stop]
        live &= ~stop
    return used, low, high


def bootstrap_median_ci(
    values: Sequence[float], resamples: int, level: float, rng: np.random.Generator
) -> tuple[float, float]:
    """Percentile-bootstrap CI of the median, vectorized over resamples. Not the cell's CI
    (that is median_ci's, exact); kept for medians of derived quantities (phases, benchmarks)."""
    data = np.asarray(values, dtype=float)
    if data.size == 0:
        raise ValueError("no values to bootstrap")
    idx = rng.integers(0, data.size, size=(resamples, data.size))
    medians = np.median(data[idx], axis=1)
    tail = (1.0 - level) / 2.0 * 100.0
    low, high = np.percentile(medians, [tail, 100.0 - tail])
    return float(low), float(high)


def summarize(timings: Sequence[RepTiming], level: float = MeasureConfig.ci_level,
              looks: Sequence[int] = ()) -> CellMeasurement:
    """Median step time with its order-statistic CI (intervals.median_ci), and the median
    walls, in milliseconds. `looks`: an adaptive cell's planned looks (adaptive_looks), whose
    CI is taken at the looks' level (intervals.look_level), as the stop rule took it."""
    steps = np.array([t.step_s for t in timings]) * 1e3
    ci = median_ci(steps, look_level(level, looks) if looks else level)
    return CellMeasurement(
        step_ms=float(np.median(steps)),
        step_ci_low_ms=ci.low,
        step_ci_high_ms=ci.high,
        wall_1_ms=float(np.median([t.wall_1_s for t in timings]) * 1e3),
        wall_T_ms=float(np.median([t.wall_T_s for t in timings]) * 1e3),
        reps=tuple(timings),
        ci_coverage=sequential_coverage(tuple(looks), level) if looks else ci.coverage,
    )


def random_prompts(batch: int, ctx: int, vocab_size: int, seed: int) -> list[list[int]]:
    """`batch` distinct prompts of `ctx` random token ids each (reproducible by seed)."""
    rng = np.random.default_rng(seed)
    prompts: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    while len(prompts) < batch:
        ids = tuple(rng.integers(0, vocab_size, size=ctx).tolist())  # one draw per prompt: the same ids as ever
        if ids not in seen:  # distinct prompts: no request can reuse another's KV
            seen.add(ids)
            prompts.append(list(ids))
    return prompts


# Random tokens a workload=repeat prompt grows from; the rest of its ctx is the model's text.
OWN_TEXT_SEED_TOKENS = 8


def own_text_seeds(prompts: list[list[int]]) -> list[list[int]]:
    """The first tokens of each random prompt, which the model continues to the full ctx
    (at least one token is left for the model to write)."""
    length = max(1, min(OWN_TEXT_SEED_TOKENS, len(prompts[0]) - 1))
    return [p[:length] for p in prompts]


def prompt_digest(prompts: list[list[int]]) -> str:
    """A short hash of the exact prompts, so cells compared across engines can show they
    decoded from the same text."""
    return hashlib.sha1(json.dumps(prompts).encode()).hexdigest()[:12]


def prompt_seed(cell: Cell) -> int:
    """Prompts differ across cells but are the same for every rep of one cell."""
    return cell.seed * 1_000_003 + cell.batch * 10_007 + cell.ctx
