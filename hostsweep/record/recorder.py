"""Where a measured cell goes, in order: the journal, cells.csv, then MLflow from a
background thread, which fsyncs the journal before each batch it logs. Measured means kept:
a cell MLflow never hears of is in the journal and the table, and the next sweep of the
study uploads it (`upload_orphans`)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

from hostsweep.config.grid import engine_label
from hostsweep.config.validation import is_server
from hostsweep.measure.results import CellResult, cell_metrics, cell_row, format_ci, split_is_possible
from hostsweep.measure.phases import phase_metrics
from hostsweep.measure.stability import Stability
from hostsweep.record import crashpoints
from hostsweep.record.celltable import CellTable
from hostsweep.record.journal import Journal, decode_result
from hostsweep.record.views import JOURNAL_TAG
from hostsweep.record.uploader import BackgroundLogger

if TYPE_CHECKING:  # MLflow (1.5 s to import) loads only once a sweep records: bad input fails fast
    from hostsweep.record.tracking import SweepTracker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Measured:
    entry: str
    result: CellResult
    run_id: Optional[str]
    tags: dict[str, str]


def progress_label(params: dict[str, object]) -> str:
    """A cell as the console's progress lines name it: 'cpu/tiny-llama/eager/tp1 b2 ctx512' (and
    the workload when not random prompts)."""
    label = f"{engine_label(params)} b{params['batch']} ctx{params['ctx']}"
    workload = params.get("workload", "random")
    return label if workload == "random" else f"{label} {workload}"


def describe(result: CellResult, shown: Optional[dict[str, float]] = None) -> str:
    """One line: the step and its split, or why the cell failed and where its worker's log is.
    `shown`: cell_metrics(result), when the caller has them already."""
    shown = cell_metrics(result) if shown is None else shown  # as cells.csv and the table have them
    step = f"{shown['step_ms']:.3f} ms/step{periods_note(result.stability)}" if result.measurement else result.status
    if result.split is not None:
        step += f", device {shown['device_ms']:.3f} ms, " + host_frac_note(result, shown)
        step += allreduce_note(shown)
        step += largest_phase_note(result)
    if result.status != "FINISHED" and result.error:
        step += f": {result.error.strip().splitlines()[0][:300]}"
    if result.status == "FAILED" and result.host.get("worker_log"):
        step += f" (worker log: {result.host['worker_log']})"
    if result.attempt > 1:
        step += f" (attempt {result.attempt})"
    if result.stability is not None and result.measurement is not None:
        step += unstable_note(result.stability)
    return step


def allreduce_note(shown: dict[str, float]) -> str:
    """', all-reduce 0.412 ms [0.39, 0.44] (ranks 0.40-0.47)' for a TP > 1 cell: the all-reduce
    in situ from its profiled pairs (measure/results.allreduce_metrics); '' at TP-1."""
    if "allreduce_insitu_ms" not in shown:
        return ""
    ci = format_ci(shown.get("allreduce_insitu_ci_low_ms"), shown.get("allreduce_insitu_ci_high_ms"), 3)
    return (f", all-reduce {shown['allreduce_insitu_ms']:.3f} ms{' ' + ci if ci else ''} (ranks "
            f"{shown['allreduce_insitu_rank_min_ms']:.3f}-{shown['allreduce_insitu_rank_max_ms']:.3f})")


def host_frac_note(result: CellResult, shown: dict[str, float]) -> str:
    """'host_frac 0.613 [0.55, 0.68] host-bound', or why there is none: an impossible split
    (device time below zero or above the step: split_impossible) or an implausible one
    (split_implausible, with the checks it failed) has no host_frac (measure/stability.py)."""
    split, host_frac = result.split, shown.get("host_frac")
    if host_frac is None:
        if split.implausible and split.possible:
            return f"no host_frac (implausible: {', '.join(split.implausible)})"
        return f"no host_frac ({'device time < 0' if split.device_ms < 0 else 'host time < 0'})"
    # from the rounded metrics the table prints (format_ci), not the raw CI: one interval, one text
    ci = format_ci(shown.get("host_frac_ci_low"), shown.get("host_frac_ci_high"), 2)
    ci = f" {ci}" if ci else " (no CI)"
    return f"host_frac {host_frac:.3f}{ci} {split.regime}"


def largest_phase_note(result: CellResult) -> str:
    """', largest host phase forward_dispatch 0.55 of the host time (2.10 of 3.82 ms; phases
    name 1.00 of it)', or '' without phases or a host time to share. The phases come from the
    profiled pairs, whose steps the profiler slows; scaled to the timed step (PhaseSplit.scale)
    they are shares of the host_ms this line shows, not of a slower profiled step."""
    split = result.split
    phases = split.phases if split is not None else None
    if phases is None or phases.largest is None or split.host_ms <= 0 or not split_is_possible(result):
        return ""
    name, ms = phases.largest
    profiled_host_ms = split.profiled_step_ms - split.device_ms
    coverage = phase_metrics(phases, profiled_host_ms).get("attributed_frac_profiled")
    covered = f"; phases name {coverage:.2f} of it" if coverage is not None else ""
    return f", largest host phase {name} {ms / split.host_ms:.2f} of the host time ({ms:.2f} of {split.host_ms:.2f} ms{covered})"


def unstable_note(stability: Stability) -> str:
    """', UNSTABLE: foreign_cpu 0.31, drift' for a cell unstable for its own number, else ''
    (what its whole group met is group_note's, once a group)."""
    if stability.stable:
        return ""
    c = stability.contention
    named = {"foreign_cpu": f"foreign_cpu {c.foreign_cpu_frac:.2f}" if c is not None else "foreign_cpu"}
    reasons = [named.get(r, r) for r in stability.reasons]
    return f", UNSTABLE: {', '.join(reasons)}"


def group_note(stability: Optional[Stability]) -> str:
    """What a cell's whole group met, with its evidence: 'group_trend (the cells moved
    together 12 % over the rounds, the canary 1 %)', or '' when nothing was annotated."""
    if stability is None or not stability.annotations:
        return ""
    design = stability.design
    moves = ", ".join(f"{what} {pct:.0f} %" for what, pct in
                      (("the cells together moved", design.common_shift_pct if design else None),
                       ("the canary", design.canary_shift_pct if design else None)) if pct is not None)
    return f"{', '.join(stability.annotations)}" + (f" ({moves} over the rounds)" if moves else "")


def periods_note(stability: Optional[Stability]) -> str:
    """' (2 periods pooled: 5.10, 6.62 ms)' for a cell whose group was timed in more than one
    period (measure/group.py), else '': the table's number is then not one period's."""
    design = stability.design if stability is not None else None
    if design is None or design.periods < 2:
        return ""
    return f" ({design.periods} periods pooled: {', '.join(f'{m:.3f}' for m in design.period_medians_ms)} ms)"


# tracking.deliveries=null: cells logged at once to a server (recording_cost.py --deliveries:
# benchmarks/RESULTS.md), and to a database store, which takes one writer at a time (sqlite)
# and the cells waiting in one transaction.
SERVER_DELIVERIES, DATABASE_DELIVERIES = 4, 1


def deliveries(tracking_uri: str, configured: Optional[int]) -> int:
    """How many cells the uploader logs at once (tracking.deliveries, null: by the store)."""
    if configured is not None:
        return configured
    return SERVER_DELIVERIES if is_server(tracking_uri) else DATABASE_DELIVERIES


class SweepRecorder:
    """Receives each cell's final result from the dispatcher and records it."""

    def __init__(self, tracker: SweepTracker, journal: Journal, table: CellTable, claims: dict[str, Optional[str]],
                 tags: dict[str, str], total: int, outage_s: float, heartbeat_s: float, deliveries: int = 1,
                 stopping: Callable[[], bool] = lambda: False) -> None:
        """stopping: whether the sweep is being stopped (a stop signal came), so a result
        waiting for room in MLflow's full backlog stays in the journal instead."""
        self.tracker, self.journal, self.table, self.claims = tracker, journal, table, claims
        self.tags, self.total, self.stopping = tags, total, stopping
        self.noted_groups: set[str] = set()  # engine groups whose annotations were printed
        self.uploader: BackgroundLogger[Measured] = BackgroundLogger(
            self._deliver, tracker.heartbeat, outage_s, heartbeat_s, deliveries=deliveries,
            deliver_many=self._deliver_many, batch=tracker.cells_per_write())

    def on_result(self, result: CellResult) -> None:
        run_id = self.claims.get(result.key)
        planned = self.tracker.planned_run_id(result, run_id)
        entry = self.journal.measured(result, run_id, self.tags, planned)
        self.tracker.plan(entry, planned)
        crashpoints.reached("journaled")
        metrics = cell_metrics(result)  # once for the row and the line (a sweep of instant cells feels it)
        self.table.append(cell_row(result, planned or run_id or "", self.tags, metrics))
        crashpoints.reached("tabled")
        self.uploader.submit(Measured(entry, result, run_id, self.tags), self.stopping)
        level = logging.WARNING if result.status == "FAILED" else logging.INFO
        log.log(level, "[%d/%d] %s: %s", self.table.count, self.total, progress_label(result.params),
                describe(result, metrics))
        self._note_group(result)

    def _note_group(self, result: CellResult) -> None:
        """What the cell's group met, said once a group (its first cell reported), as a note:
        it marks no cell unstable (measure/stability.py, ANNOTATIONS)."""
        note = group_note(result.stability) if result.measurement is not None else ""
        group = engine_label(result.params)
        if note and group not in self.noted_groups:
            self.noted_groups.add(group)
            log.info("%s: group note: %s; no cell's flag (docs/measurement.md#group-annotations)", group, note)

    def _deliver(self, item: Measured) -> None:
        self._deliver_many([item])

    def _deliver_many(self, items: list[Measured]) -> None:
        """Cells waiting together, logged together (one transaction into a database store),
        once their journal entries are on disk."""
        self.journal.sync()
        run_ids = self.tracker.log_cells([(item.result, {**item.tags, JOURNAL_TAG: item.entry}, item.run_id)
                                          for item in items])
        for item, run_id in zip(items, run_ids):
            crashpoints.reached("uploaded")
            self.journal.logged(item.entry, run_id)
            self.table.set_run_id(item.result.key, run_id)
            self.tracker.delivered(item.entry)

    def should_stop(self) -> Optional[str]:
        return self.uploader.failure()

    def close(self, timeout_s: float, patient: bool = True, down_wait_s: Optional[float] = None) -> int:
        """Let MLflow take what is queued (BackgroundLogger.close); the count it did not take."""
        return self.uploader.close(timeout_s, patient, down_wait_s)

    def unreachable(self) -> bool:
        """Whether MLflow is refusing calls right now (or gave up on)."""
        return self.uploader.failure() is not None or self.uploader.down_since is not None


def upload_orphans(tracker: SweepTracker, own: Journal) -> int:
    """Log the cells earlier sweeps measured but MLflow never got (their journals' unlogged
    entries); returns how many. A journal still held by a running sweep is left alone.
    `own`, this sweep's journal, holds such cells when an earlier sweep died in the same
    run directory (the same command with a fixed hydra.run.dir): they go first. Call it
    before this sweep measures anything, so `own`'s unlogged entries are all earlier ones."""
    uploaded = _upload_unlogged(tracker, own)
    for journal in Journal.orphans(own.pointer.parent, own):
        try:
            uploaded += _upload_unlogged(tracker, journal)
        finally:
            journal.close()
    return uploaded


def _upload_unlogged(tracker: SweepTracker, journal: Journal) -> int:
    entries = journal.unlogged()
    for entry in entries:
        result = decode_result(entry["result"])
        run_id = tracker.upload(result, entry["tags"], entry["run_id"], entry["entry"], entry.get("planned_run_id"))
        journal.logged(entry["entry"], run_id)
        tracker.delivered(entry["entry"])
        log.info("uploaded %s from %s (measured by an earlier sweep, never logged)", result.key, journal.path)
    return len(entries)
