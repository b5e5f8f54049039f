"""Do a study's comparisons survive a noisy host? The default grid, run quiet and beside a CPU hog.

Runs `python -m hostsweep split.enabled=false` (the default 6-cell grid: batch 1/2/4 x ctx
128/512, 12 timed pairs) several times, each in a fresh process with its own MLflow store,
study and run folder:

    quiet-1, quiet-2   nothing else started by this script (interleaved rounds, the default)
    noisy              beside a duty-cycled hog: one process spinning on one core, 2 s on /
                       2 s off, from the engine's "engine ready" line to the sweep's end
    seq-1, seq-2       quiet, measure.interleave=false (cell after cell, as before rounds)
    rep-1, rep-2       quiet, measure.replicates=2 (two engine starts per run), asked for by
                       --runs: do two runs' CIs overlap once they cover engine starts?

Per cell and run it prints the step and its CI, the ratio to the grid's first cell, how far
that ratio moved from quiet-1 (%), and the stability flags; then the targets: the quiet runs
reproduce every cell's ratio within 10 % and their CIs overlap; every noisy cell whose ratio
moved more than 10 % beyond the quiet runs' spread is flagged; the noisy study is flagged;
each quiet run flags at most one cell; and the b4/b1 ratio's spread across quiet runs with
and without interleaving (what interleaving buys). Ratios are measured within one run, so a
machine slower or faster overall does not move them.

    .venv/bin/python benchmarks/noisy_neighbour.py [--runs quiet-1,quiet-2,noisy,seq-1,seq-2]
        [--keep DIR] [hydra overrides...]
"""
from __future__ import annotations

import argparse
import multiprocessing
import tempfile
import time
from pathlib import Path

import pandas as pd

from hostsweep.measure.unstable import left_out_mask
from studies import run_study

RUNS = ("quiet-1", "quiet-2", "noisy", "seq-1", "seq-2")
BASE = ["split.enabled=false", "ray.exclusive=false"]
MOVE_LIMIT_PCT = 10.0
HOG_ON_S, HOG_OFF_S = 2.0, 2.0


def duty_cycled_hog(on_s: float, off_s: float) -> None:
    """Spin on one core for on_s, sleep off_s, forever (the parent terminates it)."""
    while True:
        until = time.monotonic() + on_s
        while time.monotonic() < until:
            pass
        time.sleep(off_s)


def run_sweep(root: Path, name: str, overrides: list[str]) -> Path:
    """One `python -m hostsweep` in a fresh folder; the noisy run starts the hog once the
    engine is ready. Returns the run folder (cells.csv)."""
    extra = {"seq": ["measure.interleave=false"], "rep": ["measure.replicates=2"]}.get(name.split("-")[0], [])
    hog: list[multiprocessing.Process] = []

    def start_hog(line: str) -> None:
        if name == "noisy" and not hog and "engine ready" in line:
            hog.append(multiprocessing.Process(target=duty_cycled_hog, args=(HOG_ON_S, HOG_OFF_S), daemon=True))
            hog[0].start()

    try:
        return run_study(root / name, f"noisy-{name}", [*BASE, *extra, *overrides], start_hog)
    finally:
        for process in hog:
            process.terminate()
            process.join()


def cells_of(run_dir: Path, name: str) -> pd.DataFrame:
    cells = pd.read_csv(run_dir / "cells.csv")
    cells = cells[cells["status"] == "FINISHED"].sort_values(["batch", "ctx"]).reset_index(drop=True)
    cells["cell"] = [f"b{b} ctx{c}" for b, c in zip(cells["batch"], cells["ctx"])]
    cells["ratio"] = cells["step_ms"] / cells["step_ms"].iloc[0]
    cells["run"] = name
    cells["unstable"] = cells.get("stable", pd.Series(True, index=cells.index)).map(lambda v: str(v).lower() == "false")
    return cells


def overlap(a: pd.Series, b: pd.Series) -> bool:
    return not (a["step_ci_high_ms"] < b["step_ci_low_ms"] or b["step_ci_high_ms"] < a["step_ci_low_ms"])


def clean_rounds_note(cells: pd.DataFrame) -> str:
    """How many rounds the common clean rounds left out and how many pairs each cell kept;
    when they left too few, the cells used every pair (and carry foreign_cpu): say so."""
    if "contended_rounds" not in cells or "clean_pairs" not in cells:
        return "no clean-round record"
    contended, kept = int(cells["contended_rounds"].max()), cells["clean_pairs"]
    used_all = "reps_used" in cells and bool((kept >= cells["reps_used"]).all())
    if contended and used_all:
        return (f"{contended} rounds contended, too many to leave out: every cell used all its pairs "
                f"({int(kept.min())}-{int(kept.max())}) and is flagged foreign_cpu")
    return f"rounds left out as contended: {contended}, pairs kept per cell: {int(kept.min())}-{int(kept.max())}"


def report(frames: dict[str, pd.DataFrame]) -> None:
    base = frames[next(iter(frames))].set_index("cell")
    print(f"\n{'run':8} {'cell':11} {'step_ms':>8} {'ci95':>17} {'ratio':>6} {'moved%':>7}  flags")
    for name, cells in frames.items():
        for _, row in cells.iterrows():
            moved = (row["ratio"] / base.loc[row["cell"], "ratio"] - 1) * 100
            reasons = row.get("unstable_reasons")
            flags = f"UNSTABLE: {reasons}" if row["unstable"] else "stable"
            print(f"{name:8} {row['cell']:11} {row['step_ms']:8.3f} [{row['step_ci_low_ms']:6.3f}, "
                  f"{row['step_ci_high_ms']:6.3f}] {row['ratio']:6.3f} {moved:+7.1f}  {flags}")
    targets(frames)


def targets(frames: dict[str, pd.DataFrame]) -> None:
    quiet = [frames[n].set_index("cell") for n in frames if n.startswith("quiet")]
    print("\ntargets")
    if len(quiet) >= 2:
        a, b = quiet[0], quiet[1]
        moved = ((b["ratio"] / a["ratio"] - 1).abs() * 100)
        overlapping = all(overlap(a.loc[c], b.loc[c]) for c in a.index)
        print(f"  quiet runs reproduce every ratio within {MOVE_LIMIT_PCT:g} %: max move {moved.max():.1f} % "
              f"({'met' if moved.max() <= MOVE_LIMIT_PCT else 'NOT met'})")
        print(f"  quiet runs' CIs overlap in every cell: {'met' if overlapping else 'NOT met'}")
        for n in frames:
            if n.startswith("quiet"):
                flagged = int(frames[n]["unstable"].sum())
                # machine_speed and replicate are verdicts on the machine, every cell of a group
                # at once; the rules that judge a cell's own number are the rest
                own = int(left_out_mask(frames[n]).sum())  # the fit's rule (measure/unstable.py)
                print(f"  {n} flags at most one cell: {flagged} flagged, {own} for a reason about the cell "
                      f"itself ({'met' if flagged <= 1 else 'NOT met'})")
    if "noisy" in frames and quiet:
        noisy = frames["noisy"].set_index("cell")
        ratios = pd.concat([q["ratio"] for q in quiet], axis=1)
        low, high = ratios.min(axis=1), ratios.max(axis=1)
        beyond = [c for c in noisy.index if noisy.loc[c, "ratio"] > high[c] * (1 + MOVE_LIMIT_PCT / 100)
                  or noisy.loc[c, "ratio"] < low[c] * (1 - MOVE_LIMIT_PCT / 100)]
        unflagged = [c for c in beyond if not noisy.loc[c, "unstable"]]
        print(f"  noisy cells moved > {MOVE_LIMIT_PCT:g} % beyond the quiet spread: {beyond or 'none'}; "
              f"unflagged among them: {unflagged or 'none'} ({'met' if not unflagged else 'NOT met'})")
        first = quiet[0]
        moved_noisy = ((noisy["ratio"] / first["ratio"] - 1).abs() * 100)
        print(f"  noisy ratios within {MOVE_LIMIT_PCT:g} % of {next(n for n in frames if n.startswith('quiet'))}'s: "
              f"max move {moved_noisy.max():.1f} % ({'met' if moved_noisy.max() <= MOVE_LIMIT_PCT else 'NOT met'}); "
              f"{clean_rounds_note(noisy)}")
        print(f"  the noisy study is flagged: {int(noisy['unstable'].sum())} of {len(noisy)} cells "
              f"({'met' if noisy['unstable'].any() else 'NOT met'})")
    reps = [frames[n].set_index("cell") for n in frames if n.startswith("rep")]
    if len(reps) >= 2:
        a, b = reps[0], reps[1]
        overlapping = [c for c in a.index if overlap(a.loc[c], b.loc[c])]
        print(f"  with replicates=2, the two runs' CIs overlap in {len(overlapping)} of {len(a)} cells "
              f"({'met' if len(overlapping) == len(a) else 'NOT met'})")
    spreads = {}
    for prefix, label in (("quiet", "interleaved"), ("seq", "cell after cell")):
        runs = [frames[n].set_index("cell") for n in frames if n.startswith(prefix)]
        if len(runs) >= 2:
            b4b1 = [r.loc["b4 ctx128", "step_ms"] / r.loc["b1 ctx128", "step_ms"] for r in runs]
            spreads[label] = (max(b4b1) / min(b4b1) - 1) * 100
            print(f"  b4/b1 (ctx128) across quiet runs, {label}: " + ", ".join(f"{v:.3f}" for v in b4b1) +
                  f" (spread {spreads[label]:.1f} %)")
    if len(spreads) == 2:
        print(f"  what interleaving buys: the spread of b4/b1 is {spreads['cell after cell']:.1f} % cell after cell, "
              f"{spreads['interleaved']:.1f} % interleaved")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default=",".join(RUNS), help="which runs, in order (first is the reference)")
    parser.add_argument("--keep", type=Path, help="keep the runs in this folder (rerunning reports on them again)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run (e.g. engine.name=fake)")
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="noisy-neighbour-"))
    print(f"runs in {root}", flush=True)
    frames = {name: cells_of(run_sweep(root, name, args.overrides), name) for name in args.runs.split(",")}
    report(frames)


if __name__ == "__main__":
    main()
