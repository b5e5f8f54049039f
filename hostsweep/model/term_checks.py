"""The falsification bound's terms checked against the engine itself (pure): the calibrated
all-reduce T_ar beside the all-reduce measured in situ in the TP cells' own traces, which path
each term was measured on, the term that drives a group's margin, the guarded group verdict,
and the decomposition of the additive term the tensor-parallel study [2] left unattributed.

Why: a bound H + T_ar built from a term the engine never pays (a standalone gloo all-reduce
where vLLM's CPU build reduces through shared memory) "falsifies" the model by construction.
So a held-out TP group is judged only after its calibrated T_ar is compared with its own
in-situ all-reduce. The two directions are not alike:
- a calibration above the in-situ interval (the engine paid less than the bound says: gloo
  timed where vLLM reduces through shared memory) inflates the bound H + T_ar, so cells fall
  below it by construction: `allreduce_mismatch`, never `falsified`;
- a calibration below it (ALLREDUCE_BEYOND: the engine's all-reduce ops held more than the
  calibrated transfer, as when a rank reaches the all-reduce first and waits in it for its
  peer, which the calibration's back-to-back all-reduces never do) leaves the bound lower
  than what the engine pays: a cell below it is below the true bound too, so the group is
  judged, its verdict says by how much, and the excess is inside the fitted additive term
  (the decomposition's `allreduce_beyond_calibrated_ms`).
A falsification whose terms were not measured on the engine's path (and not confirmed in
situ) is reported, and says so loudly.

Column names: `allreduce_ms` is the fit's calibrated T_ar per cell (study_fit._predictions);
`allreduce_insitu_*` are the measured ones (measure/results.allreduce_metrics).
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import pandas as pd

ENGINE, STANDALONE = "engine", "standalone"
ALLREDUCE_MISMATCH = "allreduce_mismatch"  # calibrated above the in-situ interval: the group is not judged
ALLREDUCE_BEYOND = "insitu_beyond_calibration"  # below it: judged, the excess named
# What a cell carries of the in-situ all-reduce (rank 0 with its CI, the ranks' range).
INSITU_COLUMNS = ("allreduce_insitu_ms", "allreduce_insitu_ci_low_ms", "allreduce_insitu_ci_high_ms",
                  "allreduce_insitu_rank_min_ms", "allreduce_insitu_rank_max_ms", "allreduces_per_step")
# The split's columns the decomposition reads (measure/results.py).
SPLIT_COLUMNS = ("device_ms", "host_ms")


def path_of(record: Any) -> str:
    """ENGINE or STANDALONE for a calibrated term: its recorded `path` (or `method`), as an
    attribute or a key; a term that records none was measured the paper's way, standalone."""
    for key in ("path", "method"):
        value = record.get(key) if isinstance(record, Mapping) else getattr(record, key, None)
        if value:
            return ENGINE if str(value).lower().startswith(ENGINE) else STANDALONE
    return STANDALONE


def allreduce_path(terms: Any, sku: str) -> str:
    """The path T_ar of `sku` was measured on, from a CalibrationTerms (its per-SKU all-reduce
    fits) or fit.json's calibration section; STANDALONE when nothing says."""
    paths = getattr(terms, "allreduce_paths", None)
    if isinstance(paths, Mapping) and sku in paths:
        return path_of({"path": paths[sku]})
    allreduce = terms.get("allreduce", {}) if isinstance(terms, Mapping) else getattr(terms, "allreduce", {})
    return path_of(allreduce[sku]) if sku in allreduce else STANDALONE


def host_path(terms: Any) -> str:
    """ENGINE when H(N) was fitted to the engine's own host time (TP-1 split cells), else the
    calibration's microbenchmark (or reported) line: STANDALONE."""
    value = terms.get("host", {}).get("path") if isinstance(terms, Mapping) else getattr(terms, "host_path", None)
    return ENGINE if value == ENGINE else STANDALONE


def term_paths(terms: Any, sku: str) -> dict[str, str]:
    """The path H and the T_ar of `sku` were measured on (host_path, allreduce_path), as a
    held-out group records them for its guard and the report."""
    return {"H": host_path(terms), "T_ar": allreduce_path(terms, sku)}


def _column(cells: pd.DataFrame, name: str) -> np.ndarray:
    return pd.to_numeric(cells[name], errors="coerce").to_numpy(float) if name in cells else np.full(len(cells), np.nan)


def insitu_interval(cells: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Per cell, the all-reduce time the engine paid, as an interval: rank 0's CI widened to
    the ranks' range (a rank that reaches the all-reduce first waits inside it for the
    others, so no one rank is the all-reduce's time). Rank 0's point where it has no CI."""
    point = _column(cells, "allreduce_insitu_ms")
    # fmin/fmax skip a NaN: a cell without a CI (under 3 pairs) keeps its point and rank range
    low = np.fmin(np.fmin(_column(cells, "allreduce_insitu_ci_low_ms"),
                          _column(cells, "allreduce_insitu_rank_min_ms")), point)
    high = np.fmax(np.fmax(_column(cells, "allreduce_insitu_ci_high_ms"),
                           _column(cells, "allreduce_insitu_rank_max_ms")), point)
    return low, high


def allreduce_check(cells: pd.DataFrame) -> dict[str, Any]:
    """Calibrated T_ar against the in-situ all-reduce over one TP group's cells (the fit's
    per-cell table: `allreduce_ms` and the INSITU_COLUMNS). `status`: `match` when the mean
    calibrated T_ar lies inside the mean in-situ interval, ALLREDUCE_MISMATCH when above it,
    ALLREDUCE_BEYOND when below it (the module's docstring says why the two differ),
    `unmeasured` when no cell carries an in-situ all-reduce (split off, or logged before it)."""
    calibrated = _column(cells, "allreduce_ms")
    low, high = insitu_interval(cells)
    point = _column(cells, "allreduce_insitu_ms")
    has = np.isfinite(point) & np.isfinite(calibrated)
    if not has.any():
        return {"status": "unmeasured", "cells": 0,
                "sentence": "no in-situ all-reduce (the TP cells were measured without the split)"}
    # Averaging the intervals' ends treats the cells' errors as fully correlated: a wider
    # interval than independence gives, so a mismatch is flagged only when it is clear.
    check = {"cells": int(has.sum()), "calibrated_ms": float(calibrated[has].mean()),
             "insitu_ms": float(point[has].mean()), "insitu_low_ms": float(low[has].mean()),
             "insitu_high_ms": float(high[has].mean()),
             "cells_outside": int(((calibrated < low) | (calibrated > high))[has].sum())}
    check["status"] = (ALLREDUCE_MISMATCH if check["calibrated_ms"] > check["insitu_high_ms"] else
                       ALLREDUCE_BEYOND if check["calibrated_ms"] < check["insitu_low_ms"] else "match")
    check["beyond_ms"] = check["insitu_ms"] - check["calibrated_ms"]
    check["ratio"] = check["calibrated_ms"] / check["insitu_ms"] if check["insitu_ms"] > 0 else float("nan")
    check["sentence"] = (f"calibrated T_ar {check['calibrated_ms']:.3f} ms vs in-situ all-reduce "
                         f"{check['insitu_ms']:.3f} ms [{check['insitu_low_ms']:.3f}, {check['insitu_high_ms']:.3f}] "
                         f"(mean over {check['cells']} cells; {check['cells_outside']} outside their own interval)")
    return check


INSITU = "insitu"  # T_ar taken from the group's own traces (insitu_fallback)


def insitu_fallback(cells: pd.DataFrame, groups: list[dict[str, Any]]) -> np.ndarray | None:
    """Per cell, T_ar in seconds from the cell's own traces (its rank 0 in-situ all-reduce) for
    the cells of the held-out groups whose calibrated T_ar missed it (ALLREDUCE_MISMATCH), NaN
    elsewhere; None when no such group has in-situ cells.

    Why: a microbenchmark cannot always run what the engine runs. On a CPU whose vLLM kernels
    lack the shared-memory all-reduce (no AVX-512), the ranks reduce through gloo, each rank's
    gloo threads sharing its one bound core, and a gloo all-reduce's time then depends on what
    the rank does between calls: back to back it took 2.0-2.4 ms, single calls 2.5-3.4 ms, inside
    the engine's decode 1.5 ms (benchmarks/RESULTS.md, "The all-reduce on a CPU without AVX-512"). The group is then judged with the all-reduce
    the engine paid, and says so, rather than not at all."""
    mismatched = {(g["sku"], int(g["tp"])) for g in groups
                  if g.get("role") == "held-out" and g.get("verdict") == ALLREDUCE_MISMATCH}
    if not mismatched:
        return None
    keys = list(zip(cells["sku"], cells["tp"].astype(int)))
    chosen = np.array([key in mismatched for key in keys]) & (cells["tp"].to_numpy(int) > 1)
    insitu = np.where(chosen, _column(cells, "allreduce_insitu_ms") / 1e3, np.nan)
    return insitu if np.isfinite(insitu).any() else None


def mark_insitu(group: dict[str, Any], calibrated_check: dict[str, Any]) -> dict[str, Any]:
    """A group judged with its in-situ T_ar (insitu_fallback): the source named in the group
    and at the head of its reason, the calibration's missed check kept beside."""
    note = (f"T_ar from the group's own traces (in situ): the calibrated T_ar missed the engine's all-reduce "
            f"({calibrated_check['sentence']})")
    return {**group, "allreduce_source": INSITU, "allreduce_check_calibrated": calibrated_check,
            "reason": f"{note}; {group.get('reason', '')}".rstrip("; ")}


def driving_term(cells: pd.DataFrame) -> dict[str, Any]:
    """The term that drives a group's margin (step − bound, bound = H + T_ar), from the
    group's means. Below the bound: the bound's larger term (H or T_ar), and whether it alone
    exceeds the step. At or above: the largest piece of the model's step (compute, T_ar, H)."""
    step, compute = float(_column(cells, "step_ms").mean()), float(_column(cells, "compute_ms").mean())
    allreduce = _column(cells, "allreduce_ms")
    # H as the bound has it (the microbenchmark's, or with fit.bound=conservative the lowest fitted)
    host = _column(cells, "bound_ms") - allreduce if "bound_ms" in cells else _column(cells, "microbench_ms")
    pieces = {"H": float(host.mean()), "T_ar": float(allreduce.mean())}
    margin = step - pieces["H"] - pieces["T_ar"]
    if margin < 0:
        term = max(pieces, key=pieces.get)
        alone = pieces[term] > step
        sentence = (f"{term} drives the margin: {term} {pieces[term]:.3f} ms of the {pieces['H'] + pieces['T_ar']:.3f} "
                    f"ms bound against a {step:.3f} ms step" + (f" ({term} alone exceeds the step)" if alone else ""))
        return {"term": term, "margin_ms": margin, "alone_exceeds_step": alone, "sentence": sentence}
    pieces["compute"] = compute
    term = max(pieces, key=pieces.get)
    return {"term": term, "margin_ms": margin, "alone_exceeds_step": False,
            "sentence": f"{term} is the largest piece of the model's step ({pieces[term]:.3f} of {step:.3f} ms)"}


def guard_group(row: dict[str, Any], cells: pd.DataFrame, paths: Mapping[str, str]) -> dict[str, Any]:
    """A held-out group's verdict, guarded by its own inputs. `row` holds the binomial rule's
    `falsified` and the family `verdict`; `cells` its rows of the fit's table; `paths` the
    path of H and T_ar (ENGINE / STANDALONE). Adds `allreduce_check`, `driving_term`,
    `term_paths` (the paths, for the report), `terms_on_engine_path`; turns a mismatched
    group into ALLREDUCE_MISMATCH (out of the comparison, its falsification kept apart as
    `falsified_by_rule`)."""
    tp = int(row["tp"])
    check = allreduce_check(cells) if tp > 1 else {"status": "no all-reduce", "cells": 0, "sentence": "TP-1"}
    drive = driving_term(cells)
    tar_checked = tp == 1 or paths.get("T_ar") == ENGINE or check["status"] in ("match", ALLREDUCE_BEYOND)
    unchecked = [term for term, ok in (("H", paths.get("H") == ENGINE), ("T_ar", tar_checked)) if not ok]
    out = {**row, "allreduce_check": check, "driving_term": drive, "term_paths": dict(paths),
           "terms_on_engine_path": not unchecked, "terms_off_engine_path": unchecked,
           "falsified_by_rule": bool(row.get("falsified"))}
    if check["status"] == ALLREDUCE_MISMATCH:
        apart = row.get("evidence_apart", {k: row[k] for k in ("verdict", "reason") if k in row})
        below = "its cells fall below H + T_ar, " if row.get("falsified") else ""
        return {**out, "falsified": False, "verdict": ALLREDUCE_MISMATCH, "evidence_apart": apart,
                "reason": f"the bound's all-reduce term misses the engine's: {check['sentence']}; no falsification "
                          f"is read from this group ({below}{drive['sentence']})"}
    if check["status"] == ALLREDUCE_BEYOND:
        out["reason"] = (f"{row.get('reason', '')}; the engine's all-reduce ops took {check['beyond_ms']:.3f} ms a step "
                         f"beyond the calibrated T_ar ({check['sentence']}): time a rank waits in the all-reduce "
                         "for its peer, or a calibration below the engine's cost; the bound stays a lower bound, "
                         "and the excess is inside the fitted additive term").lstrip("; ")
    if row.get("falsified"):
        loud = (f"; NOT ON THE ENGINE'S PATH: {', '.join(unchecked)} measured standalone"
                f"{' and not confirmed in situ' if 'T_ar' in unchecked else ''}: this falsification may be "
                "the calibration's" if unchecked else "")
        out["reason"] = f"{out.get('reason') or 'cells below H + T_ar'}; {drive['sentence']}{loud}"
    return out


def decomposition(pred: pd.DataFrame, form: str) -> pd.DataFrame:
    """Per cell with a split, the fitted additive term (the `form`'s prediction − g·T_cmp/k −
    calibrated T_ar) taken apart: the measured host-exposed time, the all-reduce the engine paid
    beyond the calibrated T_ar, and what is left unattributed; and the measured step as device
    compute + in-situ all-reduce + host-exposed. TP-1 cells reduce nothing (in-situ 0)."""
    split = pred[np.isfinite(_column(pred, "host_ms")) & np.isfinite(_column(pred, "device_ms"))]
    insitu = np.where(split["tp"].to_numpy(int) > 1, _column(split, "allreduce_insitu_ms"), 0.0)
    out = split[[c for c in ("sku", "model", "tp", "batch", "ctx", "step_ms") if c in split]].copy()
    additive = _column(split, f"{form}_ms") - _column(split, "compute_ms") - _column(split, "allreduce_ms")
    host = _column(split, "host_ms")
    beyond = insitu - _column(split, "allreduce_ms")
    out = out.assign(device_compute_ms=_column(split, "device_ms") - insitu, allreduce_insitu_ms=insitu,
                     host_exposed_ms=host, additive_ms=additive, allreduce_beyond_calibrated_ms=beyond,
                     unattributed_ms=additive - host - beyond)
    return out[np.isfinite(out["allreduce_insitu_ms"])].reset_index(drop=True)


def decomposition_table(pred: pd.DataFrame, form: str) -> pd.DataFrame:
    """decomposition() per (SKU, model, TP): the parts' means and the additive term's shares."""
    cells = decomposition(pred, form)
    if cells.empty:
        return cells
    parts = ("step_ms", "device_compute_ms", "allreduce_insitu_ms", "host_exposed_ms", "additive_ms",
             "allreduce_beyond_calibrated_ms", "unattributed_ms")
    table = cells.groupby(["sku", "model", "tp"])[list(parts)].mean().reset_index()
    table.insert(3, "cells", cells.groupby(["sku", "model", "tp"]).size().to_numpy())
    for part, share in (("host_exposed_ms", "host_share"), ("allreduce_beyond_calibrated_ms", "allreduce_share"),
                        ("unattributed_ms", "unattributed_share")):
        table[share] = table[part] / table["additive_ms"].where(table["additive_ms"] != 0)
    return table
