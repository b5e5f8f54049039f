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
import signal
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from hostsweep.config.keys import check_known_keys
from hostsweep.config.options import check_group_overrides
from hostsweep.config.redact import redact, redact_log_records
from hostsweep.config.schema import ConfigError, register_configs
from hostsweep.stages import signals

register_configs()
# Run directories are named by time and pid (conf/config.yaml), so two sweeps started in
# the same second never share one.
OmegaConf.register_new_resolver("pid", os.getpid, replace=True)

# Worst exit code over the jobs of this process: a multirun (-m) runs several sweeps
# in one process, so a job must not exit before the others have run.
_exit_codes: list[int] = [0]


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
    check_writable_folder(Path.cwd(), "the current folder (outputs/ goes there)")


@hydra.main(version_base="1.3", config_path="pkg://hostsweep.conf", config_name="config")
def _sweep(cfg: DictConfig) -> None:
    from hostsweep.stages import stage_module

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    redact_hydra_files(run_dir)
    try:
        _exit_codes.append(stage_module(cfg).run(cfg, run_dir))
    except ConfigError as exc:
        print(f"hostsweep: error: {redact(str(exc))}", file=sys.stderr)  # a message may quote any override
        _exit_codes.append(2)
    except KeyboardInterrupt:
        signum = signals.received() or signal.SIGINT
        print(f"hostsweep: interrupted by {signal.Signals(signum).name}: its runs are marked KILLED; measured cells "
              f"are kept in {run_dir}; rerun the same command to resume", file=sys.stderr)
        sys.exit(128 + signum)


def main() -> None:
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
    # The interpreter's last garbage collection walks every object the libraries left
    # (pandas, MLflow, Ray, matplotlib): a second after the results are printed, for memory
    # the OS frees anyway. Frozen objects are skipped; atexit handlers still run.
    gc.freeze()
    sys.exit(max(_exit_codes))


if __name__ == "__main__":
    main()
