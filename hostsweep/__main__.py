"""The entry point: `python -m hostsweep [overrides]` or the `hostsweep` script.

Examples: `python -m hostsweep` (the embedded default on this machine),
`python -m hostsweep +sku=h200 tp=4 model=llama-3.1-8b`, `python -m hostsweep --cfg job`,
`python -m hostsweep +experiment=generalize-cpu stage=all` (sweep, fit, compare, report).
"""
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from hostsweep.config.options import check_group_overrides
from hostsweep.config.schema import ConfigError, register_configs

register_configs()

# Worst exit code over the jobs of this process: a multirun (-m) runs several sweeps
# in one process, so a job must not exit before the others have run.
_exit_codes: list[int] = [0]


@hydra.main(version_base="1.3", config_path="pkg://hostsweep.conf", config_name="config")
def _sweep(cfg: DictConfig) -> None:
    from hostsweep.stages import stage_module

    try:
        _exit_codes.append(stage_module(cfg).run(cfg, Path(HydraConfig.get().runtime.output_dir)))
    except ConfigError as exc:
        print(f"hostsweep: error: {exc}", file=sys.stderr)
        _exit_codes.append(2)


def main() -> None:
    try:
        check_group_overrides(sys.argv[1:])
    except ConfigError as exc:
        print(f"hostsweep: error: {exc}", file=sys.stderr)
        sys.exit(2)
    _sweep()
    sys.exit(max(_exit_codes))


if __name__ == "__main__":
    main()
