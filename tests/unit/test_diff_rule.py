"""What `slower` means (diff.rule, compare/rules.py), checked against known answers and
simulated truth: the default rule (a real change whose estimate lies beyond the threshold)
beside the strict margin rule, the verdict interval a reader checks each verdict against, the
gate that refuses to pass when it could not have seen the change it names, the power statement
on its line, and the family-level gate on the geometric mean."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from hostsweep.compare import DiffOptions, DiffResult, diff_options
from hostsweep.compare import rules as R
from hostsweep.compare.summary import summarize_quantities
from hostsweep.compare.verdicts import judge_cells
from hostsweep.config.pairing import balanced_rounds
from hostsweep.config.schema import ConfigError, DiffConfig
from hostsweep.measure.detectable import mde_from_se
from hostsweep.report.diff_report import fmt_bound

ALPHA, T = 0.05, 5.0


def t_rows(d: np.ndarray, se: np.ndarray, df: float = math.inf) -> pd.DataFrame:
    """Gated step_ms rows judged by a t (a start-pairs or floor-widened rounds cell)."""
    n = len(d)
    return pd.DataFrame({"cell": [f"c{i}" for i in range(n)], "quantity": "step_ms", "d": d, "se": se, "df": df,
                         "ratio": np.exp(d), "test": "t", "note": "", "unstable": False, "ci_source": "paired",
                         "between": "paired: 5 start pairs", "design": "paired", "rounds": 0, "d_starts": "",
                         "unstable_reasons": "", "between_var": 0.0, "d_rounds": ""})


def sign_rows(d_rounds: np.ndarray) -> pd.DataFrame:
    """Gated rows paired by rounds and judged by sign tests (no instance floor)."""
    level = 0.95
    median, low, high, coverage = S_rounds(d_rounds, level)
    text = [" ".join(f"0.0.{r}={x:.6f}" for r, x in enumerate(cell)) for cell in d_rounds]
    rows = t_rows(median, np.full(len(median), math.nan))
    return rows.assign(test="sign", se=math.nan, df=math.nan, ci_low=np.exp(low), ci_high=np.exp(high),
                       ci_coverage=coverage, rounds=d_rounds.shape[-1], d_rounds=text, ci_source="paired rounds")


def S_rounds(d: np.ndarray, level: float):
    from hostsweep.compare.stats import rounds_log_ratio

    # rounds_log_ratio takes the sides; base 1 and head e^d give d_r back exactly enough
    return rounds_log_ratio(np.ones_like(d), np.exp(np.round(d, 6)), level)


def result_of(rows: pd.DataFrame, options: DiffOptions) -> DiffResult:
    cells = judge_cells(rows, options)
    result = DiffResult(options, [], [], {}, [], cells, pd.DataFrame(columns=["side"]))
    result.summary = summarize_quantities(cells, options)
    return result


# ---------------------------------------------------------------------------------------
# the two rules, known answers

def test_a_planted_7_5_percent_change_is_slower_under_significant_and_not_under_margin():
    """d = log 1.075 at se 0.02, one cell: the test against no change gives z = 3.6 and the point
    lies above 1.05, so `significant` calls it slower; against 1.05 z is 1.2 < 1.645, so `margin`
    does not (it would need the interval wholly above 1.05)."""
    rows = t_rows(np.array([math.log(1.075)]), np.array([0.02]))
    sig = result_of(rows, DiffOptions(fail_on="slower")).cells.iloc[0]
    mar = result_of(rows, DiffOptions(fail_on="slower", rule="margin")).cells.iloc[0]
    assert sig["verdict"] == "slower" and sig["verdict_low"] > 1.0
    assert mar["verdict"] == "inconclusive" and 1.0 < mar["verdict_low"] < 1.05
    # the same interval, two readings: the bound at alpha one-sided, d - z_0.95 se
    assert sig["verdict_low"] == pytest.approx(math.exp(math.log(1.075) - stats.norm.isf(ALPHA) * 0.02))


def test_a_real_change_inside_the_threshold_is_not_slower_under_either_rule():
    rows = t_rows(np.array([math.log(1.04)]), np.array([0.002]))  # surely real, surely under 5 %
    for rule in R.RULES:
        assert result_of(rows, DiffOptions(rule=rule)).cells.iloc[0]["verdict"] in ("same", "inconclusive")


def test_an_exact_aa_is_never_slower_whatever_its_noise():
    for se in (1e-4, 0.01, 0.2):
        for rule in R.RULES:
            cells = result_of(t_rows(np.zeros(8), np.full(8, se)), DiffOptions(rule=rule)).cells
            assert not cells["verdict"].isin(("slower", "faster")).any()


@pytest.mark.parametrize("rule", R.RULES)
def test_simulated_aas_of_16_cells_are_slower_somewhere_at_most_alpha_of_the_time(rule):
    rng = np.random.default_rng(11)
    d, se = rng.normal(0, 0.03, (4000, 16)), np.full((4000, 16), 0.03)
    p_s, p_f = stats.norm.sf(d / se), stats.norm.cdf(d / se)
    if rule == "margin":
        p_s, p_f = stats.norm.sf((d - math.log(1.05)) / se), stats.norm.cdf((d - math.log(0.95)) / se)
    v = R.judge_family(d, p_s, p_f, np.zeros(d.shape, bool), ALPHA, rule, T,
                       lambda a, b: R.t_bounds(d, se, np.full(d.shape, math.inf), a, b))[0]
    assert (v == "slower").any(axis=1).mean() <= ALPHA + 3 * math.sqrt(ALPHA * (1 - ALPHA) / 4000)


# ---------------------------------------------------------------------------------------
# the verdict interval: slower <=> what is printed says slower

def test_holm_levels_reject_exactly_where_holms_adjusted_p_values_do():
    from hostsweep.compare.stats import holm

    p = np.random.default_rng(3).random((3000, 12)) ** 3  # many small p-values, ties of rank
    levels = R.holm_levels(p, ALPHA)
    assert ((p <= levels) == (holm(p) <= ALPHA)).all()


@pytest.mark.parametrize("rule", R.RULES)
def test_the_printed_verdict_interval_agrees_with_every_verdict_and_with_holm_over_many_seeds(rule):
    """Random families of t cells and of sign-test (rounds) cells, some changed: a cell is slower
    exactly when its verdict interval says so under the rule, and its interval excludes the
    rule's null exactly when Holm's adjusted p-value is <= alpha."""
    null = 0.0 if rule == "significant" else math.log(1.05)
    for seed in range(40):
        rng = np.random.default_rng(seed)
        truth = rng.choice([0.0, 0.05, 0.08, 0.15, -0.1], 10)
        se = rng.uniform(0.005, 0.05, 10)
        t_cells = t_rows(truth + rng.normal(0, se), se, df=rng.choice([4.0, math.inf]))
        sign_cells = sign_rows(truth[:, None] + rng.normal(0, 0.06, (10, 24)))
        for rows in (t_cells, sign_cells):
            cells = result_of(rows, DiffOptions(rule=rule)).cells
            low, high = np.log(cells["verdict_low"]), np.log(cells["verdict_high"])
            says_slower = (low > null) & (cells["d"] > math.log(1.05))
            assert ((cells["verdict"] == "slower") == says_slower).all(), seed
            assert ((low > null) == (cells["p_slower_holm"] <= ALPHA)).all(), seed
            says_faster = (high < -null if rule == "significant" else high < math.log(0.95)) & \
                (cells["d"] < math.log(0.95))
            assert ((cells["verdict"] == "faster") == says_faster).all(), seed


def test_bounds_print_with_enough_decimals_to_tell_a_side_of_the_threshold():
    marks = (0.95, 1.0, 1.05)
    assert fmt_bound(1.0504, marks) != fmt_bound(1.0496, marks)
    assert float(fmt_bound(1.0504, marks)) > 1.05 > float(fmt_bound(1.0496, marks))
    assert fmt_bound(1.123, marks) == "1.123" and fmt_bound(math.inf, marks) == "∞"


# ---------------------------------------------------------------------------------------
# no vacuous pass, and the power on the gate line

def test_a_gated_cell_with_no_test_makes_the_gate_refuse_in_one_line():
    rows = t_rows(np.zeros(3), np.array([0.01, 0.01, math.nan]))
    rows.loc[2, ["test", "ci_source"]] = ["", "point only (no raw pairs)"]
    result = result_of(rows, DiffOptions(fail_on="slower"))
    why = result.refusal()
    assert why is not None and "\n" not in why and "1 gated cell(s) have no test (c2" in why
    assert result.gate() == (True, why)


def test_a_gated_cell_whose_mde_exceeds_the_bound_makes_the_gate_refuse_saying_what_to_add():
    rows = t_rows(np.zeros(4), np.array([0.01, 0.01, 0.01, 0.08]))  # c3 sees only changes of ~+30 %
    result = result_of(rows, DiffOptions(fail_on="slower"))
    why = result.refusal()
    assert why is not None and "\n" not in why and "1 of 4 gated cell(s) have an MDE" in why
    assert "15 %" in why and "c3" in why and "rounds" in why
    # told a looser bound, or none, the same diff passes and says what it could have seen
    for factor in (20.0, None):
        loose = result_of(rows, DiffOptions(fail_on="slower", max_mde_factor=factor))
        failed, line = loose.gate()
        assert loose.refusal() is None and not failed and "would have been found 80 % of the time" in line


def test_a_regression_found_fails_the_gate_even_where_another_cell_could_not_see_the_threshold():
    rows = t_rows(np.array([math.log(1.3), 0.0]), np.array([0.01, 0.08]))
    result = result_of(rows, DiffOptions(fail_on="slower"))
    assert result.refusal() is None and result.gate()[0] and "c0" in result.gate()[1]


def test_the_power_statement_matches_a_simulation_within_binomial_error():
    """The gate line's '+X % ... found 80 % of the time' (the largest MDE of the judged cells,
    under the rule in force): one of 8 cells planted at X, the others unchanged, 4000 studies."""
    se, m, studies = 0.02, 8, 4000
    for rule in R.RULES:
        result = result_of(t_rows(np.zeros(m), np.full(m, se)), DiffOptions(fail_on="slower", rule=rule))
        mde = mde_from_se(se, math.inf, ALPHA, m, threshold_pct=T, rule=rule)
        assert f"+{mde:.1f} % change in any judged cell would have been found 80 % of the time" in result.gate()[1]
        rng = np.random.default_rng(5)
        d = rng.normal(0, se, (studies, m))
        d[:, 0] += math.log1p(mde / 100)
        null = 0.0 if rule == "significant" else math.log(1.05)
        v = R.judge_family(d, stats.norm.sf((d - null) / se), stats.norm.cdf((d + null) / se),
                           np.zeros(d.shape, bool), ALPHA, rule, T,
                           lambda a, b: R.t_bounds(d, np.full(d.shape, se), np.full(d.shape, math.inf), a, b))[0]
        found = (v[:, 0] == "slower").mean()
        assert abs(found - 0.8) <= 3 * math.sqrt(0.8 * 0.2 / studies) + 0.01, (rule, found)


# ---------------------------------------------------------------------------------------
# the family-level gate, the rule's validation, balanced rounds

def test_slower_overall_fails_when_the_release_as_a_whole_is_slower_and_passes_an_aa():
    rng = np.random.default_rng(2)
    se = np.full(16, 0.03)
    slow = result_of(t_rows(math.log(1.08) + rng.normal(0, 0.03, 16), se), DiffOptions(fail_on="slower_overall"))
    s = slow.summary["step_ms"]
    assert s["overall"] == "slower" and s["verdict_low"] > 1.0 and s["geomean_ratio"] > 1.05
    failed, why = slow.gate()
    assert failed and "the release as a whole is slower" in why and "whole release" in why
    flat = result_of(t_rows(rng.normal(0, 0.03, 16), se), DiffOptions(fail_on="slower_overall"))
    assert flat.summary["step_ms"]["overall"] != "slower" and not flat.gate()[0]


def test_an_unknown_rule_is_one_config_error_naming_the_allowed_values():
    with pytest.raises(ConfigError, match=r"^diff.rule='strict' is not allowed; allowed: significant, margin$"):
        diff_options(DiffConfig(rule="strict"))
    with pytest.raises(ConfigError, match=r"^diff.max_mde_factor must be > 0"):
        diff_options(DiffConfig(max_mde_factor=0))
    assert diff_options(DiffConfig()).rule == "significant"


def test_paired_rounds_are_rounded_up_to_a_multiple_of_four():
    assert [balanced_rounds(n) for n in (6, 8, 12, 30, 40)] == [8, 8, 12, 32, 40]
