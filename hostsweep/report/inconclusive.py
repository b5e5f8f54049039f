"""The comparison report of a study whose model could not be fitted (pure): why, which
cells were left out and for what, and what to run next.

A long study (the cross-TP one measures for minutes) must not end in a bare error after
measuring: its cells are in MLflow and cells.csv either way, and this report says what
kept the fit from being made, in the place the user was told to look.
"""
from __future__ import annotations

from collections import Counter
from typing import Optional

import numpy as np
import pandas as pd

from hostsweep.config.schema import MeasureConfig
from hostsweep.measure.group import pairs_for_half_width
from hostsweep.measure.protocol import half_width_pct
from hostsweep.measure.unstable import Exclusion, left_out_mask, reasons_of
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
                          command: str, max_ci_pct: float = MeasureConfig.max_ci_pct) -> Document:
    """The report: the verdict (inconclusive), the reason the fit gave, the cells by
    stability, and a remedy per reason that left cells out (for ci_width, the pairs its
    cells would need: ci_width_remedy)."""
    doc = Document(f"hostsweep comparison: {study} (inconclusive)")
    doc.add(Heading("Verdict"),
            Text(f"**inconclusive**: the model could not be fitted: {reason}"),
            Text(f"Cells: {exclusion.describe()}. Every measured cell is kept in MLflow and in `cells.csv` beside "
                 "this report; nothing needs measuring again to read them."),
            Text(f"Command: `{command}`"))
    counts = Counter(r for reasons in reasons_of(cells) for r in reasons)
    remedy = {**REMEDIES, **({"ci_width": wide} if (wide := ci_width_remedy(cells, max_ci_pct)) else {})}
    remedies = [f"`{r}` ({n} cell{'s' if n > 1 else ''}): {remedy.get(r, 'see docs/measurement.md, Stability')}"
                for r, n in counts.most_common()]
    doc.add(Heading("What to run"), Bullets(tuple([*remedies, FALLBACK])))
    if not cells.empty:
        doc.add(Heading("Cells"), Table(left_out_table(cells), "Each measured cell and why it was left out, if it was."))
    return doc


def ci_width_remedy(cells: pd.DataFrame, max_ci_pct: float) -> Optional[str]:
    """What the ci_width cells would need, from their own CIs and pairs: a median's CI
    narrows as 1 / sqrt(pairs), so about n·(h / max_ci_pct)² pairs (pairs_for_half_width);
    None where the cells do not say how many pairs they had."""
    if "reps_used" not in cells:
        return None
    flagged = [("ci_width" in reasons) for reasons in reasons_of(cells)]
    rows = cells[flagged]
    width = [half_width_pct(m, low, high) for m, low, high in
             zip(rows["step_ms"], rows["step_ci_low_ms"], rows["step_ci_high_ms"])]
    needed = [pairs_for_half_width(float(h), int(n), max_ci_pct)
              for h, n in zip(width, rows["reps_used"]) if np.isfinite(h) and np.isfinite(n) and n > 0]
    if not needed:
        return None
    low, high = int(np.median(needed)), max(needed)
    about = f"about {high}" if low == high else f"{low} (median) to {high}"
    return (f"more pairs per cell: {about} pairs a cell would bring these within ±{max_ci_pct:g} % "
            f"(`measure.reps={high}`; a median's CI narrows as 1 / √pairs), or a larger `measure.T` where the "
            "prefill is most of a pair; the CI is wider than `measure.max_ci_pct`")


def left_out_table(cells: pd.DataFrame) -> pd.DataFrame:
    """The cells' identity, step and stability, unstable ones first."""
    shown = [c for c in ("sku", "model", "mode", "tp", "batch", "ctx", "status", "step_ms", "step_ci_low_ms",
                         "step_ci_high_ms", "unstable_reasons") if c in cells.columns]
    table = cells[shown].copy()
    table.insert(len(shown), "left_out", left_out_mask(cells))
    return table.sort_values("left_out", ascending=False, kind="stable").reset_index(drop=True)
