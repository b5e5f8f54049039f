"""The comparison report's study-wide mode sections, as a thin adapter (pure): graph
capture vs eager, FP8, n-gram speculative decoding, each against the eager cells of the
same (SKU, model, TP, batch, ctx), computed by the sweep summary's mode comparisons
(`hostsweep.report.modes`). A mode with no cells is reported absent.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from hostsweep.report import modes as comparisons

BASELINE = "eager"
# (mode option, section title, comparison kind in hostsweep.report.modes)
MODES = (("graph", "Graph capture vs eager: per-step reduction and its crossover batch", "graph"),
         ("fp8", "FP8 vs the baseline dtype: decode and prefill ratios", "fp8"),
         ("spec-ngram", "Speculative decoding (n-gram): speedup against acceptance", "spec"))


@dataclass
class ModeSection:
    title: str
    status: str  # "present" or why it is absent
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    summary: dict[str, float] = field(default_factory=dict)


def mode_sections(cells: pd.DataFrame) -> list[ModeSection]:
    """One section per known mode: its comparison with eager, or why it is absent."""
    cells = cells.assign(workload=cells["workload"] if "workload" in cells else "random")
    present = set(cells["mode"])
    sections = []
    for mode, title, kind in MODES:
        if mode not in present:
            sections.append(ModeSection(title, f"absent: no {mode} cells in the selection"))
        elif BASELINE not in present:
            sections.append(ModeSection(title, f"absent: {mode} cells but no {BASELINE} cells to compare with"))
        else:
            pairs = comparisons.paired(cells, mode, BASELINE)
            tables, summary = comparisons.COMPARISONS[kind](pairs) if len(pairs) else ({}, {})
            sections.append(ModeSection(title, "present" if len(pairs) else
                                        f"absent: no {mode} cell matches an {BASELINE} cell", tables, summary))
    return sections
