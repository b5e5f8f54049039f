"""The diff's speed canary: a head measured on a slower machine is told so, and the
normalized ratio takes the machine out, beside (not instead of) the raw ratio."""
from __future__ import annotations

import math
import re

import numpy as np
import pandas as pd
import pytest

from hostsweep.compare.canary import machine_line, normalized_ratio, side_canary


def side(canary_ms: float, n: int = 8, cv: float = 0.03, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame({"canary_ms": canary_ms * np.exp(rng.normal(0, cv, n))})


def test_a_head_on_a_machine_31_percent_slower_is_told_so():
    base, head = side_canary(side(1.691)), side_canary(side(1.691 * 1.31, seed=1))
    assert base.ms == pytest.approx(1.691, rel=0.03) and head.cells == 8
    expected = round((head.ms / base.ms - 1) * 100)
    assert abs(expected - 31) <= 2
    assert machine_line(base, head) == (f"the head's machine ran {expected} % slower than the base's "
                                        f"(speed canary {head.ms:.3f} vs {base.ms:.3f} ms)")
    assert re.match(r"the head's machine ran 2\d % faster than the base's", machine_line(head, base))
    assert machine_line(None, head) is None


def test_too_few_cells_with_a_canary_give_no_side_canary():
    assert side_canary(side(1.7, n=2)) is None
    assert side_canary(pd.DataFrame({"step_ms": [1.0, 2.0, 3.0]})) is None
    assert side_canary(pd.DataFrame({"canary_ms": [1.0, float("nan"), "", 1.1, 1.2]})).cells == 3


def test_a_ratio_that_is_all_machine_normalizes_to_one_with_a_wider_ci():
    base, head = side_canary(side(1.7)), side_canary(side(1.7 * 1.35, seed=2))
    ratio, low, high = normalized_ratio(1.35, 1.30, 1.40, 0.95, base, head)
    assert ratio == pytest.approx(1.0, abs=0.04) and low < 1.0 < high
    assert math.log(high / low) > math.log(1.40 / 1.30)  # the canary's own uncertainty is added
    assert all(math.isnan(v) for v in normalized_ratio(1.35, 1.30, 1.40, 0.95, None, head))


@pytest.mark.parametrize("seed", range(3))
def test_the_normalized_ci_covers_a_planted_regression_the_machine_also_hid(seed):
    """The head's code is 10 % slower, its machine 20 % faster: the raw ratio says 0.92, the
    normalized one 1.10."""
    base, head = side_canary(side(1.7, seed=seed)), side_canary(side(1.7 / 1.2, seed=seed + 10))
    raw = 1.10 / 1.2
    ratio, low, high = normalized_ratio(raw, raw * 0.97, raw * 1.03, 0.95, base, head)
    assert low <= 1.10 <= high


def test_the_diff_says_the_heads_machine_was_slower_and_normalizes_beside_the_raw_verdicts():
    """An A/A pair whose head met a machine 30 % slower: the raw ratios say 1.3 and keep the
    verdicts; the canary columns say 1.0; the console names the machines."""
    from hostsweep.compare import DiffOptions, diff
    from hostsweep.report.diff_report import cell_table, console
    from tests.unit.test_diff import side as diff_side

    base, raw_b = diff_side("0.31.0", {}, seed=1)
    head, raw_h = diff_side("0.32.0", {}, seed=2)
    head["step_ms"] *= 1.3
    raw_h = {k: v * 1.3 for k, v in raw_h.items()}
    base["canary_ms"] = side(1.7, n=len(base))["canary_ms"].to_numpy()
    head["canary_ms"] = side(1.7 * 1.3, n=len(head), seed=3)["canary_ms"].to_numpy()
    result = diff(base, head, {**raw_b, **raw_h}, DiffOptions(noise_floor_pct=1.0, normalize="canary"))
    steps = result.cells[result.cells["quantity"] == "step_ms"]
    assert steps["ratio"].between(1.2, 1.4).all() and (steps["verdict"] == "slower").all()  # raw: unchanged
    assert steps["ratio_canary"].between(0.9, 1.1).all()
    assert ((steps["ci_low_canary"] <= 1.0) & (1.0 <= steps["ci_high_canary"])).mean() >= 5 / 6
    assert re.search(r"machines: the head's machine ran (2[5-9]|3[0-5]) % slower than the base's", console(result))
    assert "ratio / canary" in cell_table(result, "step_ms")
    plain = diff(base, head, {**raw_b, **raw_h}, DiffOptions(noise_floor_pct=1.0))
    assert "ratio_canary" not in plain.cells and plain.machine == result.machine  # the line is always there


def test_normalize_takes_only_canary():
    from hostsweep.compare import DiffOptions

    with pytest.raises(ValueError, match="normalize='speed' is not allowed; allowed: null, canary"):
        DiffOptions(normalize="speed").check()


def test_the_comparison_report_gives_each_skus_host_speed():
    from hostsweep.report.fit_report import host_speed_table

    cells = pd.DataFrame({"sku": ["h100"] * 3 + ["h200"] * 3, "canary_ms": [1.0, 1.1, 1.2, 1.5, 1.6, float("nan")],
                          "canary_shift_pct": [2.0, 3.0, 1.0, 9.0, 4.0, 5.0]})
    table = host_speed_table(cells).set_index("sku")
    assert table.loc["h100", "canary_ms_median"] == pytest.approx(1.1) and table.loc["h200", "cells"] == 2
    assert table.loc["h200", "moved_within_a_group_pct_max"] == 9.0
    assert host_speed_table(pd.DataFrame({"sku": ["h100"], "step_ms": [1.0]})) is None


def test_the_diff_table_names_the_level_its_cis_were_taken_at():
    from hostsweep.compare import DiffOptions, diff
    from hostsweep.report.diff_report import cell_table
    from tests.unit.test_diff import side as diff_side

    base, raw_b = diff_side("0.31.0", {}, seed=1)
    head, raw_h = diff_side("0.32.0", {}, seed=2)
    at_90 = cell_table(diff(base, head, {**raw_b, **raw_h}, DiffOptions(noise_floor_pct=1.0, level=0.9)), "step_ms")
    assert "90% CI" in at_90 and not any("95" in str(c) for c in at_90.columns)
    at_95 = cell_table(diff(base, head, {**raw_b, **raw_h}, DiffOptions(noise_floor_pct=1.0)), "step_ms")
    assert "95% CI" in at_95
