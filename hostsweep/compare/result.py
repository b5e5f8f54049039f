"""A diff's result (DiffResult) and the release gate it answers: which cells fail fail_on,
when the gate refuses to judge, and the one line that says why (pure)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import pandas as pd

from hostsweep.compare import rules as R
from hostsweep.compare.match import Difference, unmatched_label
from hostsweep.compare.options import GATED, DiffOptions, by_rounds
from hostsweep.compare.floors import floor_text

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
        if self.options.fail_on in (None, "slower_overall") or rows.empty:  # the overall gate judges the mean
            return rows.iloc[0:0]
        if self.options.fail_on == "slower":
            return rows[(rows["verdict"] == "slower") | self._slower_alone(rows)]
        return rows[rows["unstable"] | ~rows["verdict"].isin(("same", "faster"))]

    def _slower_alone(self, rows: pd.DataFrame) -> pd.Series:
        """Unstable rows slower by the rule in force on their own one-sided test at alpha / (the
        gated unstable cells), without Holm: a regression that also made its cell noisy is not let
        through by the family's protection, and unchanged noisy cells fail no more often than alpha
        together (a point ratio past the threshold, which an A/A's wide CIs cross by chance, is no
        evidence)."""
        p = pd.to_numeric(rows.get("p_slower", pd.Series(math.nan, index=rows.index)), errors="coerce")
        # under `significant` p tests no change: the point must lie beyond the threshold too, as for any cell
        beyond = rows["ratio"] > 1 + self.options.threshold_pct / 100 if self.options.rule == "significant" else True
        unstable = rows["unstable"].astype(bool)
        # Bonferroni over the unstable cells: their own tests, m of them at alpha / m, fail an A/A
        # at most alpha of the time together (at alpha each, 6 noisy cells failed 12 % of A/As)
        level = self.options.alpha / max(int(self._gated()["unstable"].astype(bool).sum()), 1)
        return unstable & (p < level) & beyond & (rows["verdict"] != "slower")

    def refusal(self) -> Optional[str]:
        """Why the gate cannot judge (one line, what to add), or None: a side with no
        between-start estimate (no false-alarm rate can be stated, so not even a failure is
        trusted); else, when nothing fails, a gated cell with no test (point only) or one (the
        geometric mean, for slower_overall) whose MDE under the rule exceeds
        diff.max_mde_factor x the threshold: a pass would say nothing of the change the gate
        line names."""
        rows = self._gated()
        if self.options.fail_on is None or rows.empty:
            return None
        gate = f"diff.fail_on={self.options.fail_on}"
        blind = rows[rows["between"].str.contains("no between-start estimate", regex=False)]
        if len(blind):
            return (f"{gate}: {len(blind)} cell(s) have a side measured in one engine start "
                    "with no between-start estimate, so no false-alarm rate can be stated; measure both studies with "
                    "measure.replicates=3, or give diff.noise_floor_pct (the step's spread between engine starts, "
                    "from an A/A diff of this machine)")
        if self.options.fail_on == "inconclusive" or self._found():
            return None  # an untested cell fails that gate already; a regression found fails, whatever else
        return self._powerless(rows, gate)

    def _found(self) -> bool:
        """Whether the gate has a failure to report: a failing cell, a missing head cell, or a
        slower release (slower_overall)."""
        overall = self.options.fail_on == "slower_overall" and self.summary.get(GATED, {}).get("overall") == "slower"
        return bool(len(self.failing()) or len(self.missing()) or overall)

    def _powerless(self, rows: pd.DataFrame, gate: str) -> Optional[str]:
        """Why a pass would be vacuous (one line, what to add), or None."""
        untested = rows[~rows["test"].isin(("t", "sign"))]
        if len(untested):
            return (f"{gate}: {len(untested)} gated cell(s) have no test ({_names(untested['cell'])}: "
                    f"{', '.join(sorted(set(untested['ci_source'])))}), so a pass would say nothing about them; "
                    "re-measure them with their raw_timings.csv kept (a study's cells with raw pairs on both sides), "
                    "or leave them out with diff.filter")
        bound = self.options.max_mde_pct
        if self.options.fail_on == "slower_overall":
            mde = self.summary.get(GATED, {}).get("overall_mde_pct", math.inf)
            if not mde <= bound:
                return (f"{gate}: the geometric mean's MDE under rule {self.options.rule} is {_pct(mde)}, above "
                        f"diff.max_mde_factor x threshold = {bound:g} %: it could not have seen a {self.threshold_text()} "
                        "slowdown of the release; add cells or rounds (measure.reps) or engine starts, or raise "
                        "diff.max_mde_factor")
            return None
        blunt = rows[~(pd.to_numeric(rows["mde_pct"], errors="coerce").fillna(math.inf) <= bound)]
        if len(blunt):
            worst = blunt.sort_values("mde_pct", ascending=False)
            return (f"{gate}: {len(blunt)} of {len(rows)} gated cell(s) have an MDE under rule {self.options.rule} "
                    f"above diff.max_mde_factor x threshold = {bound:g} % (up to {_pct(worst['mde_pct'].iloc[0])}: "
                    f"{_names(worst['cell'])}), so a pass would not mean no {self.threshold_text()} slowdown; add "
                    f"rounds (measure.reps) or engine starts (measure.replicates, pair.starts) to those cells, judge "
                    "fewer cells at once (diff.filter), or, for paired rounds, measure this machine's "
                    "diff.instance_floor_pct (a floor set too wide widens every cell)")
        return None

    def threshold_text(self) -> str:
        return f"+{self.options.threshold_pct:g} %"

    def power_line(self) -> str:
        """What the gate could have seen, under the rule in force: the change found 80 % of the
        time in any judged cell (the largest MDE; the median cell's beside it), or of the whole
        release for slower_overall."""
        s = self.summary.get(GATED, {})
        if self.options.fail_on == "slower_overall":
            return (f"a {_pct(s.get('overall_mde_pct', math.inf), '+')} change of the whole release (geometric mean) "
                    "would have been found 80 % of the time")
        return (f"a {_pct(s.get('mde_pct_max', math.inf), '+')} change in any judged cell would have been found 80 % "
                f"of the time ({_pct(s.get('mde_pct_median', math.inf), '+')} in the median cell)")

    def gate_line(self) -> str:
        """The gate's one line: 'diff.fail_on=X: pass|FAIL: why', or 'REFUSED (exit 2)' with
        what to add when a pass would mean nothing (refusal); '' without a gate."""
        if self.options.fail_on is None:
            return ""
        gate = f"diff.fail_on={self.options.fail_on}"
        refused = self.refusal()
        if refused:
            return f"{gate}: REFUSED (exit 2): {refused.removeprefix(gate + ': ')}"
        failed, why = self.gate()
        return f"{gate}: {'FAIL' if failed else 'pass'}: {why}"

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
        level = (f"{s.get('judged', 0)} cell(s) judged at family-wise alpha {self.options.alpha:g} (Holm), "
                 f"{R.slower_means(self.options.rule, t, self.options.alpha)}; {self.power_line()}")
        why = []
        if self.options.fail_on == "slower_overall" and s.get("overall") == "slower":
            why.append(f"the release as a whole is slower: geometric mean {s['geomean_ratio']:.4f}x, verdict interval "
                       f"[{s['verdict_low']:.4f}, {s['verdict_high']:.4f}]")
        if len(failing):
            alone = self._slower_alone(failing)
            n_unstable = int(rows["unstable"].astype(bool).sum())
            named = [c + (f" (unstable: {r or 'reason not recorded'}"
                          + (f"; slower on its own test, p {p:.3g} < {self.options.alpha:g} / {n_unstable} "
                             "unstable cell(s), without Holm" if a else "")
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
        if self.options.fail_on == "slower_overall":
            return False, (f"the release as a whole is not slower: geometric mean {s.get('geomean_ratio', math.nan):.4f}x, "
                           f"verdict interval [{s.get('verdict_low', math.nan):.4f}, {s.get('verdict_high', math.nan):.4f}]"
                           f" ({s.get('overall', 'inconclusive')}); {level}")
        return False, f"{level}; none {self.options.fail_on} (±{t:g}%)"


def _pct(value: float, sign: str = "") -> str:
    return f"{sign}{value:.1f} %" if math.isfinite(value) else "∞ (no verdict reachable)"


def _names(cells: pd.Series, shown: int = 3) -> str:
    names = [str(c) for c in cells]
    return ", ".join(names[:shown]) + (f", +{len(names) - shown} more" if len(names) > shown else "")

