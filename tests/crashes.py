"""What a sweep killed while recording must leave once the same sweep has run again, as
checks shared by the fake-backend test (tests/unit/test_crash_recording.py) and the CLI
one (tests/integration/test_crash_recording_cli.py)."""
from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from hostsweep.measure.results import cell_metrics
from hostsweep.record.claims import KILLED_REASON_TAG
from hostsweep.record.journal import JOURNAL_FILE, decode_result, read_entries, unlogged
from hostsweep.record.views import JOURNAL_TAG


def cell_runs(store: str, study: str) -> pd.DataFrame:
    """Every cell run of the study: id, status, cell key, journal entry, why KILLED, metrics."""
    client = MlflowClient(store)
    experiment = client.get_experiment_by_name(f"hostsweep-{study}")
    runs = client.search_runs([experiment.experiment_id], max_results=1000)
    return pd.DataFrame([{"run_id": r.info.run_id, "status": r.info.status, "key": r.data.tags.get("cell_key"),
                          "entry": r.data.tags.get(JOURNAL_TAG), "killed": r.data.tags.get(KILLED_REASON_TAG),
                          "metrics": r.data.metrics} for r in runs if "cell_key" in r.data.tags])


def measured_entries(journal: Path) -> dict[str, dict]:
    """A journal's "measured" entries by cell key; a key measured twice fails the test."""
    measured = [e for e in read_entries(journal) if e["event"] == "measured"]
    keys = [e["result"]["key"] for e in measured]
    assert len(keys) == len(set(keys)), f"a cell was measured twice: {keys}"
    return {e["result"]["key"]: e for e in measured}


def assert_kept_once(store: str, study: str, grid: list[str], kept: dict[str, dict], crashed_dir: Path,
                     table: Path, half_logged: bool) -> None:
    """After the rerun: each cell of `grid` has one FINISHED run and one row in `table` (the
    rerun's cells.csv); each cell `kept` (journal entries of the crashed driver) is that
    run, with the metrics it was measured with, and its row is `resumed`; nothing is left
    RUNNING and the crashed journal has nothing unlogged. `half_logged`: the crash left a
    run with metrics but never FINISHED, which must now be KILLED."""
    runs = cell_runs(store, study)
    finished = runs[runs["status"] == "FINISHED"]
    assert Counter(finished["key"]) == Counter(grid)  # one FINISHED run per cell: none lost, none twice
    assert set(runs["status"]) <= {"FINISHED", "KILLED"}  # nothing left RUNNING by the dead driver
    by_key = finished.set_index("key")
    for key, entry in kept.items():
        run = by_key.loc[key]
        assert run["entry"] == entry["entry"]  # the journal's measurement, not a new one
        measured = {k: v for k, v in cell_metrics(decode_result(entry["result"])).items() if math.isfinite(v)}
        assert run["metrics"] == pytest.approx(measured)
    if half_logged:
        half = runs[(runs["status"] == "KILLED") & runs["entry"].notna() & (runs["metrics"].map(len) > 0)]
        assert len(half) == 1 and "is gone" in half.iloc[0]["killed"], half
    rows = pd.read_csv(table)
    assert Counter(rows["cell_key"]) == Counter(grid)  # the whole study, each cell once
    rows = rows.set_index("cell_key")
    assert {key: bool(rows.loc[key, "resumed"]) for key in grid} == {key: key in kept for key in grid}
    assert {key: rows.loc[key, "mlflow_run_id"] for key in grid} == {key: by_key.loc[key, "run_id"] for key in grid}
    assert not unlogged(read_entries(crashed_dir / JOURNAL_FILE))
