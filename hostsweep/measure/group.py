"""One engine group's timed measurement as the worker builds it (pure): each cell's pairs,
summary and stability verdict, the attempts a re-measure replaced, and which of the
engine's speculation counts belong to the reported pairs. The worker (run/worker.py) times
the pairs; this is what it makes of them.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from hostsweep.config.grid import Cell
from hostsweep.measure.protocol import CellMeasurement, RepTiming, summarize
from hostsweep.measure.results import MeasureOptions, stability_rules_of
from hostsweep.measure.speculative import SpecResult, spec_summary
from hostsweep.measure.stability import Stability, judge, replicate_disagrees


@dataclass(frozen=True)
class TimedCell:
    """A cell's timed pairs, summarized and judged: measured with its group's other cells in
    interleaved rounds, kept until the dispatcher asks for the cell."""

    prompts: list[list[int]]
    measurement: CellMeasurement
    spec: Optional[SpecResult]
    stability: Stability
    earlier: tuple[tuple[RepTiming, ...], ...]  # the pairs of attempts the re-measure replaced
    started_at: float  # epoch seconds: when the group's measurement began


class GroupMeasurement:
    """A group's timed measurement as it is built: each cell's pairs, summary, verdict and
    replaced attempts, and which of its speculation counts belong to the reported pairs."""

    def __init__(self, cells: Sequence[Cell], prompts: list[list[list[int]]], options: MeasureOptions) -> None:
        self.cells, self.prompts, self.options = cells, prompts, options
        self.started_at = time.time()
        self.spec_logs: list[list[list[dict]]] = [[] for _ in cells]
        self.generates: list = []
        self.final_from = [0] * len(cells)
        self.timings: list[tuple[RepTiming, ...]] = [()] * len(cells)
        self.summaries: list[Optional[CellMeasurement]] = [None] * len(cells)
        self.verdicts: list[Stability] = [Stability()] * len(cells)
        self.earlier: list[list[tuple[RepTiming, ...]]] = [[] for _ in cells]

    def _summary(self, i: int, pairs: Sequence[RepTiming]) -> CellMeasurement:
        m = self.options.measure
        return summarize(pairs, m.bootstrap_resamples, m.ci_level, self.cells[i].seed)

    def take(self, which: Sequence[int], timings: Sequence[Sequence[RepTiming]], attempt: int = 1) -> None:
        """The pairs of an attempt at these cells: summarized and judged; the ones they
        replace are kept."""
        for i, pairs in zip(which, timings):
            if self.timings[i]:
                self.earlier[i].append(self.timings[i])
            self.timings[i], self.summaries[i] = tuple(pairs), self._summary(i, pairs)
            verdict = judge(pairs, self.summaries[i], stability_rules_of(self.options, self.cells[i].seed), attempt)
            self.verdicts[i] = dataclasses.replace(verdict, replicate_step_ms=self.verdicts[i].replicate_step_ms)

    def replicate(self, pairs: Sequence[RepTiming]) -> None:
        """The first cell timed again after the rounds: unstable if it disagrees with itself."""
        again = self._summary(0, pairs)
        self.verdicts[0] = dataclasses.replace(self.verdicts[0], replicate_step_ms=again.step_ms)
        if replicate_disagrees(self.summaries[0], again, self.options.measure.min_shift_pct):  # type: ignore[arg-type]
            self.verdicts[0] = self.verdicts[0].with_reason("replicate")

    def unstable(self) -> list[int]:
        return [i for i, v in enumerate(self.verdicts) if not v.stable and "split_impossible" not in v.reasons]

    def mark_attempt(self, which: Sequence[int]) -> None:
        for i in which:  # the speculation counts of the attempt about to be timed are the ones reported
            self.final_from[i] = len(self.spec_logs[i])

    def timed_cells(self) -> dict[str, "TimedCell"]:
        timed_s = time.time() - self.started_at
        cells = {}
        for i, cell in enumerate(self.cells):
            start = self.final_from[i]
            spec = spec_summary(self.spec_logs[i][start:start + len(self.timings[i])], cell.T)
            cells[cell.key] = TimedCell(self.prompts[i], dataclasses.replace(self.summaries[i], timed_s=timed_s),
                                        spec, self.verdicts[i], tuple(self.earlier[i]), self.started_at)
        return cells
