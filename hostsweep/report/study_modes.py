"""The comparison report's study-wide mode sections, as a thin adapter (pure): every mode the
selected cells hold, each against the baseline mode's cells of the same (SKU, model, TP,
batch, ctx, workload), computed by the sweep summary's mode comparisons
(`hostsweep.report.modes`). The modes come from the data, never from a list of names: the
comparison a mode gets (graph capture, FP8, speculative decoding, or a plain ratio) follows
from the engine arguments its cells logged against the baseline's.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from hostsweep.report import modes as comparisons

BASELINE = "eager"
# What each comparison kind (hostsweep.report.modes.COMPARISONS) shows, for a section's title.
KIND_TITLES = {"graph": "graph capture: per-step reduction and its crossover batch",
               "fp8": "quantized: decode and prefill ratios",
               "spec": "speculative decoding: speedup against acceptance",
               "ratio": "per-step ratio and its host/device split"}


@dataclass
class ModeSection:
    title: str
    status: str  # "present" or why it is absent
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    summary: dict[str, float] = field(default_factory=dict)


def mode_sections(cells: pd.DataFrame, baseline: str = BASELINE) -> list[ModeSection]:
    """One section per mode in the cells besides `baseline`: its comparison with the baseline,
    or why it cannot be made; one absent section when the cells hold no other mode."""
    cells = cells.assign(workload=cells["workload"] if "workload" in cells else "random")
    found = comparisons.modes_in(cells, baseline)
    if not found:
        return [ModeSection(f"Modes against {baseline}", f"absent: no mode other than {baseline} in the selection")]
    has_baseline = baseline in set(cells["mode"])
    sections = []
    for mode, _, kind in found:
        title = f"{mode} vs {baseline}: {KIND_TITLES[kind]}"
        if not has_baseline:
            sections.append(ModeSection(title, f"absent: {mode} cells but no {baseline} cells to compare with"))
            continue
        pairs = comparisons.paired(cells, mode, baseline)
        tables, summary = comparisons.COMPARISONS[kind](pairs) if len(pairs) else ({}, {})
        sections.append(ModeSection(title, "present" if len(pairs) else
                                    f"absent: no {mode} cell matches an {baseline} cell", tables, summary))
    return sections
