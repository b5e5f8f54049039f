"""Claims between the live sweeps of a study, and the RUNNING runs of sweeps that are gone
marked KILLED, on MLflow.

Which cells live sweeps have claimed (claims.<n> tags on their parent runs), the reaping
of stale runs with the reason as a tag, the parent run's heartbeat, and the cells a sweep
claimed but will not measure. claims.py decides what is live and who wins a cell; this
module reads and writes the runs it decides on.

LiveRuns is a base of SweepTracker (tracking.py); its state is set up there.
"""
from __future__ import annotations

import time
from typing import Any, Iterable, Mapping

from mlflow.entities import RunTag

from hostsweep.record.claims import (
    CLAIMS_TAG, HEARTBEAT_TAG, KILLED_REASON_TAG, OWNER_TAG, PARENT_TAG, RunView, claim_batches, claim_winner,
    parse_claims, stale_reason,
)
from hostsweep.record.experimentruns import ExperimentRuns

RUNNING = "attributes.status = 'RUNNING'"
# The tags whether a RUNNING run is live depends on (claims.py); a RunView keeps only these
# (and a sweep's batched claims, tags named claims.<n>).
LIVENESS_TAGS = (PARENT_TAG, "cell_key", HEARTBEAT_TAG, OWNER_TAG)
# Tags one log_batch may carry (MLflow's limit), and a tag value's length.
BATCH_TAGS = 100
TAG_VALUE_LIMIT = 8000
# On a sweep's parent run: how many claimed cells it did not measure, and which.
NOT_MEASURED_TAG, NOT_MEASURED_FILE = "not_measured", "not_measured.txt"


def run_view(run: Any) -> RunView:
    """What liveness needs of an MLflow run, with only the tags it reads (LIVENESS_TAGS)."""
    tags = run.data.tags
    kept = {k: v for k, v in tags.items() if k in LIVENESS_TAGS or k.startswith(CLAIMS_TAG)}
    return RunView(run.info.run_id, run.info.status, kept, run.info.start_time)


class LiveRuns(ExperimentRuns):
    """Claims between the sweeps of one study, and the reaping of runs whose sweep is gone."""

    claim_tags: int  # claims.<n> tags this sweep has written on its parent run

    def running_runs(self) -> tuple[list[RunView], dict[str, RunView]]:
        """The RUNNING runs of the experiment, and every run they name as parent, by id."""
        views = [run_view(r) for page in self._pages(RUNNING) for r in page]
        known = {v.run_id: v for v in views}
        for parent_id in {v.tags[PARENT_TAG] for v in views if PARENT_TAG in v.tags} - set(known):
            try:
                known[parent_id] = run_view(self.client.get_run(parent_id))
            except Exception:  # noqa: BLE001 - a deleted parent: its children are stale
                pass
        return views, known

    def reap_stale(self, stale_after_s: float) -> list[tuple[str, str]]:
        """Mark KILLED, with the reason as a tag, every RUNNING run whose sweep is gone."""
        views, known = self.running_runs()
        now, reaped = time.time(), []
        for view in views:
            reason = stale_reason(view, known, now, stale_after_s)
            if reason:
                self.client.set_tag(view.run_id, KILLED_REASON_TAG, f"marked KILLED by a later sweep: {reason}")
                self.client.set_terminated(view.run_id, status="KILLED")
                reaped.append((view.run_id, reason))
        return reaped

    def live_claims(self, stale_after_s: float) -> dict[str, list[RunView]]:
        """Claims of live sweeps, by cell key: the cells listed in a live sweep's claims.<n>
        tags (one view per cell, its time the claim's), and RUNNING cell runs of live
        sweeps (a cell being logged, or the claim run of a hostsweep before batched claims)."""
        views, known = self.running_runs()
        now, claims = time.time(), {}
        for view in views:
            if stale_reason(view, known, now, stale_after_s):
                continue
            if "cell_key" in view.tags:
                claims.setdefault(view.tags["cell_key"], []).append(view)
            elif PARENT_TAG not in view.tags:  # a live sweep: its batched claims
                for claimed_at, key in parse_claims(view.tags):
                    claims.setdefault(key, []).append(
                        RunView(view.run_id, "RUNNING", {PARENT_TAG: view.run_id, "cell_key": key}, claimed_at))
        return claims

    def claim(self, cells: Mapping[str, dict[str, object]] | Iterable[tuple[str, dict[str, object]]],
              stale_after_s: float) -> tuple[dict[str, None], dict[str, str]]:
        """Claim each cell (key -> params, or (key, params) pairs) not claimed by another
        live sweep: the keys go on this sweep's parent run as claims.<n> tags, about 150 to
        a tag and 100 tags to a log_batch (10,000 cells: one call), so claiming costs no
        run per cell. Returns (the keys claimed (-> None: no run yet; a cell's run is
        created when it is logged), key -> the other sweep's parent run id)."""
        if self.parent_run_id is None:
            raise RuntimeError("claim() needs the sweep's parent run (start_sweep)")
        taken = self.live_claims(stale_after_s)
        mine: dict[str, None] = {}
        asked = [key for key, _ in (cells.items() if isinstance(cells, Mapping) else cells)]
        for batch in claim_batches((k for k in asked if k not in taken), self.claim_tags, BATCH_TAGS,
                                   TAG_VALUE_LIMIT):
            stamp = int(time.time() * 1000)  # a claim's time is when it is written (claim_winner)
            tags = [RunTag(name, f"{stamp}\n" + "\n".join(batch_keys)) for name, batch_keys in batch]
            self.client.log_batch(self.parent_run_id, tags=tags)
            self.claim_tags += len(tags)
            for _, batch_keys in batch:
                mine.update(dict.fromkeys(batch_keys))
        # Two sweeps may claim one cell at once: every sweep keeps the earliest claim only.
        others: dict[str, str] = {}
        live = self.live_claims(stale_after_s)
        for key in asked:
            claims = live.get(key)
            if not claims:
                continue
            winner = claim_winner(claims)
            if winner.tags.get(PARENT_TAG) != self.parent_run_id:
                others[key] = winner.tags.get(PARENT_TAG, "?")
                mine.pop(key, "")
        return mine, others

    def release(self, keys: Iterable[str], reason: str) -> int:
        """Cells this sweep claimed and will not measure: their count (0 too) and reason on
        the parent run (not_measured, not_measured_reason) and their keys in not_measured.txt;
        its claims end with the parent run."""
        left = list(keys)
        if self.parent_run_id is None:
            return len(left)
        tags = [RunTag(NOT_MEASURED_TAG, str(len(left)))] + ([RunTag(f"{NOT_MEASURED_TAG}_reason", reason[:5000])]
                                                              if left else [])
        self.client.log_batch(self.parent_run_id, tags=tags)
        if left:
            self.client.log_text(self.parent_run_id, "\n".join(left) + "\n", NOT_MEASURED_FILE)
        return len(left)

    def heartbeat(self) -> None:
        if self.parent_run_id is not None:
            self.client.set_tag(self.parent_run_id, HEARTBEAT_TAG, f"{time.time():.0f}")
