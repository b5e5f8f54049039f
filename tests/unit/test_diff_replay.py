"""The diff on this machine's real timed pairs (tests/data/raw_timings: three small studies of
tiny-llama measured on a loaded 2-core VM, one with three engine starts): raw_timings.csv is
read back one array per engine start, and a one-cell A/A diff resampled from one cell's real
pairs (outliers, bursts and all) calls it `slower` at most alpha of the time, while a planted
+30 % is found more often than that."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from hostsweep.record.read.sides import pairs_by_start, period_spread
from hostsweep.compare import stats as S

DATA = Path(__file__).resolve().parent.parent / "data" / "raw_timings"
CELLS = sorted(DATA.glob("*.csv"))
DRAWS, ALPHA = 1000, 0.05


def test_the_kept_studies_are_there_and_one_was_measured_in_three_engine_starts():
    assert len(CELLS) == 9
    starts = {p.stem: len(pairs_by_start(pd.read_csv(p))) for p in CELLS}
    assert {n for name, n in starts.items() if name.startswith("gatecal-c")} == {3}
    assert {n for name, n in starts.items() if not name.startswith("gatecal-c")} == {1}


def test_a_file_without_a_replicate_column_is_one_start():
    table = pd.read_csv(CELLS[0]).drop(columns=["replicate"])
    assert len(pairs_by_start(table)) == 1 and pairs_by_start(table)[0].size == len(table)


def test_the_spread_between_periods_is_read_from_the_pairs():
    table = pd.read_csv(CELLS[0])
    var, df = period_spread(table["step_ms"], table["period"])
    medians = table.groupby("period")["step_ms"].median()
    assert df == len(medians) - 1 and var == pytest.approx(np.var(np.log(medians), ddof=1))
    assert period_spread([1.0, 2.0], [0, 0]) == (pytest.approx(math.nan, nan_ok=True), 0.0)


@pytest.mark.parametrize("path", CELLS, ids=[p.stem for p in CELLS])
def test_an_a_a_diff_of_real_pairs_is_called_slower_at_most_alpha_of_the_time(path):
    pool = pairs_by_start(pd.read_csv(path))[0]
    rng = np.random.default_rng(len(path.stem))
    base, head = (rng.choice(pool, (DRAWS, 1, 1, 12)) for _ in range(2))
    slower = (S.judge_arrays(base, head, 5.0, ALPHA, 0.0) == "slower").mean()
    assert slower <= ALPHA + 3 * math.sqrt(ALPHA * (1 - ALPHA) / DRAWS)
    planted = (S.judge_arrays(base, head * 1.3, 5.0, ALPHA, 0.0) == "slower").mean()
    assert planted > 2 * slower
