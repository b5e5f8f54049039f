"""One sweep end to end: validate, preflight, plan, check the cluster, claim, measure,
record, print.

Order matters: everything that can reject the input runs before Ray starts (resolve,
then preflight), and the cluster is checked before any actor is created, so bad input
costs seconds. Before measuring, the study's experiment is put in order: cells an
earlier sweep measured but never logged are uploaded from its journal, RUNNING runs of
dead sweeps are marked KILLED, finished cells are skipped (if they measured everything
this sweep asks for) and the rest are claimed, so a concurrent sweep skips them. That is
done in a thread of its own (StudyOpening) while Ray (a local cluster) and the engines
start: the plan of a 10,000-cell study costs no more than Ray's start. A joined cluster is
asked whether it can run the grid first, so a grid it refuses leaves nothing in MLflow.
"""
from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import sys
import threading
import time
from concurrent.futures import Future
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import pandas as pd

from omegaconf import DictConfig, OmegaConf

from hostsweep.config.grid import Cell, build_cells, group_by_engine, partner_keys, rounds_partners, runnable
from hostsweep.config.pairing import against_text
from hostsweep.config.redact import error_line, redact
from hostsweep.config.resolve import Study, resolve
from hostsweep.config.schema import ConfigError
from hostsweep.config.vllm_fields import ENGINE_ARG_FIELDS
from hostsweep.config.stages import StageInfo
from hostsweep.engines.vllm_engine import engine_arg_fields
from hostsweep.measure.results import PART_METRICS, MeasureOptions, missing_parts, requested_parts, skipped_result
from hostsweep.record.celltable import CellTable, ResumedRows
from hostsweep.record.claims import PARENT_TAG
from hostsweep.record.journal import JOURNAL_FILE, Journal, pending_folder
from hostsweep.record.preflight import check_memory, preflight, record_cluster
from hostsweep.record.provenance import driver_tags
from hostsweep.record.recorder import SweepRecorder, deliveries, upload_orphans
from hostsweep.record.store import serve_artifacts_from
from hostsweep.record.views import experiment_description, varying_axes
from hostsweep.compare import diff_options
from hostsweep.report.modes import finished_cells, mode_pairs, study_summary
from hostsweep.report.sweep_outputs import engines_label, print_results, write_results
from hostsweep.run import cluster, signals
from hostsweep.run.dispatch import Dispatcher, WorkerBackend
from hostsweep.run.faults import FaultPolicy
from hostsweep.run.progress import ProgressReporter
from hostsweep.run.rounds import ROUNDS_FOLDER
from hostsweep.run.hygiene import descendant_pids, freeze_long_lived
from hostsweep.run.winddown import WindDown
from hostsweep.run.worklog import worker_log_folder

STAGE = StageInfo(name="sweep", help="measure the grid and record every cell to MLflow and the run directory",
                  sections=("measure", "split", "linearity", "engine", "ray", "faults", "output", "report"),
                  docs="measurement.md")

if TYPE_CHECKING:  # MLflow (1.5 s to import) loads only once a sweep records: bad input fails fast
    from hostsweep.record.tracking import SweepTracker

log = logging.getLogger(__name__)

# What opening a study in MLflow gives a sweep: its tracker, the cells still to measure, the
# resumed cells (their rows read after the plan), and its claims (cell key -> None).
Opened = tuple["SweepTracker", list[Cell], ResumedRows, dict[str, Optional[str]]]
# Seconds MLflow gets to take the queued cells at the end: a normal end waits out a short
# outage (up to tracking.outage_s), an interrupted one does not keep the user waiting.
INTERRUPTED_DRAIN_S = 10.0


def experiment_name(study: Study) -> str:
    return study.experiment


def sweep_run_name(study: Study, cells: list[Cell]) -> str:
    """e.g. 'keystone-cpu: cpu/small-llama/eager/tp1': what its cells' names leave out."""
    return f"{study.config.study}: {engines_label(study, [c.engine.tp for c in cells] or [1])}"


def sweep_params(study: Study, cells: list[Cell]) -> dict[str, object]:
    cfg = study.config
    return {
        "study": cfg.study, "sku": ",".join(s.name for s in study.skus), "model": ",".join(m.name for m in study.models),
        "mode": ",".join(m.name for m in study.modes), "workload": ",".join(cfg.workload),
        "tp": sorted({c.engine.tp for c in cells}), "batch": sorted({c.batch for c in cells}),
        "ctx": sorted({c.ctx for c in cells}), "T": cfg.measure.T, "reps": cfg.measure.reps,
        "warmups": cfg.measure.warmups, "engine": cfg.engine.name, "n_cells": len(cells),
        **({"pair_against": against_text(cfg.pair.against) or "A/A", "pair_starts": cfg.pair.starts}
           if cfg.pair.paired else {}),
    }


def record_study_summary(study: Study, rows: pd.DataFrame, tracker: SweepTracker) -> None:
    """Mode comparisons and the TP floor over the whole study, on the parent run."""
    pairs = mode_pairs((m.name, m.baseline, m.engine_args) for m in study.modes)
    try:
        tables, metrics = study_summary(finished_cells(rows), pairs, study.config.report.crossover_threshold)
        if tables or metrics:
            tracker.log_study_summary(tables, metrics)
            log.info("study summary: %s", ", ".join(f"{k}={v:.3g}" for k, v in sorted(metrics.items())))
    except Exception as exc:  # noqa: BLE001 - a summary must never cost the measurements
        log.warning("study summary skipped: %s", error_line(exc))


def skip_finished(cells: list[Cell], tracker: SweepTracker, options: MeasureOptions) -> tuple[list[Cell], ResumedRows]:
    """The cells still to measure, and the runs of those an earlier run FINISHED with
    everything this sweep asks for (split, linearity, py-spy); the others are measured
    again. Decided on each run's cell key and the names of its metrics alone: the rows of
    the resumed cells are read afterwards (ResumedRows), while measuring starts."""
    finished = tracker.finished_index([PART_METRICS[part] for part in sorted(requested_parts(options))])
    complete: dict[str, str] = {}  # cell key -> its FINISHED run with every part asked for
    for cell in cells:
        runs = finished.get(cell.key, [])
        done = [run for run in runs if not missing_parts(options, run.metric_keys)]
        if done:
            complete[cell.key] = done[0].run_id
        elif runs:
            lacks = ", ".join(missing_parts(options, runs[0].metric_keys))
            log.info("%s: its FINISHED run %s has no %s, which this sweep asks for: measuring it again",
                     cell.key, runs[0].run_id, lacks)
    # A paired cell is compared with its partner start by start: one whose partner is not
    # finished is measured again with it, never paired with starts of another sweep.
    for key, partner in partner_keys(cells).items():
        if key in complete and partner not in complete:
            log.info("%s: measured again with its paired cell %s, which is not finished", key, partner)
            del complete[key]
    remaining = [cell for cell in cells if cell.key not in complete]
    resumed = [complete[cell.key] for cell in cells if cell.key in complete]
    if resumed:
        log.info("resuming: %d of %d cells already FINISHED in experiment %s are skipped "
                 "(resume=false measures them again)", len(resumed), len(cells), tracker.experiment_id)
    return remaining, ResumedRows(tuple(resumed))


def tidy_experiment(tracker: SweepTracker, study: Study, journal: Journal) -> None:
    """Upload what earlier sweeps measured but never logged (from their journals, and from
    this sweep's `journal` when one died in this run directory); mark their dead runs KILLED."""
    uploaded = upload_orphans(tracker, journal)
    if uploaded:
        log.warning("uploaded %d cell(s) an earlier sweep measured but never logged (MLflow down, or the sweep died)",
                    uploaded)
    for run_id, reason in tracker.reap_stale(study.config.tracking.stale_after_s):
        log.warning("run %s was left RUNNING and is marked KILLED: %s", run_id, reason)


def claim_cells(tracker: SweepTracker, cells: list[Cell],
                stale_after_s: float) -> tuple[list[Cell], dict[str, Optional[str]]]:
    """Claim the cells to measure (in batches, on the parent run); those another live sweep
    holds are left to it."""
    mine, others = tracker.claim(((c.key, {}) for c in cells), stale_after_s)
    for key, parent in others.items():
        log.warning("%s is being measured by another sweep (run %s): skipped", key, parent)
    return [c for c in cells if c.key in mine], mine


@contextmanager
def tracking_answers(uri: str) -> Iterator[None]:
    """MLflow failing while the sweep sets up (before anything is measured): one line."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - MlflowException, requests, sqlalchemy...
        raise ConfigError(f"tracking.uri={redact(uri)} failed before anything was measured: {error_line(exc)}") from None


def resolve_sweep(raw_cfg: DictConfig) -> Study:
    """The study, or ConfigError on bad input before Ray starts; engine_args are checked
    against the installed vLLM's EngineArgs where the driver has vLLM, else the shipped
    snapshot; the diff section too (diff.threshold_pct=-5 once ran a whole sweep, exit 0)."""
    study = resolve(raw_cfg, engine_arg_fields() or ENGINE_ARG_FIELDS)
    diff_options(study.config.diff)  # the sweep's paired diff and its gate read it: checked before anything runs
    return study


def run(raw_cfg: DictConfig, run_dir: Path, backend: Optional[WorkerBackend] = None) -> int:
    """Run the sweep the config describes; return the process exit code. `backend`: where
    workers run (default: Ray, a local cluster unless ray.address is set)."""
    study = resolve_sweep(raw_cfg)
    cfg = study.config
    serve_artifacts_from(cfg.tracking.artifacts)
    machine_lock = preflight(study, run_dir)  # ConfigError if the world says no, still before Ray
    try:
        grid = build_cells(study)
        log.info("%d cells on %d engine(s), dtype %s%s", len(grid), len(group_by_engine(runnable(grid))), study.dtype_why,
                 f"; preload {study.preload_why}" if study.preload_why else "")
        check_memory(study, grid)
        if backend is not None:
            return _sweep(study, grid, run_dir, backend, StudyOpening(study, raw_cfg, grid, run_dir))
        # A local cluster is this machine, whose SKUs preflight has checked: MLflow's side is
        # planned while Ray starts. A joined cluster may still refuse the grid (check_feasible):
        # that is bad input, which must leave nothing in MLflow, so its plan waits for the check
        # (joining takes about a second; the plan still overlaps the engines' start).
        opening = None if cfg.ray.address else StudyOpening(study, raw_cfg, grid, run_dir)
        try:
            asked = time.monotonic()
            started_here = cluster.connect(cfg.ray.address, cfg.ray.confine_daemons, cfg.ray.idle_daemons,
                                           log_to_driver=cfg.verbose, connect_timeout_s=cfg.ray.connect_timeout_s)
        except BaseException as exc:
            if opening is not None:
                opening.abandon(f"Ray did not start: {error_line(exc)}")
            raise
        log.info("Ray: %s in %.1f s", "started a local cluster" if started_here else f"joined {cfg.ray.address}",
                 time.monotonic() - asked)
        if started_here:
            record_cluster(machine_lock, descendant_pids(os.getpid()))
        try:
            try:
                cluster.check_feasible(group_by_engine(runnable(grid)), cluster.live_nodes())
            except BaseException as exc:
                if opening is not None:
                    opening.abandon(error_line(exc))
                raise
            opening = opening or StudyOpening(study, raw_cfg, grid, run_dir)
            from hostsweep.run.backend import RayBackend

            backend = RayBackend(worker_log_folder(run_dir, study.config.verbose))
            wind_down = WindDown(backend.finish_closing, partial(cluster.disconnect, started_here))
            return _sweep(study, grid, run_dir, backend, opening, wind_down, own_process=True)
        finally:
            cluster.disconnect(started_here)
    finally:
        if machine_lock is not None:
            machine_lock.close()


class StudyOpening:
    """The study's MLflow side before measuring (open_study), in a thread of its own from
    the moment the grid is known: a first 10,000-cell sweep claims its cells, and a resumed
    one finds its finished cells, while Ray and the engines start. Once planned, the same
    thread reads the resumed cells' rows for the cell table while measuring begins. The
    journal is made here, in the caller's thread: a run directory another sweep uses is refused
    before anything starts."""

    def __init__(self, study: Study, raw_cfg: DictConfig, grid: list[Cell], run_dir: Path) -> None:
        cfg = study.config
        self.started = time.time()  # when the sweep began, for the console and summary.json
        pending = pending_folder(Path(cfg.output.pending_dir), cfg.tracking.uri, experiment_name(study))
        # Workers keep each cell's timed pairs there until it is reported: a rerun continues them.
        self.options = dataclasses.replace(MeasureOptions.of(cfg), rounds_dir=str((pending / ROUNDS_FOLDER).resolve()))
        self.journal = Journal.create(run_dir / JOURNAL_FILE, pending)  # refuses a run dir another sweep uses
        self._future: Future[Opened] = Future()
        # a daemon: a driver stopped while Ray starts does not wait on MLflow to exit
        threading.Thread(target=self._open, args=(study, raw_cfg, grid, run_dir), name="open-study",
                         daemon=True).start()

    def _open(self, study: Study, raw_cfg: DictConfig, grid: list[Cell], run_dir: Path) -> None:
        try:
            opened = open_study(study, raw_cfg, grid, run_dir, self.options, self.journal, self.started)
        except BaseException as exc:  # noqa: BLE001 - handed to the thread that waits for it
            self._future.set_exception(exc)
            return
        self._future.set_result(opened)
        tracker, _, resumed, _ = opened
        if resumed.rows.done():  # resume=false: nothing to read
            return
        try:  # measuring starts meanwhile; the cell table waits for these rows before it is read
            resumed.rows.set_result(tracker.resumed_rows(resumed.run_ids))
        except BaseException as exc:  # noqa: BLE001 - the table says what it lacks
            resumed.rows.set_exception(exc)

    def result(self) -> Opened:
        """What open_study returned, once done; its error (the journal closed) if it failed."""
        try:
            return self._future.result()
        except BaseException:
            self.journal.close()
            raise

    def abandon(self, reason: str) -> None:
        """The sweep stops before measuring (Ray or the cluster said no): the opening is
        waited for and its parent run ended FAILED, its claims released with `reason`."""
        try:
            tracker, _, _, claims = self.result()
        except BaseException:  # noqa: BLE001 - the error the caller raises is the one to show
            return
        try:
            tracker.end()
            tracker.release(list(claims), f"not measured: {reason}")
            tracker.finish_sweep("FAILED", {"cells_done": 0.0})
        except Exception as exc:  # noqa: BLE001 - the next sweep marks a run left RUNNING
            log.warning("could not end the sweep's MLflow run: %s", error_line(exc))
        finally:
            self.journal.close()


def open_study(study: Study, raw_cfg: DictConfig, grid: list[Cell], run_dir: Path, options: MeasureOptions,
               journal: Journal, started: float) -> Opened:
    """The study's MLflow side before measuring: the tracker, the cells still to measure,
    the resumed cells (their rows not yet read), and this sweep's claims. `started`: when the sweep began."""
    cfg = study.config
    with tracking_answers(cfg.tracking.uri):
        from hostsweep.record.tracking import SweepTracker

        tracker = SweepTracker(cfg.tracking.uri, experiment_name(study), experiment_description(cfg.study),
                               cfg.tracking.direct_writes)
        tracker.check_artifacts()
        tidy_experiment(tracker, study, journal)
        cells, resumed = skip_finished(grid, tracker, options) if cfg.resume else (grid, ResumedRows.of([]))
        tracker.start_sweep(sweep_run_name(study, grid), redact(OmegaConf.to_yaml(raw_cfg)),
                            sweep_params(study, cells), {**driver_tags(), "run_dir": str(run_dir)},
                            varying_axes([c.params() for c in grid]))
        cells, claims = claim_cells(tracker, cells, cfg.tracking.stale_after_s)
    # Planned: what is left is claimed; Ray and the engines may still be starting.
    log.info("planned: %d cell(s) to measure, %d resumed, %.1f s after the sweep began", len(runnable(cells)),
             resumed.count, time.time() - started)
    return tracker, cells, resumed, claims


def _sweep(study: Study, grid: list[Cell], run_dir: Path, backend: WorkerBackend, opening: StudyOpening,
           wind_down: Optional[WindDown] = None, own_process: bool = False) -> int:
    """wind_down: what ends the workers (default: the backend's closes) and, from `run`, the
    local cluster; begun as soon as measuring ends. own_process: the driver is this process's
    only sweep (Ray's path), so what lives before measuring is frozen (freeze_long_lived);
    an in-process backend's sweep, a test's, is not."""
    cfg = study.config
    wind_down = wind_down or WindDown(backend.finish_closing)
    started, options, journal = opening.started, opening.options, opening.journal
    # Engines start (actor, vLLM import, engine init: tens of seconds) while MLflow is opened,
    # earlier cells are looked up and claims are made; those left with nothing to do go back.
    try:
        # a paired study's side b waits for its turn, or (paired rounds) starts in side a's worker
        # (run/dispatch.py): its engines are not prestarted on their own
        partners = rounds_partners(runnable(grid))
        b_first = study.config.pair.start_first == "b"
        prestarted = {spec: (backend.start(spec, partners.get(spec), b_first and spec in partners), backend.now())
                      for spec in group_by_engine(runnable(grid)) if spec.side != "b"}
    except BaseException as exc:
        opening.abandon(f"an engine could not be started: {error_line(exc)}")
        raise
    try:
        tracker, cells, resumed, claims = opening.result()
    except BaseException:
        for worker, _ in prestarted.values():
            backend.release(worker)
        raise
    needed = group_by_engine(runnable(cells))
    for spec in [s for s in prestarted if s not in needed]:
        backend.release(prestarted.pop(spec)[0])
    table = CellTable(run_dir / cfg.output.cells_file, resumed)
    tags = {**driver_tags(), PARENT_TAG: tracker.parent_run_id or ""}
    recorder = SweepRecorder(tracker, journal, table, claims, tags, len(cells), cfg.tracking.outage_s,
                             cfg.tracking.heartbeat_s, deliveries(cfg.tracking.uri, cfg.tracking.deliveries),
                             stopping=lambda: signals.received() is not None)

    def should_stop() -> Optional[str]:
        signals.check()  # a stop signal whose KeyboardInterrupt was swallowed on the way
        return recorder.should_stop()

    for cell in cells:  # a mode the SKU cannot run: recorded with its reason, never dispatched
        if cell.skip is not None:
            recorder.on_result(skipped_result(cell.key, cell.params(), cell.skip))
    to_run = runnable(cells)
    if prestarted:  # engines take tens of seconds to start: load matplotlib for the figures meanwhile
        importlib.import_module("hostsweep.report.figures")
    if own_process:  # the libraries, the plan and the claims stay until the sweep ends: frozen,
        # the full collections while measuring walk only what the cells allocate (at 10,000
        # instant cells they were about 3 % of the driver's time)
        freeze_long_lived()
    dispatcher = Dispatcher(to_run, options, recorder.on_result, backend, FaultPolicy.of(cfg.faults),
                            ProgressReporter(sum(c.replicates for c in to_run)), should_stop,
                            worker_log_folder(run_dir, cfg.verbose), prestarted, cfg.pair.start_first == "b")
    try:  # the workers (and Ray) end while the sweep records and writes its results
        return _measure_and_record(study, grid, run_dir, dispatcher, recorder, tracker, claims, tags, started,
                                   wind_down.begin)
    finally:
        wind_down.finish()


def _measure_and_record(study: Study, grid: list[Cell], run_dir: Path, dispatcher: Dispatcher,
                        recorder: SweepRecorder, tracker: SweepTracker, claims: dict[str, Optional[str]],
                        tags: dict[str, str], started: float, measured: Callable[[], None]) -> int:
    cfg, table, journal = study.config, recorder.table, recorder.journal
    status, stop = "KILLED", "sweep interrupted"
    try:
        dispatcher.run()
        measured()
        stop = dispatcher.stopped
        if not stop and not recorder.unreachable():  # an unreachable store would only add retries
            record_study_summary(study, table.study_frame(grid), tracker)
        failed = table.failed()
        status = "FAILED" if failed or stop else "FINISHED"
    finally:
        unlogged = close_records(tracker, recorder, journal, claims, status, stop, cfg.tracking.outage_s,
                                 cfg.tracking.exit_wait_s)
    mlflow_up = not (recorder.uploader.failure() or unlogged)
    rows = table.study_frame(grid)  # read once: the summary, the figures and the console show the same rows
    summary = write_results(study, tracker, table, rows, run_dir, status, tags, started, mlflow_up)
    # with MLflow down, the summary names where the cells are, not a parent run that lacks them
    store = tracker.store_label()
    unrecorded = None if mlflow_up else (
        f"MLflow: not recorded to MLflow ({store} did not answer): {unlogged} measured cell(s) kept in the journal "
        f"{journal.path}" if unlogged else f"MLflow: {store} stopped answering; every measured cell is in MLflow, "
        "but the sweep's runs may be left RUNNING (the next sweep of the study marks them)")
    print_results(rows, table.resumed_count, tracker, table, summary, unrecorded, study.config.measure.ci_level, study.dtype_why,
                  study.preload_why)
    if stop:
        print(f"hostsweep: stopped early: {stop}; {unlogged} measured cell(s) are kept in {journal.path} for MLflow: "
              "rerun the same command to upload them and measure the rest", file=sys.stderr)
    elif unlogged:  # every cell was measured; only MLflow is missing some
        print(f"hostsweep: {unlogged} measured cell(s) not recorded to MLflow, kept in the journal {journal.path}: "
              "rerun the same command once MLflow answers to upload them", file=sys.stderr)
    code = 0 if status == "FINISHED" and not unlogged else 1
    if study.side_b is not None and not stop and mlflow_up and tracker.parent_run_id:
        return max(code, paired_diff(study, tracker, run_dir))
    return code


def paired_diff(study: Study, tracker: SweepTracker, run_dir: Path) -> int:
    """A paired study's sweep ends with its diff, side a against side b (stages/diff.py): the
    verdicts and, with diff.fail_on, the gate's exit code. What was measured is recorded
    already: a diff that cannot be made is one line and exit 1, never a lost sweep."""
    from hostsweep.stages.diff import paired_diff_of_sweep

    cfg = study.config
    print(f"\npaired diff: side b ({cfg.pair.against and against_text(cfg.pair.against) or 'the same configuration: A/A'}) "
          f"against side a, {'round by round' if cfg.pair.design == 'rounds' else 'start pair by start pair'}")
    try:
        return paired_diff_of_sweep(tracker.tracking_uri, experiment_name(study), str(tracker.parent_run_id), cfg.diff,
                                    run_dir, cfg.noise.experiment)[1]
    except Exception as exc:  # noqa: BLE001 - the sweep is recorded; the diff can be rerun from MLflow
        print(f"hostsweep: error: the paired diff failed ({error_line(exc)}); the sweep is recorded: rerun it with "
              f"python -m hostsweep stage=diff diff.base={tracker.parent_run_id}", file=sys.stderr)
        return 1


def close_records(tracker: SweepTracker, recorder: SweepRecorder, journal: Journal, claims: dict[str, Optional[str]],
                  status: str, stop: Optional[str], outage_s: float, exit_wait_s: Optional[float] = None) -> int:
    """Drain the MLflow queue, end the claims of unmeasured cells and the parent run; the
    count of measured cells MLflow did not take (they stay in the journal). An unreachable
    MLflow is waited for exit_wait_s at most (tracking.exit_wait_s), not the whole outage_s."""
    interrupted = status == "KILLED"
    unlogged = (recorder.close(INTERRUPTED_DRAIN_S, patient=False) if interrupted
                else recorder.close(outage_s, down_wait_s=exit_wait_s))
    tracker.end()
    down = recorder.uploader.failure() or (unlogged and "MLflow did not answer")
    if not down:
        try:
            measured = recorder.table.measured_keys()
            tracker.release([key for key in claims if key not in measured],
                            f"not measured: {stop or 'sweep interrupted'}")
            tracker.finish_sweep(status, {"cells_done": float(recorder.table.count)})
        except Exception as exc:  # noqa: BLE001 - the journal and cells.csv have every measured cell
            log.error("could not close the sweep's MLflow runs: %s", error_line(exc))
    left = journal.close()
    return left
