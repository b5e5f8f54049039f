"""The comparison stage's MLflow run: `compare-<study>` in the study's experiment, beside
the sweeps it reads, holding the report (report.md, report.html), its figures and the
fit.json it was built from as artifacts, and its verdicts as params and metrics.

The run is opened first (so the report can name its own run id) with its real start
time, and closed with its end time, so the UI's Duration is the stage's.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Optional

from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

from hostsweep.record.tracking import SweepTracker

NOTE_LIMIT = 8000  # MLflow truncates a run tag (the description) beyond this


class ReportRun:
    def __init__(self, tracking_uri: str, experiment: str, run_name: str, tags: dict[str, str]) -> None:
        tracker = SweepTracker(tracking_uri, experiment)  # creates the experiment where needed
        self.client: MlflowClient = tracker.client
        self.experiment_id = tracker.experiment_id
        run = self.client.create_run(self.experiment_id, start_time=int(time.time() * 1000), run_name=run_name,
                                     tags={"hostsweep.kind": "compare", **tags})
        self.run_id, self.run_name = run.info.run_id, run_name

    def log(self, folder: Path, params: dict[str, object], metrics: dict[str, float], note: Optional[str]) -> None:
        """Params, finite metrics, the description (`mlflow.note.content`, shown on the run
        page) and every file under `folder` as artifacts."""
        self.client.log_batch(self.run_id, params=[Param(k, str(v)[:500]) for k, v in params.items()],
                              metrics=[Metric(k, float(v), int(time.time() * 1000), 0) for k, v in metrics.items()
                                       if v is not None and math.isfinite(float(v))])
        if note:
            self.client.set_tag(self.run_id, "mlflow.note.content", note[:NOTE_LIMIT])
        self.client.log_artifacts(self.run_id, str(folder))

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status, end_time=int(time.time() * 1000))

    def artifacts(self, path: str = "") -> list[str]:
        return [f.path for f in self.client.list_artifacts(self.run_id, path)]


def load_fit_json(tracking_uri: str, run_id: str) -> str:
    """fit.json of a logged fit run (stage=fit, hostsweep-model fit)."""
    import mlflow

    mlflow.set_tracking_uri(tracking_uri)
    return mlflow.artifacts.load_text(f"runs:/{run_id}/fit.json")
