"""The comparison report of a study whose model could not be fitted (pure): why, which
cells were left out and for what, and what to run next.

A long study (the cross-TP one measures for minutes) must not end in a bare error after
measuring: its cells are in MLflow and cells.csv either way, and this report says what
kept the fit from being made, in the place the user was told to look.
"""
from __future__ import annotations

from collections import Counter

import pandas as pd

from hostsweep.model.unstable import Exclusion, left_out_mask, reasons_of
from hostsweep.report.document import Bullets, Document, Heading, Table, Text

# What to run when a reason left cells out of the fit, one line per reason.
REMEDIES = {
    "ci_width": "more pairs per cell (`measure.reps=24`) or engine starts (`measure.replicates=3`): the CI is "
                "wider than `measure.max_ci_pct`",
    "drift": "the cell's pairs moved against its companions' in the same rounds: `measure.remeasure_unstable=2` "
             "times the group again; if it recurs, the cell itself does not hold still (look at its raw pairs)",
    "foreign_cpu": "another process used the machine: stop it, or measure on a node of your own",
    "machine_speed": "the machine changed speed over the group's rounds (the canary, or every cell together; "
                     "a cloud VM's speed changes): measure again, or compare with `stage=diff diff.normalize=canary`",
    "replicate": "the group's first cell did not reproduce at the end of its rounds: the host changed; "
                 "measure again",
    "period": "a cell moved between periods differently from its group: measure it again",
}
FALLBACK = "`fit.exclude_unstable=false` fits on the flagged cells too (their flags stay in the report)"


def inconclusive_document(study: str, reason: str, cells: pd.DataFrame, exclusion: Exclusion,
                          command: str) -> Document:
    """The report: the verdict (inconclusive), the reason the fit gave, the cells by
    stability, and a remedy per reason that left cells out."""
    doc = Document(f"hostsweep comparison: {study} (inconclusive)")
    doc.add(Heading("Verdict"),
            Text(f"**inconclusive**: the model could not be fitted: {reason}"),
            Text(f"Cells: {exclusion.describe()}. Every measured cell is kept in MLflow and in `cells.csv` beside "
                 "this report; nothing needs measuring again to read them."),
            Text(f"Command: `{command}`"))
    counts = Counter(r for reasons in reasons_of(cells) for r in reasons)
    remedies = [f"`{r}` ({n} cell{'s' if n > 1 else ''}): {REMEDIES.get(r, 'see docs/measurement.md, Stability')}"
                for r, n in counts.most_common()]
    doc.add(Heading("What to run"), Bullets(tuple([*remedies, FALLBACK])))
    if not cells.empty:
        doc.add(Heading("Cells"), Table(left_out_table(cells), "Each measured cell and why it was left out, if it was."))
    return doc


def left_out_table(cells: pd.DataFrame) -> pd.DataFrame:
    """The cells' identity, step and stability, unstable ones first."""
    shown = [c for c in ("sku", "model", "mode", "tp", "batch", "ctx", "status", "step_ms", "step_ci_low_ms",
                         "step_ci_high_ms", "unstable_reasons") if c in cells.columns]
    table = cells[shown].copy()
    table.insert(len(shown), "left_out", left_out_mask(cells))
    return table.sort_values("left_out", ascending=False, kind="stable").reset_index(drop=True)
