"""The comparison report's study-wide mode sections, as a thin adapter (pure): graph
capture vs eager, FP8, n-gram speculative decoding, each against the eager cells of the
same (SKU, model, TP, batch, ctx). Where `hostsweep.report.modes` (the mode comparisons
of the sweep summary) is installed, its functions compute the tables; otherwise each
present mode gets the plain per-cell speedup. A mode with no cells is reported absent.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import pandas as pd

BASELINE = "eager"
# (mode option, section title, comparison kind in hostsweep.report.modes)
MODES = (("graph", "Graph capture vs eager: per-step reduction and its crossover batch", "graph"),
         ("fp8", "FP8 vs the baseline dtype: decode and prefill ratios", "fp8"),
         ("spec-ngram", "Speculative decoding (n-gram): speedup against acceptance", "spec"))
KEYS = ["sku", "model", "tp", "batch", "ctx", "workload"]


@dataclass
class ModeSection:
    title: str
    status: str  # "present" or why it is absent
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    summary: dict[str, float] = field(default_factory=dict)


def _comparisons():
    try:
        return importlib.import_module("hostsweep.report.modes")
    except ImportError:
        return None


def _plain(cells: pd.DataFrame, mode: str) -> tuple[dict[str, pd.DataFrame], dict[str, float]]:
    ours, base = cells[cells["mode"] == mode], cells[cells["mode"] == BASELINE]
    pairs = ours.merge(base, on=KEYS, suffixes=("_mode", "_base"))[KEYS + ["step_ms_base", "step_ms_mode"]]
    pairs["speedup"] = pairs["step_ms_base"] / pairs["step_ms_mode"]
    return {"cells": pairs}, {"mean_speedup": float(pairs["speedup"].mean()), "n_cells": float(len(pairs))}


def mode_sections(cells: pd.DataFrame) -> list[ModeSection]:
    """One section per known mode: its comparison with eager, or why it is absent."""
    cells = cells.assign(workload=cells["workload"] if "workload" in cells else "random")
    present = set(cells["mode"])
    comparisons = _comparisons()
    sections = []
    for mode, title, kind in MODES:
        if mode not in present:
            sections.append(ModeSection(title, f"absent: no {mode} cells in the selection"))
        elif BASELINE not in present:
            sections.append(ModeSection(title, f"absent: {mode} cells but no {BASELINE} cells to compare with"))
        elif comparisons is None:
            sections.append(ModeSection(title, "present", *_plain(cells, mode)))
        else:
            pairs = comparisons.paired(cells, mode, BASELINE)
            tables, summary = comparisons.COMPARISONS[kind](pairs) if len(pairs) else ({}, {})
            sections.append(ModeSection(title, "present" if len(pairs) else
                                        f"absent: no {mode} cell matches an {BASELINE} cell", tables, summary))
    return sections
