"""A diff's result (DiffResult) and the release gate it answers: which cells fail fail_on,
when the gate refuses to judge, and the one line that says why (pure)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import pandas as pd

from hostsweep.compare.match import Difference, unmatched_label
from hostsweep.compare.options import GATED, DiffOptions, by_rounds
from hostsweep.compare.start_pairs import floor_text

@dataclass
class DiffResult:
    options: DiffOptions
    matched_on: list[str]
    differs: list[Difference]
    shared: dict[str, str]  # provenance both sides share
    label_dims: list[str]  # the matching dims that vary across matched cells (labels, groups)
    cells: pd.DataFrame  # one row per (matched cell, quantity)
    unmatched: pd.DataFrame
    summary: dict[str, dict[str, Any]] = field(default_factory=dict)  # per quantity
    warnings: list[str] = field(default_factory=list)
    between: dict[str, str] = field(default_factory=dict)  # per side, the between-start component's source
    machine: Optional[str] = None  # the sides' speed canaries compared (compare/canary.py)
    canary_ms: dict[str, Optional[float]] = field(default_factory=dict)  # per side
    design: str = ""  # one line: paired, sequential, or how many of each (design_line)
    noise_floor_pct: Optional[float] = None  # a paired diff's between-start spread (SD, %): NoiseFloor
    noise_floor_df: float = 0.0
    against: str = ""  # a paired study's side b overrides (pair_against), "" for an A/A or two studies

    def noise_floor_line(self) -> Optional[str]:
        """What a paired diff says of the machine's between-start spread, or None."""
        if self.noise_floor_pct is None or not math.isfinite(self.noise_floor_pct):
            return None
        x = floor_text(self.noise_floor_pct)
        return (f"between-start spread on this machine: {x} % (SD, {int(self.noise_floor_df)} df): a sequential diff "
                f"of two studies measured apart can pass diff.noise_floor_pct={x} (a lower bound: studies measured "
                "further apart drift more)")

    def instance_line(self) -> Optional[str]:
        """What a paired A/A by rounds says of the engine-instance effect, or None: each side ran
        on one instance, so its geometric mean (before any instance floor) is one draw of the
        ratio between two instances of one configuration; the SD over repeated A/As is what
        diff.instance_floor_pct takes."""
        rows = self._gated()
        if self.against or rows.empty or not by_rounds(rows).all() or \
                {d.name for d in self.differs} - {"side"}:
            return None
        logs = np.log(rows["ratio"].to_numpy(float))
        logs = logs[np.isfinite(logs)]
        if not logs.size:
            return None
        shift = math.expm1(float(np.mean(logs))) * 100
        return (f"instance effect this paired A/A shows: {shift:+.1f} % (the geometric mean of its cells, one "
                "instance a side): one draw of what two engine instances differ by; the SD over repeated A/As is "
                "what diff.instance_floor_pct takes")

    def _gated(self) -> pd.DataFrame:
        return self.cells[self.cells["quantity"] == GATED] if len(self.cells) else self.cells

    def missing(self) -> pd.DataFrame:
        """Base cells the head lacks, or whose head run FAILED: a gate fails on them."""
        u = self.unmatched
        return u[u["side"] == "base"] if len(u) else u

    def failing(self) -> pd.DataFrame:
        """The GATED rows fail_on fails on. slower: every cell judged slower, and every
        unstable cell slower on its own test (_slower_alone). inconclusive: every cell not
        shown stable and same or faster."""
        rows = self._gated()
        if self.options.fail_on is None or rows.empty:
            return rows.iloc[0:0]
        if self.options.fail_on == "slower":
            return rows[(rows["verdict"] == "slower") | self._slower_alone(rows)]
        return rows[rows["unstable"] | ~rows["verdict"].isin(("same", "faster"))]

    def _slower_alone(self, rows: pd.DataFrame) -> pd.Series:
        """Unstable rows whose own one-sided test puts them beyond 1 + threshold at alpha, without
        Holm: a regression that also made its cell noisy is not let through by the family's
        protection, and an unchanged noisy cell fails no more often than alpha (a point ratio past
        the threshold, which an A/A's wide CIs cross by chance, is no evidence)."""
        p = pd.to_numeric(rows.get("p_slower", pd.Series(math.nan, index=rows.index)), errors="coerce")
        return rows["unstable"].astype(bool) & (p < self.options.alpha) & (rows["verdict"] != "slower")

    def refusal(self) -> Optional[str]:
        """Why the gate cannot judge at all (one line, what to run), or None."""
        rows = self._gated()
        if self.options.fail_on is None or rows.empty:
            return None
        blind = rows[rows["between"].str.contains("no between-start estimate", regex=False)]
        if blind.empty:
            return None
        return (f"diff.fail_on={self.options.fail_on}: {len(blind)} cell(s) have a side measured in one engine start "
                "with no between-start estimate, so no false-alarm rate can be stated; measure both studies with "
                "measure.replicates=3, or give diff.noise_floor_pct (the step's spread between engine starts, from "
                "an A/A diff of this machine)")

    def gate(self) -> tuple[bool, str]:
        """(failed, why) under fail_on. Fails on failing() cells, on base cells the head lacks
        or FAILED, when the gate refuses, and when there is no cell to judge."""
        if self.options.fail_on is None:
            return False, ""
        refused = self.refusal()
        if refused:
            return True, refused
        rows, failing, missing, t = self._gated(), self.failing(), self.missing(), self.options.threshold_pct
        s = self.summary.get(GATED, {})
        level = f"{s.get('judged', 0)} cell(s) judged at family-wise alpha {self.options.alpha:g} (Holm)"
        why = []
        if len(failing):
            alone = self._slower_alone(failing)
            named = [c + (f" (unstable: {r or 'reason not recorded'}"
                          + (f"; slower on its own test, p {p:.3g} < {self.options.alpha:g} without Holm" if a else "")
                          + ")" if u else "")
                     for c, u, r, a, p in zip(failing["cell"], failing["unstable"], failing["unstable_reasons"],
                                              alone, failing["p_slower"])]
            why.append(f"{len(failing)} cell(s) {self.options.fail_on} (±{t:g}%): {', '.join(named)}")
        if len(missing):
            why.append(f"{len(missing)} base cell(s) missing from head: "
                       + ", ".join(f"{unmatched_label(r, self.label_dims)} ({r['reason'].split(' with ')[0]})"
                                   for r in missing.to_dict("records")))
        if why:
            return True, "; ".join(why) + f"; {level}"
        if rows.empty:
            return True, "no matched cell to judge"
        return False, f"{level}, none {self.options.fail_on} (±{t:g}%)"

