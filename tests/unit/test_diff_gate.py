"""The diff gate's error rates against simulated truth, over many simulated studies at once
(compare/stats.judge_arrays is what compare/cellwise.py judges with, vectorized): the
family-wise false-alarm rate of a 100-cell gate with nothing changed stays at or under its
alpha when the between-start spread is seen (several starts, or a stated noise floor), and
is far above it when it is not (why the gate refuses one-start sides with no estimate);
power against a planted +10 %; TOST `same` at the threshold; Holm; the minimum detectable
effect is found about 80 % of the time. benchmarks/gate_calibration.py prints the tables."""
from __future__ import annotations

import math

import numpy as np
import pytest

from hostsweep.measure.detectable import mde_from_se, minimum_detectable_effect_pct
from hostsweep.compare import stats as S

CELLS, PAIRS, WITHIN = 100, 12, 0.015
STUDIES = 500  # simulated release diffs per property (a rate's standard error about 0.01 at 5 %)
ALPHA = 0.05
SLACK = 3 * math.sqrt(ALPHA * (1 - ALPHA) / STUDIES)  # three standard errors of a rate at alpha


def sides(rng: np.random.Generator, k: int, spread: float, shift: np.ndarray, outlier: bool = True,
          studies: int = STUDIES) -> tuple[np.ndarray, np.ndarray]:
    """Base and head pairs (studies, cells, k, n): log-normal noise within a start, a log-normal
    shift per engine start, one pair per start 40 % slow, the head shifted per cell."""
    def one(scale: np.ndarray) -> np.ndarray:
        x = np.exp(rng.normal(0, WITHIN, (studies, CELLS, k, PAIRS)) + rng.normal(0, spread, (studies, CELLS, k, 1)))
        if outlier:
            x[..., 0] *= 1.4
        return x * scale[None, :, None, None]
    return one(np.ones(CELLS)), one(shift)


def false_alarms(verdicts: np.ndarray) -> float:
    return float((verdicts == "slower").any(axis=1).mean())


@pytest.mark.parametrize("k,spread,floor", [(1, 0.0, 0.0), (1, 0.02, 0.02), (1, 0.03, 0.03), (3, 0.02, None),
                                            (5, 0.03, None)])
def test_a_100_cell_gate_with_nothing_changed_fails_at_most_alpha_of_the_time(k, spread, floor):
    rng = np.random.default_rng([k, int(spread * 100)])
    base, head = sides(rng, k, spread, np.ones(CELLS))
    between = math.nan if floor is None else math.log1p(math.expm1(floor)) ** 2
    assert false_alarms(S.judge_arrays(base, head, 5.0, ALPHA, between)) <= ALPHA + SLACK


def test_one_start_sides_judged_without_the_between_start_spread_raise_false_alarms_so_they_get_no_verdict():
    base, head = sides(np.random.default_rng(1), 1, 0.03, np.ones(CELLS))
    assert false_alarms(S.judge_arrays(base, head, 5.0, ALPHA, between_var=0.0)) > 0.5  # as if no spread: alarms
    assert (S.judge_arrays(base, head, 5.0, ALPHA) == "inconclusive").all()  # no estimate: no verdict at all


# slower tests ratio <= 1 + t (a shifted null): a planted change is found once its CI clears the
# threshold, so 15 % at t = 5 %, three times the noise floor's reach; 10 % at 5 % is found 23-75 %
# of the time here (the MDE says so per cell), 98 % at t = 3 %.
@pytest.mark.parametrize("k,spread,floor,power", [(1, 0.0, 0.0, 0.99), (1, 0.01, 0.01, 0.95), (5, 0.01, None, 0.99)])
def test_a_planted_15_percent_regression_is_found_and_the_unchanged_cells_stay_quiet(k, spread, floor, power):
    shift = np.ones(CELLS)
    shift[:10] = 1.15
    base, head = sides(np.random.default_rng([2, k]), k, spread, shift, studies=200)
    v = S.judge_arrays(base, head, 5.0, ALPHA, math.log1p(floor) ** 2 if floor is not None else math.nan)
    assert (v[:, :10] == "slower").mean() >= power
    assert (v[:, 10:] == "slower").any(axis=1).mean() <= ALPHA + 3 * math.sqrt(ALPHA * (1 - ALPHA) / 200)


@pytest.mark.parametrize("true_ratio", [1.04, 1.05])
def test_under_the_margin_rule_a_true_change_inside_the_threshold_is_called_slower_at_most_alpha_of_the_time(
        true_ratio):
    """rule=margin shifts the null to 1 + t: a true +4 % (or exactly +5 %) at t = 5 % on precise
    cells is not `slower` beyond alpha, where the default rule (a real change whose point lies
    beyond 1 + t) calls the +5 % slower about half the time."""
    base, head = sides(np.random.default_rng(5), 5, 0.005, np.full(CELLS, true_ratio), studies=200)
    v = S.judge_arrays(base, head, 5.0, ALPHA, rule="margin")
    assert (v == "slower").mean() <= ALPHA
    assert (v == "slower").any(axis=1).mean() <= ALPHA + 3 * math.sqrt(ALPHA * (1 - ALPHA) / 200)


def test_under_the_significant_rule_a_real_change_whose_estimate_lands_beyond_the_threshold_is_slower():
    """The default rule: a true +5 % on precise cells is real (its test against no change
    rejects) and its estimate lands above 1.05 about half the time: that half is `slower`;
    a true +3 % (estimates well inside the threshold) is not."""
    base, head = sides(np.random.default_rng(6), 5, 0.005, np.full(CELLS, 1.05), studies=100)
    assert 0.3 <= (S.judge_arrays(base, head, 5.0, ALPHA) == "slower").mean() <= 0.7
    base, head = sides(np.random.default_rng(7), 5, 0.005, np.full(CELLS, 1.03), studies=100)
    assert (S.judge_arrays(base, head, 5.0, ALPHA) == "slower").mean() == 0.0


def test_same_is_an_equivalence_test_wrong_at_most_alpha_at_the_threshold():
    rng = np.random.default_rng(3)
    for edge in (1.05, 0.95):  # a true ratio exactly on the threshold is not `same`
        base, head = sides(rng, 1, 0.0, np.full(CELLS, edge), studies=50)
        assert (S.judge_arrays(base, head, 5.0, ALPHA, 0.0) == "same").mean() <= ALPHA + 0.01
    # well inside: shown the same (its printed 95 % CI inside the band, stricter than TOST's 90 %)
    base, head = sides(rng, 1, 0.0, np.full(CELLS, 1.01), studies=50)
    assert (S.judge_arrays(base, head, 5.0, ALPHA, 0.0) == "same").mean() >= 0.9


def test_holm_adjusts_step_down_and_keeps_the_family_wise_error():
    p = np.array([0.01, 0.04, 0.03, 0.005, np.nan])
    assert S.holm(p)[:4] == pytest.approx([0.03, 0.06, 0.06, 0.02]) and math.isnan(S.holm(p)[4])
    uniform = np.random.default_rng(4).random((4000, CELLS))  # true nulls, independent
    assert (S.holm(uniform) <= ALPHA).any(axis=1).mean() <= ALPHA + 3 * math.sqrt(ALPHA * (1 - ALPHA) / 4000)
    assert (S.holm(uniform) >= uniform).all()


@pytest.mark.parametrize("rule,threshold", [("margin", 1.0), ("significant", 1.0), ("significant", 3.0)])
def test_the_minimum_detectable_effect_is_found_about_80_percent_of_the_time(rule, threshold):
    rng = np.random.default_rng(5)
    base, head = sides(rng, 1, 0.0, np.ones(CELLS), outlier=False, studies=20)
    _, var, df = S.median_log(base[:, :, 0])
    se = math.sqrt(2 * float(np.mean(var)))
    mde = mde_from_se(se, 2 * (PAIRS - 1), ALPHA, 1, threshold_pct=threshold, rule=rule)
    base, head = sides(rng, 1, 0.0, np.full(CELLS, 1 + mde / 100), outlier=False, studies=20)
    d, se_d, df_d = _d_se_df(base, head)
    slower, _, _ = S.pvalues(d, se_d, df_d, threshold, 0.0 if rule == "significant" else None)
    found = (slower <= ALPHA) & (np.exp(d) > 1 + threshold / 100)
    assert 0.7 <= found.mean() <= 0.9


def _d_se_df(base: np.ndarray, head: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    (eb, vb, fb), (eh, vh, fh) = S.side_arrays(base), S.side_arrays(head)
    return eh - eb, np.sqrt(vb + vh), S.satterthwaite([vb, vh], [fb, fh])


def test_a_cells_mde_grows_with_its_ci_and_its_between_start_spread():
    tight = minimum_detectable_effect_pct(5.0, 4.95, 5.05, 0.95)
    assert 0 < tight < minimum_detectable_effect_pct(5.0, 4.8, 5.2, 0.95)
    assert tight < minimum_detectable_effect_pct(5.0, 4.95, 5.05, 0.95, between_start_pct=2.0)
    assert minimum_detectable_effect_pct(5.0, 4.95, 5.05, 0.95, threshold_pct=10) > 10
    assert math.isnan(minimum_detectable_effect_pct(5.0, float("nan"), 5.05, 0.95))


def test_the_gate_line_says_refused_once_where_a_pass_would_mean_nothing_and_pass_or_fail_otherwise():
    import math

    import numpy as np

    from hostsweep.compare.options import DiffOptions
    from tests.unit.test_diff_rule import result_of, t_rows

    blind = result_of(t_rows(np.zeros(4), np.array([0.01, 0.01, 0.01, 0.08])), DiffOptions(fail_on="slower"))
    line = blind.gate_line()
    assert line.startswith("diff.fail_on=slower: REFUSED (exit 2): 1 of 4 gated cell(s) have an MDE")
    assert line.count("diff.fail_on=slower") == 1 and "\n" not in line
    found = result_of(t_rows(np.array([math.log(1.3), 0.0]), np.array([0.01, 0.08])), DiffOptions(fail_on="slower"))
    assert found.gate_line().startswith("diff.fail_on=slower: FAIL: 1 cell(s) slower")
    quiet = result_of(t_rows(np.zeros(3), np.full(3, 0.01)), DiffOptions(fail_on="slower"))
    assert quiet.gate_line().startswith("diff.fail_on=slower: pass: ")
    assert result_of(t_rows(np.zeros(3), np.full(3, 0.01)), DiffOptions()).gate_line() == ""
