"""A driver that dies (os._exit, as kill -9 leaves it) at each point of a cell's recording,
then the same sweep run again: every cell measured before the death is kept exactly once
(one FINISHED MLflow run with the metrics it was measured with, one row in the rerun's
cells.csv, `resumed`), none is measured twice, and the rerun measures the rest, without
waiting for the dead driver's claims to go stale (default tracking.stale_after_s=300).

The crashed driver is a real process: a subprocess running the sweep stage on the
in-process fake backend (tests/fakes.py; no Ray, which costs ~30 s a start here) with
HOSTSWEEP_CRASH_AT set (hostsweep/record/crashpoints.py). The rerun runs in this process,
where the fake backend says which cells it measured. The rerun goes to a new run directory
(the default: named by time and pid) or to the crashed one (a fixed hydra.run.dir).
tests/integration/test_crash_recording_cli.py does one of these through `python -m
hostsweep` and Ray."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from hostsweep.record.crashpoints import ENV, EXIT_CODE
from hostsweep.record.journal import JOURNAL_FILE
from hostsweep.stages import sweep
from tests.conftest import compose_raw
from tests.crashes import assert_kept_once, measured_entries
from tests.fakes import FakeBackend

REPO = Path(__file__).resolve().parents[2]
CELLS = 6
ARGS = ["+sku=cpu", "engine.name=fake", "measure.T=5", "measure.reps=3", "measure.warmups=1", "ctx=[16]",
        f"batch=[{','.join(str(b) for b in range(1, CELLS + 1))}]",
        "split.enabled=false", "ray.exclusive=false"]
DRIVER = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    from tests.conftest import compose_raw
    from tests.fakes import FakeBackend
    from hostsweep.stages import sweep
    run_dir = Path(sys.argv[2])
    sys.exit(sweep.run(compose_raw(sys.argv[3:]), run_dir, FakeBackend(run_dir / "work")))
""")
# (point, n, where the rerun writes): the n-th arrival at the point kills the driver. Every
# point with a new run dir; with the same one, an unlogged cell with a row already in that
# cells.csv (tabled; the CLI test reruns mid-upload into the same run dir). "uploading" twice:
# through MLflow's API (a server's path: the run is left half logged, RUNNING) and written
# straight to the sqlite store (dbwrite.py: the artifacts are written, the run is not).
CRASHES = [("journaled", 3, "new"), ("tabled", 3, "new"), ("uploading", 2, "new"), ("uploading", 2, "api"),
           ("uploaded", 2, "new"), ("tabled", 3, "same")]


def crash_driver(args: list[str], run_dir: Path, cwd: Path, point: str, nth: int,
                 api: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, ENV: f"{point}:{nth}", "HOSTSWEEP_FAKE_TIME_SCALE": "0.01"}
    writes = ["tracking.direct_writes=false"] if api else []  # MLflow's API, as against a server
    return subprocess.run([sys.executable, "-c", DRIVER, str(REPO), str(run_dir), *args, *writes], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """One sqlite store for every crash (a study each): created once, here, not by each driver."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('store')}/mlflow.db"
    MlflowClient(uri).search_experiments()
    return uri


@pytest.mark.parametrize("point,nth,rerun_in", CRASHES, ids=[f"{p}-{where}-dir" for p, _, where in CRASHES])
def test_a_driver_killed_while_recording_loses_no_cell_and_its_rerun_measures_none_twice(
        point, nth, rerun_in, store, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the pending folder (outputs/pending) is the cwd's
    study = f"crash-{point}-{rerun_in}"
    args = [*ARGS, f"tracking.uri={store}", f"study={study}"]
    first = tmp_path / "first"
    crashed = crash_driver(args, first, tmp_path, point, nth, api=rerun_in == "api")
    assert crashed.returncode == EXIT_CODE, crashed.stderr[-3000:]
    assert f"{ENV}={point}:{nth} reached" in crashed.stderr
    kept = measured_entries(first / JOURNAL_FILE)
    assert nth <= len(kept) < CELLS if point in ("journaled", "tabled") else nth <= len(kept) <= CELLS
    rows = pd.read_csv(first / "cells.csv")["cell_key"] if (first / "cells.csv").is_file() else pd.Series()
    assert rows.is_unique and set(rows) <= set(kept)
    if point == "journaled":  # the n-th cell died between its journal line and its row
        assert len(rows) == len(kept) - 1
    dead_rows = pd.read_csv(first / "cells.csv") if (first / "cells.csv").is_file() else pd.DataFrame()

    again = first if rerun_in == "same" else tmp_path / "again"
    backend = FakeBackend(tmp_path / "work")
    writes = ["tracking.direct_writes=false"] if rerun_in == "api" else []
    assert sweep.run(compose_raw([*args, *writes]), again, backend) == 0

    grid = [c.key for c in sweep.build_cells(sweep.resolve_sweep(compose_raw(args)))]
    assert sorted(backend.measured) == sorted(set(grid) - set(kept))  # the rest, each once; nothing kept again
    assert_kept_once(store, study, grid, kept, first, again / "cells.csv",
                     half_logged=point == "uploading" and rerun_in == "api")
    assert not list((tmp_path / "outputs" / "pending").rglob("*.json"))
    if rerun_in == "new" and len(dead_rows):  # written straight into the store: a row names its run from the start
        client = MlflowClient(store)
        experiment = client.get_experiment_by_name(f"hostsweep-{study}")
        logged = {r.data.tags["cell_key"]: r.info.run_id
                  for r in client.search_runs([experiment.experiment_id], "attributes.status = 'FINISHED'")
                  if "cell_key" in r.data.tags}
        assert dict(zip(dead_rows["cell_key"], dead_rows["mlflow_run_id"])) == {k: logged[k] for k in dead_rows["cell_key"]}
