"""Which cells of two sides are compared (pure): what differs between the sides, the
dimensions they are matched on, and each cell's label. The rules are stated in
hostsweep/compare/cellwise.py, which uses these."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import pandas as pd

from hostsweep.config.grid import CELL_PARAMS, OPTIONAL_PARAMS

# Cell params, in the order a label names them; matched on unless they are what differs
# (replicates: engine starts, "1" when a side logged none, compare/cellwise.py with_replicates).
CELL_DIMS = (*CELL_PARAMS, *OPTIONAL_PARAMS)
# Where a number came from: reported when it differs, never matched on.
PROVENANCE_DIMS = ("vllm_version", "torch_version", "hostsweep_version", "ray_version", "git_sha",
                   "device_name", "hostname")
LABEL_PREFIX = {"batch": "b", "ctx": "ctx", "tp": "tp", "T": "T"}


@dataclass(frozen=True)
class Difference:
    name: str
    base: tuple[str, ...]
    head: tuple[str, ...]

    def text(self) -> str:
        return f"{name_values(self.base)} → {name_values(self.head)}"


def name_values(values: Sequence[str]) -> str:
    shown = [v if v != "" else "(unset)" for v in values]
    return shown[0] if len(shown) == 1 else "{" + ", ".join(shown) + "}"


def _values(frame: pd.DataFrame, dim: str) -> tuple[str, ...]:
    if dim not in frame:
        return ("",)
    return tuple(sorted({text(v) for v in frame[dim]}))


def text(value: Any) -> str:
    """A param or tag as the string it was logged as; missing (None, NaN) is ''."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def dimensions(base: pd.DataFrame, head: pd.DataFrame) -> tuple[list[str], list[Difference], dict[str, str]]:
    """(cell dims matched on, what differs, provenance both sides share by name)."""
    matched, differs, shared = [], [], {}
    for dim in CELL_DIMS:
        b, h = _values(base, dim), _values(head, dim)
        if len(b) == 1 and len(h) == 1 and b != h:
            differs.append(Difference(dim, b, h))
        elif b != ("",) or h != ("",):
            matched.append(dim)
    for dim in PROVENANCE_DIMS:
        b, h = _values(base, dim), _values(head, dim)
        if b != h:
            differs.append(Difference(dim, b, h))
        elif b != ("",):
            shared[dim] = name_values(b)
    return matched, differs, shared


def cell_label(row: Mapping[str, Any], dims: Sequence[str]) -> str:
    """b4-ctx512-eager-tp2: the matching dims that vary across the compared cells."""
    order = [d for d in ("batch", "ctx") if d in dims] + [d for d in dims if d not in ("batch", "ctx")]
    parts = [f"{LABEL_PREFIX.get(d, '')}{text(row.get(d))}" if d in LABEL_PREFIX else text(row.get(d))
             for d in order]
    return "-".join(parts) or "cell"


def _keyed(frame: pd.DataFrame, on: Sequence[str]) -> pd.DataFrame:
    out = frame.copy()
    out["_match"] = [tuple(text(r.get(d)) for d in on) for r in frame.to_dict("records")] if len(frame) else []
    if "start_time" in out:  # a key measured twice on one side: its newest run
        out = out.sort_values("start_time", ascending=False, kind="stable")
    return out


def match_cells(base: pd.DataFrame, head: pd.DataFrame, on: Sequence[str]
                ) -> tuple[list[tuple[dict, dict]], pd.DataFrame, list[str]]:
    """(matched (base row, head row) pairs, unmatched cells, warnings), on the given dims."""
    b, h = _keyed(base, on), _keyed(head, on)
    warnings = [f"{side}: {n} cell(s) share their matching dimensions with a newer one and are left out"
                for side, frame in (("base", b), ("head", h)) if (n := int(frame["_match"].duplicated().sum()))]
    b, h = b.drop_duplicates("_match"), h.drop_duplicates("_match")
    heads = {row["_match"]: row for row in h.to_dict("records")}
    bases = {row["_match"]: row for row in b.to_dict("records")}
    pairs = [(row, heads[key]) for key, row in bases.items() if key in heads]
    lonely = [{"side": side, **{d: row.get(d) for d in on}, "run_id": row.get("run_id"),
               "reason": f"no {other} cell with the same {', '.join(on) or 'dimensions'}"}
              for side, other, rows, others in (("base", "head", bases, heads), ("head", "base", heads, bases))
              for key, row in rows.items() if key not in others]
    return pairs, pd.DataFrame(lonely, columns=["side", *on, "run_id", "reason"]), warnings


def unmatched_label(row: Mapping[str, Any], dims: Sequence[str]) -> str:
    return cell_label(row, [d for d in dims if d in row] or [d for d in ("batch", "ctx") if d in row])


def with_replicates(base: pd.DataFrame, head: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Both sides with a `replicates` param (engine starts; absent means 1) when either has it,
    so a one-start side is never matched silently against a several-start one."""
    if "replicates" not in base and "replicates" not in head:
        return base, head
    fill = lambda f: f.assign(replicates=[text(v) or "1" for v in f.get("replicates", pd.Series([None] * len(f),  # noqa: E731
                                                                                               index=f.index))])
    return fill(base), fill(head)


def with_failed_reasons(unmatched: pd.DataFrame, failed: Optional[pd.DataFrame], on: Sequence[str]) -> pd.DataFrame:
    """Base cells the head lacks: say so when the head has a FAILED run of the cell."""
    if failed is None or failed.empty or unmatched.empty:
        return unmatched
    on = [d for d in on if d in failed]  # the params a failed run logged (all, from a sweep)
    runs = {tuple(text(r.get(d)) for d in on): r.get("run_id") for r in failed.to_dict("records")}
    keys = [tuple(text(r.get(d)) for d in on) for r in unmatched.to_dict("records")]
    reasons = [f"head run {runs[k]} FAILED" if side == "base" and k in runs else why
               for k, side, why in zip(keys, unmatched["side"], unmatched["reason"])]
    return unmatched.assign(reason=reasons)

