"""The diff's verdicts under this VM's noise (gate_noise.py), new rules beside the old ones.

For each design, machine autocorrelation rho and pair noise, over `studies` simulated studies
of 16 cells in 4 engine groups (threshold 5 %, alpha 0.05, Holm over the 16): per-cell CI
coverage of the true ratio (A/A), the family-wise false-alarm rate of an A/A (any cell
`slower`), the share of A/A cells `same`, power per cell against +5/+10/+20 % planted in every
cell, the median MDE, and for paired rounds the geometric mean's CI coverage. The verdicts
come from the compare package's own vectorized replays (stats.judge_rounds, judge_arrays) or,
where a design has none (rounds with the instance floor), from its functions composed as
compare/rounds.py and verdicts.py compose them.

The old rules (before commit 575301d: a null at ratio 1, no agreement with the printed CI,
one-start sides judged with no between-start component) run on the same seeds in a
subprocess whose PYTHONPATH is a worktree of 189ddac (hostsweep.report.diff_stats there);
the table prints an old row under each new one whose rates differ.

    .venv/bin/python benchmarks/gate_calibration.py --part realistic --seeds 1000
    .venv/bin/python benchmarks/gate_realistic.py --studies 1000 [--no-old]
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gate_noise as G  # noqa: E402

OLD_COMMIT = "189ddac"  # the parent of 575301d, which changed the rules
THRESHOLD, ALPHA, LEVEL = 5.0, 0.05, 0.95
# The rule this table was measured under (the default before issue 52's `significant`);
# benchmarks/gate_rule.py calibrates both rules side by side.
RULE = "margin"
PLANTED = (1.0, 1.05, 1.10, 1.20)
RHOS = (0.0, 0.5, 0.9)
MDE_STUDIES = 100  # studies whose cells' MDE is computed (scalar scipy calls)
# Studies whose rounds cells' MDE is simulated, as the diff does (stats.sign_mde_pct, fewer
# draws): about 0.1 s a cell.
ROUNDS_MDE_STUDIES = 12
GM_STUDIES = 400  # studies whose rounds geometric mean is computed (a DataFrame each)


@dataclass(frozen=True)
class Design:
    label: str
    rounds: int = 0  # paired rounds when > 0
    k: int = 1  # engine starts a side
    paired: bool = False  # start pairs
    floor: bool = False  # one-start sides told the true between-study spread; rounds: the instance floor
    order: str = "counterbalanced"


DESIGNS = (
    Design("rounds 24", rounds=24), Design("rounds 40", rounds=40),
    Design("rounds 40, old side order", rounds=40, order="old_order"),
    Design("rounds 40 + instance floor", rounds=40, floor=True),
    Design("start pairs 3", k=3, paired=True), Design("start pairs 5", k=5, paired=True),
    Design("seq 1 start, no floor", k=1), Design("seq 1 start + true floor", k=1, floor=True),
    Design("seq 3 starts", k=3), Design("seq 5 starts", k=5),
)


def instance_floor_pct(noise: G.Noise) -> float:
    """diff.instance_floor_pct told the truth: the SD (%) of the ratio of two instances."""
    return math.expm1(math.sqrt(2) * noise.instance_sd) * 100


def simulate(design: Design, noise: G.Noise, studies: int, planted: float, seed: list[int]
             ) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    if design.rounds:
        return G.rounds_sides(rng, noise, studies, design.rounds, planted, getattr(G, design.order))
    return G.starts_sides(rng, noise, studies, design.k, planted, design.paired)


def judge(S, new: bool, design: Design, noise: G.Noise, base: np.ndarray, head: np.ndarray
          ) -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray, object]]:
    """(verdicts, CI low, CI high on log scale, what the MDE is computed from) by the rules of
    module S (new: hostsweep.compare.stats; old: hostsweep.report.diff_stats); None where the
    rules have no such design. A rounds cell's MDE comes from its rounds and its floor's
    variance (as the diff's: stats.sign_mde_pct), a start design's from its se and df."""
    level = {"level": LEVEL, "rule": RULE} if new else {}
    if design.rounds:
        median, low, high, _ = S.rounds_log_ratio(base, head, LEVEL)
        if design.floor:
            if not new:
                return None  # the old code had no instance floor
            from hostsweep.compare.options import DiffOptions
            from hostsweep.compare.rounds import widened

            var = DiffOptions(instance_floor_pct=instance_floor_pct(noise)).instance_var
            wide = np.array([widened(c, (lo, hi), var, LEVEL) for c, lo, hi in
                             zip(median.ravel(), low.ravel(), high.ravel())]).reshape(*median.shape, 2)
            low, high = wide[..., 0], wide[..., 1]
            v = S.judge_rounds(base, head, THRESHOLD, ALPHA, LEVEL, rule=RULE, instance_var=var)
            return v, low, high, ("rounds", np.log(head) - np.log(base), var)
        v = S.judge_rounds(base, head, THRESHOLD, ALPHA, **level)
        return v, low, high, ("rounds", np.log(head) - np.log(base), 0.0)
    between = G.floor_var(noise) if design.floor else math.nan
    v = S.judge_arrays(base, head, THRESHOLD, ALPHA, between, math.inf, paired=design.paired, **level)
    if design.paired:
        d, se, df = S.paired_log_ratio(np.median(base, axis=-1), np.median(head, axis=-1))
    elif design.k == 1 and not design.floor and new:
        nan = np.full(v.shape, math.nan)
        return v, nan, nan, np.full(v.shape, math.inf)  # no between-start estimate: no CI, MDE infinite
    else:
        (eb, vb, fb), (eh, vh, fh) = S.side_arrays(base, between), S.side_arrays(head, between)
        d, se, df = eh - eb, np.sqrt(vb + vh), S.satterthwaite([vb, vh], [fb, fh])
    low, high = S.ci(d, se, df, LEVEL)
    return v, np.log(low), np.log(high), (se, df)


def median_mde(design: Design, se, cells: int) -> float:
    """The median over the first studies' cells of the MDE the diff prints: a rounds cell's
    from its sign test's power (ROUNDS_MDE_STUDIES), a start design's from its t (MDE_STUDIES)."""
    from hostsweep.compare.stats import sign_mde_pct
    from hostsweep.compare.verdicts import rounds_for_a_verdict
    from hostsweep.measure.detectable import mde_from_se

    if design.rounds and design.rounds < rounds_for_a_verdict(cells, ALPHA):
        return math.inf
    if isinstance(se, tuple) and isinstance(se[0], str):  # ("rounds", d, variance)
        _, d, var = se
        return float(np.median([sign_mde_pct(cell, var, ALPHA / cells, THRESHOLD, RULE, draws=400)
                                for study in d[:ROUNDS_MDE_STUDIES] for cell in study]))
    se, df = se if isinstance(se, tuple) else (se, np.full(np.shape(se), math.inf))
    if not np.isfinite(se).any():
        return math.inf  # no CI (no between-start estimate): the diff prints an infinite MDE
    se, df = np.asarray(se)[:MDE_STUDIES].ravel(), np.broadcast_to(df, np.shape(se))[:MDE_STUDIES].ravel()
    return float(np.median([mde_from_se(e, f, ALPHA, cells, threshold_pct=THRESHOLD, ci_level=LEVEL, rule=RULE)
                            for e, f in zip(se, df)]))


def geomean_coverage(design: Design, noise: G.Noise, base: np.ndarray, head: np.ndarray) -> float:
    """How often the rounds geometric mean's CI (compare/rounds.py rounds_geometric_mean, the
    instance floor added once by summary.widened_by_instances) covers the true 1 in an A/A.
    Every group's rounds carry the keys 0.0.r, as a sweep's replicate.period.round do."""
    import pandas as pd

    from hostsweep.compare.options import DiffOptions
    from hostsweep.compare.rounds import rounds_geometric_mean
    from hostsweep.compare.summary import widened_by_instances

    options = DiffOptions(instance_floor_pct=instance_floor_pct(noise) if design.floor else None)
    d = np.log(head[:GM_STUDIES]) - np.log(base[:GM_STUDIES])
    hits = []
    for study in d:
        text = [" ".join(f"0.0.{r}={x:.6g}" for r, x in enumerate(cell)) for cell in study]
        rows = pd.DataFrame({"rounds": study.shape[-1], "test": "sign", "d_rounds": text})
        mean = rounds_geometric_mean(rows, LEVEL)
        if mean is not None and options.instance_var > 0:
            mean = widened_by_instances(mean, options)
        hits.append(mean is not None and mean[1] <= 1.0 <= mean[2])
    return float(np.mean(hits))


def rates(rules: str, studies: int, noises: tuple[str, ...] = G.PAIR_NOISES, designs=DESIGNS) -> list[dict]:
    """One row of rates per design, rho and pair noise under `rules` ("new" or "old")."""
    new = rules == "new"
    S = importlib.import_module("hostsweep.compare.stats" if new else "hostsweep.report.diff_stats")
    out = []
    for di, design in enumerate(designs):
        for rho in RHOS:
            for pair in noises:
                noise = G.Noise(rho=rho, pair=pair)
                row = {"design": design.label, "rho": rho, "noise": pair}
                for planted in PLANTED:
                    base, head = simulate(design, noise, studies, planted,
                                          [di, int(rho * 10), G.PAIR_NOISES.index(pair), int(planted * 100)])
                    judged = judge(S, new, design, noise, base, head)
                    if judged is None:
                        break
                    v, low, high, se = judged
                    if planted == 1.0:
                        row["cover"] = float(np.mean((low <= 0) & (0 <= high))) if np.isfinite(low).any() else None
                        row["fwer"] = float((v == "slower").any(axis=1).mean())
                        row["same"] = float((v == "same").mean())
                        row["faster"] = float((v == "faster").any(axis=1).mean())
                        if new:
                            row["mde"] = median_mde(design, se, base.shape[1])
                            if design.rounds:
                                row["gm_cover"] = geomean_coverage(design, noise, base, head)
                    else:
                        row[f"p{round((planted - 1) * 100)}"] = float((v == "slower").mean())
                if "fwer" in row:
                    out.append(row)
    return out


def old_rates(studies: int, noises: tuple[str, ...]) -> list[dict]:
    """The same studies judged by the old rules: a worktree of OLD_COMMIT, this script run in a
    subprocess with it first on PYTHONPATH, the worktree removed afterwards."""
    repo = Path(__file__).resolve().parent.parent
    tree = Path(tempfile.mkdtemp(prefix="hostsweep-old-")) / "tree"
    subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", str(tree), OLD_COMMIT],
                   check=True, capture_output=True)
    try:
        run = subprocess.run([sys.executable, __file__, "--rules", "old", "--studies", str(studies), "--json",
                              "--noises", ",".join(noises)],
                             env={**os.environ, "PYTHONPATH": str(tree)}, cwd=str(tree), check=True,
                             capture_output=True, text=True)
        return json.loads(run.stdout)
    finally:
        subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)], capture_output=True)


RATE_KEYS = ("fwer", "faster", "same", "p5", "p10", "p20")


def print_table(new_rows: list[dict], old_rows: list[dict], studies: int) -> None:
    old = {(r["design"], r["rho"], r["noise"]): r for r in old_rows}
    f = lambda x, w=6: f"{'–':>{w}}" if x is None else f"{x:{w}.3f}" if x != math.inf else f"{'inf':>{w}}"
    print(f"\n## the diff under this VM's noise: 16 cells in 4 engine groups, machine AR(1) SD "
          f"{G.MACHINE_SD:.0%} shared by a group, instance SD {G.INSTANCE_SD:.0%} per engine start, switch cost "
          f"{G.SWITCH:.0%} (rounds), pair noise SD {G.PAIR_SD:.0%} (replay: real pairs), outliers "
          f"{G.OUTLIER_P:.0%} x{G.OUTLIER}, threshold {THRESHOLD:g} %, alpha {ALPHA} (Holm), {studies} studies a row")
    print(f"{'design':>27} {'rho':>3} {'noise':>6} {'rules':>5} {'cover':>6} {'gm cov':>6} {'FWER':>6} "
          f"{'faster':>6} {'same':>6} {'+5%':>6} {'+10%':>6} {'+20%':>6} {'MDE %':>6}")
    for r in new_rows:
        key = (r["design"], r["rho"], r["noise"])
        head = f"{r['design']:>27} {r['rho']:3.1f} {r['noise']:>6}"
        print(f"{head} {'new':>5} {f(r.get('cover'))} {f(r.get('gm_cover'))} "
              + " ".join(f(r.get(k)) for k in RATE_KEYS) + f" {f(r.get('mde'), 6) if r.get('mde', 0) < 1e4 else '   big'}")
        o = old.get(key)
        if o is not None and any(abs((o.get(k) or 0) - (r.get(k) or 0)) > 1e-12 for k in RATE_KEYS):
            print(f"{'':>38} {'old':>5} {f(o.get('cover'))} {'':>6} " + " ".join(f(o.get(k)) for k in RATE_KEYS))
        elif o is None and r["design"] != "rounds 40 + instance floor" and old_rows:
            print(f"{'':>38} {'old':>5} (not judged)")


def realistic(studies: int, with_old: bool = True, noises: tuple[str, ...] = G.PAIR_NOISES) -> None:
    started = time.time()
    new_rows = rates("new", studies, noises)
    old_rows = old_rates(studies, noises) if with_old else []
    print_table(new_rows, old_rows, studies)
    old = f"old rules: commit {OLD_COMMIT}, the same seeds; " if with_old else ""
    print(f"({old}{time.time() - started:.0f} s; a rate near 0.05 over "
          f"{studies} studies has a standard error of about {math.sqrt(0.05 * 0.95 / studies):.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--studies", type=int, default=1000)
    parser.add_argument("--rules", choices=("new", "old"), default="new")
    parser.add_argument("--noises", default=",".join(G.PAIR_NOISES))
    parser.add_argument("--json", action="store_true", help="print the rates as JSON (the old rules' subprocess)")
    parser.add_argument("--no-old", action="store_true", help="skip the old rules")
    args = parser.parse_args()
    noises = tuple(args.noises.split(","))
    if args.json:
        if args.rules == "old":
            import hostsweep

            tree = Path(os.environ.get("PYTHONPATH", "")).resolve()
            assert tree in Path(hostsweep.__file__).resolve().parents, "the old rules must come from the old tree"
        json.dump(rates(args.rules, args.studies, noises), sys.stdout)
        return
    realistic(args.studies, not args.no_old, noises)


if __name__ == "__main__":
    main()
