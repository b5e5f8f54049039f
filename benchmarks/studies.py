"""Studies for benchmarks, not a benchmark by itself: one `python -m hostsweep` study in a
fresh folder of its own, for benchmarks that compare whole runs (noisy_neighbour.py,
split_repro.py: its own MLflow store, pending folder and run directory, its console kept
beside them); and a study composed in-process with its cells, for benchmarks that drive a
worker directly (phase_cost.py, idle_partner.py, ...)."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from hostsweep.config.grid import Cell, build_cells
from hostsweep.config.resolve import Study, resolve
from hostsweep.config.schema import register_configs


def composed_study(overrides: list[str]) -> tuple[Study, list[Cell]]:
    """The study the shipped config tree composes with `overrides` (one grammar: Hydra's),
    resolved and validated, and its cells."""
    from hydra import compose, initialize_config_module

    register_configs()
    with initialize_config_module("hostsweep.conf", version_base="1.3"):
        study = resolve(compose("config", overrides=overrides))
    return study, build_cells(study)


def run_study(folder: Path, study: str, overrides: list[str],
              on_line: Optional[Callable[[str], None]] = None) -> Path:
    """Run the study in `folder` (kept: a folder whose cells.csv exists is not run again);
    returns the run directory. `on_line` hears every console line as it comes (e.g. to start
    a neighbour once the engine is ready). Exits with the console's path when it fails."""
    run_dir = folder / "run"
    if (run_dir / "cells.csv").is_file():
        return run_dir
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "hostsweep", f"study={study}", f"tracking.uri=sqlite:///{folder / 'mlflow.db'}",
           f"output.pending_dir={folder / 'pending'}", f"hydra.run.dir={run_dir}", *overrides]
    started = time.time()
    with (folder / "console.txt").open("w") as console:
        proc = subprocess.Popen(cmd, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            console.write(line)
            if on_line is not None:
                on_line(line)
        rc = proc.wait()
    print(f"  {study}: exit {rc} in {time.time() - started:.0f} s ({folder / 'console.txt'})", flush=True)
    if rc != 0 or not (run_dir / "cells.csv").is_file():
        sys.exit(f"{study}: hostsweep exited {rc}; see {folder / 'console.txt'}")
    return run_dir
