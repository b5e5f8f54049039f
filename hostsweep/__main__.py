"""The entry point: `python -m hostsweep [overrides]` or the `hostsweep` script.

Examples: `python -m hostsweep` (the embedded default on this machine),
`python -m hostsweep +sku=h200 tp=4 model=llama-3.1-8b`, `python -m hostsweep --cfg job`,
`python -m hostsweep +experiment=generalize-cpu stage=all` (sweep, fit, compare, report).
SIGTERM and SIGHUP (what `timeout`, SLURM and Kubernetes send) stop a sweep the way
Ctrl-C does: its runs are marked KILLED and its engines and Ray stopped.
"""
import gc
import logging
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from hostsweep.config.console import console_to_log_file
from hostsweep.config.keys import check_known_keys
from hostsweep.config.options import check_group_overrides
from hostsweep.config.presets import preset_help
from hostsweep.config.redact import redact, redact_console, redact_log_records
from hostsweep.config.schema import ConfigError, register_configs
from hostsweep.config.stages import stage_help
from hostsweep.run import signals

register_configs()
# Run directories are named by time and pid (conf/config.yaml), so two sweeps started in
# the same second never share one.
OmegaConf.register_new_resolver("pid", os.getpid, replace=True)
# --help lists the stages and presets from their own declarations (conf/config.yaml's
# help template): a new stage module or preset file is listed by being there.
OmegaConf.register_new_resolver("hostsweep_stages", stage_help, replace=True)
OmegaConf.register_new_resolver("hostsweep_presets", preset_help, replace=True)

# Worst exit code over the jobs of this process: a multirun (-m) runs several sweeps
# in one process, so a job must not exit before the others have run.
_exit_codes: list[int] = [0]
# A refused job leaves nothing behind: the folders Hydra made for it before it ran
# (its run directory, and the parents that were made for it) are removed at exit.
_STARTED = time.time()
# Where the command was started (hydra.job.chdir may move the job): only folders below it
# are ever removed besides a refused job's own run directory.
_LAUNCH_DIR = Path.cwd().resolve()
_refused: list[tuple[Path, set[Path]]] = []  # (run dir, the folders made for it)
_existing_run_dirs: set[Path] = set()  # hydra.run.dir values that existed before Hydra ran: kept


def redact_hydra_files(run_dir: Path) -> None:
    """Hydra saved the overrides (URIs with passwords included) before the job started."""
    for path in [*run_dir.glob(".hydra/*.yaml"), run_dir.parent / "multirun.yaml"]:
        if path.is_file():
            text = path.read_text()
            if redact(text) != text:
                path.write_text(redact(text))


def check_output_dir(argv: list[str]) -> None:
    """hydra.run.dir / hydra.sweep.dir must be writable: Hydra creates it before the job
    starts, and a failure there is a traceback, not a message."""
    from hostsweep.record.store import check_writable_folder

    for arg in argv:
        key, _, value = arg.partition("=")
        if key.lstrip("+") in ("hydra.run.dir", "hydra.sweep.dir") and value:
            check_writable_folder(Path(value), key.lstrip("+"))
            if Path(value).is_dir():
                _existing_run_dirs.add(Path(value).resolve())
    check_writable_folder(Path.cwd(), "the current folder (outputs/ goes there)")


HYDRA_ONLY = {".hydra", "hostsweep.log"}  # what Hydra writes into a run directory before the job runs


def hydra_only(run_dir: Path) -> bool:
    """Whether run_dir holds nothing but Hydra's saved config and the run's log."""
    return {p.name for p in run_dir.iterdir()} <= HYDRA_ONLY


def made_for_this_job(run_dir: Path) -> Optional[set[Path]]:
    """The folders Hydra made for this job: run_dir and those of its parents (outputs/<date>/,
    a multirun's sweep folder) that changed since this process started; None when run_dir
    already held something (a rerun into the same hydra.run.dir), which is never removed.
    Called as the job starts, when Hydra has written only .hydra/ and opened an empty log."""
    run_dir = run_dir.resolve()
    log = run_dir / "hostsweep.log"
    if not hydra_only(run_dir) or (log.exists() and log.stat().st_size):
        return None
    made = {run_dir}
    for parent in run_dir.parents:
        # 1 s of slack: some file systems keep whole-second times
        if not parent.is_relative_to(_LAUNCH_DIR) or parent == _LAUNCH_DIR or parent.stat().st_mtime < _STARTED - 1:
            break
        made.add(parent)
    return made


def discard_refused_runs() -> None:
    """Remove the run directories of refused jobs, and the folders made for them that
    nothing else has come to use (a parent is removed only once it is empty)."""
    if not _refused:
        return
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for handler in list(getattr(logger, "handlers", [])):  # Hydra's file log, else it reopens on the next record
            if isinstance(handler, logging.FileHandler) and any(
                    Path(handler.baseFilename).is_relative_to(run_dir) for run_dir, _ in _refused):
                logger.removeHandler(handler)
                handler.close()
    for run_dir, made in _refused:  # resolved paths
        if run_dir in _existing_run_dirs:  # the user's folder (empty before): only what Hydra put there goes
            shutil.rmtree(run_dir / ".hydra", ignore_errors=True)
            (run_dir / "hostsweep.log").unlink(missing_ok=True)
            continue
        shutil.rmtree(run_dir, ignore_errors=True)
        folder = run_dir.parent
        while folder in made and folder.is_dir():
            # a multirun whose every job was refused: its sweep folder holds only multirun.yaml
            if [p.name for p in folder.iterdir()] == ["multirun.yaml"]:
                (folder / "multirun.yaml").unlink()
            if any(folder.iterdir()):
                break
            folder.rmdir()
            folder = folder.parent


@hydra.main(version_base="1.3", config_path="pkg://hostsweep.conf", config_name="config")
def _sweep(cfg: DictConfig) -> None:
    from hostsweep.record.store import retry_chatter_to_log_file

    retry_chatter_to_log_file()  # Hydra has just set up the console and file handlers
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    redact_hydra_files(run_dir)
    made = made_for_this_job(run_dir)
    with console_to_log_file():  # hostsweep.log holds what the console showed, printed lines too
        _run_stage(cfg, run_dir, made)


def _run_stage(cfg: DictConfig, run_dir: Path, made: Optional[set[Path]]) -> None:
    from hostsweep.stages import stage_module

    try:
        _exit_codes.append(stage_module(cfg).run(cfg, run_dir))
    except ConfigError as exc:
        print(f"hostsweep: error: {redact(str(exc))}", file=sys.stderr)  # a message may quote any override
        _exit_codes.append(2)
        # a refusal after results were written (stage=all: the comparison refused after the
        # sweep measured) keeps the run directory: only what Hydra made alone is removed
        if made is not None and hydra_only(run_dir):
            _refused.append((run_dir.resolve(), made))
    except KeyboardInterrupt:
        signum = signals.received() or signal.SIGINT
        print(f"hostsweep: interrupted by {signal.Signals(signum).name}: its runs are marked KILLED; measured cells "
              f"are kept in {run_dir}; rerun the same command to resume", file=sys.stderr)
        sys.exit(128 + signum)


def main() -> None:
    redact_console()
    redact_log_records()
    signals.install()
    try:
        check_group_overrides(sys.argv[1:])
        check_known_keys(sys.argv[1:])
        check_output_dir(sys.argv[1:])
    except ConfigError as exc:
        print(f"hostsweep: error: {redact(str(exc))}", file=sys.stderr)
        sys.exit(2)
    _sweep()
    discard_refused_runs()
    # The interpreter's last garbage collection walks every object the libraries left
    # (pandas, MLflow, Ray, matplotlib): a second after the results are printed, for memory
    # the OS frees anyway. Frozen objects are skipped; atexit handlers still run.
    gc.freeze()
    sys.exit(max(_exit_codes))


if __name__ == "__main__":
    main()
