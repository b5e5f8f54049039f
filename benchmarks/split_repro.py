"""Does the device/host split reproduce? The default grid (split on) measured twice, each run
a study of its own, compared cell by cell.

    .venv/bin/python benchmarks/split_repro.py [--runs 2] [--keep DIR] [hydra overrides...]

Per cell and run: host_frac with its CI, device_ms with its CI and its physical floor, the
regime, the split's flags. Then the targets of a reproducible split: every cell's host_frac
within 0.05 across the runs or both CIs overlapping; regimes equal or one `undetermined`;
no device time below its floor left unflagged (a flagged cell has no host_frac at all).
Run it on a quiet machine: its figures are the machine's as much as the split's.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import pandas as pd

from studies import run_study

HOST_FRAC_TOLERANCE = 0.05
SPLIT_FLAGS = ("split_impossible", "split_implausible")


def cells_of(run_dir: Path, name: str) -> pd.DataFrame:
    cells = pd.read_csv(run_dir / "cells.csv")
    cells = cells[cells["status"] == "FINISHED"].sort_values(["batch", "ctx"]).reset_index(drop=True)
    reasons = cells.get("unstable_reasons", pd.Series("", index=cells.index)).fillna("").astype(str)
    # one concat: cells.csv's many string columns are a block each, and assign warned per column
    added = pd.DataFrame({"cell": [f"b{b} ctx{c}" for b, c in zip(cells["batch"], cells["ctx"])], "run": name,
                          "split_flag": [",".join(r for r in SPLIT_FLAGS if r in text) for text in reasons]},
                         index=cells.index)
    return pd.concat([cells, added], axis=1).set_index("cell")


def value(row: pd.Series, name: str) -> float:
    return float(row[name]) if name in row and pd.notna(row[name]) else float("nan")


def show(frames: dict[str, pd.DataFrame]) -> None:
    print(f"\n{'run':6} {'cell':11} {'host_frac':>9} {'ci':>15} {'device_ms':>9} {'ci':>15} {'floor':>6}  regime / flags")
    for name, cells in frames.items():
        for cell, row in cells.iterrows():
            print(f"{name:6} {cell:11} {value(row, 'host_frac'):9.3f} [{value(row, 'host_frac_ci_low'):5.3f}, "
                  f"{value(row, 'host_frac_ci_high'):5.3f}] {value(row, 'device_ms'):9.3f} "
                  f"[{value(row, 'device_ci_low_ms'):5.3f}, {value(row, 'device_ci_high_ms'):5.3f}] "
                  f"{value(row, 'device_floor_ms'):6.3f}  {row.get('regime', '')} {row['split_flag']}")


def reproduces(a: pd.Series, b: pd.Series) -> bool:
    """host_frac within the tolerance, or both CIs overlapping."""
    fa, fb = value(a, "host_frac"), value(b, "host_frac")
    if abs(fa - fb) <= HOST_FRAC_TOLERANCE:
        return True
    return not (value(a, "host_frac_ci_high") < value(b, "host_frac_ci_low")
                or value(b, "host_frac_ci_high") < value(a, "host_frac_ci_low"))


def targets(frames: dict[str, pd.DataFrame]) -> None:
    names = list(frames)
    a, b = frames[names[0]], frames[names[1]]
    common = [c for c in a.index if c in b.index]
    moved = [c for c in common if not reproduces(a.loc[c], b.loc[c])]
    flipped = [c for c in common if {str(a.loc[c].get("regime")), str(b.loc[c].get("regime"))}
               >= {"host-bound", "device-bound"}]
    below = [(n, c) for n, cells in frames.items() for c, row in cells.iterrows()
             if value(row, "device_ms") < value(row, "device_floor_ms") and not row["split_flag"]]
    print("\ntargets")
    print(f"  host_frac within {HOST_FRAC_TOLERANCE} or CIs overlapping in every cell: "
          f"{'met' if not moved else 'NOT met: ' + ', '.join(moved)}")
    print(f"  regimes equal or one undetermined: {'met' if not flipped else 'NOT met: ' + ', '.join(flipped)}")
    print(f"  no unflagged device time below its floor: {'met' if not below else f'NOT met: {below}'}")
    spread = [abs(value(a.loc[c], "host_frac") - value(b.loc[c], "host_frac")) for c in common]
    print(f"  host_frac moved by at most {max(spread, default=float('nan')):.3f} across the runs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="how many runs of the grid (the first two are compared)")
    parser.add_argument("--keep", type=Path, help="keep the runs in this folder (rerunning reports on them again)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run (e.g. batch=[1,4])")
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="split-repro-"))
    print(f"runs in {root}", flush=True)
    frames = {f"run{k}": cells_of(run_study(root / f"run{k}", f"split-repro-{k}", ["ray.exclusive=false",
                                                                                   *args.overrides]), f"run{k}")
              for k in range(1, args.runs + 1)}
    show(frames)
    targets(frames)


if __name__ == "__main__":
    main()
