"""The comparison report on constructed tables: falsifying cells are reported with the right
CI-aware margin, verdicts map as documented, the residual tells a constant from a k-scaling
term, the report renders (Markdown and self-contained HTML) with modes and SKUs missing,
and every figure is written and non-empty."""
from __future__ import annotations

import base64
import re
from dataclasses import asdict

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from hostsweep.config.options import load_calibration, load_model_shape, load_sku
from hostsweep.model.study_fit import CalibrationTerms, FitOptions, calibration_terms, fit_study
from hostsweep.model.synthetic import clean_step_s, grid, host_truth_s, measure, push_below_bound
from hostsweep.report import figures as F
from hostsweep.report import fit_tables
from hostsweep.report.document import Document, Figure, Table, Text, to_html, to_markdown
from hostsweep.report.fit_report import Context, build, write_figures
from hostsweep.report.study_modes import mode_sections

TP_STUDY = calibration_terms(load_calibration("seed002-h100"))
TWO_SKUS = CalibrationTerms({"h100": TP_STUDY.allreduce["h100"], "h200": TP_STUDY.allreduce["h100"]}, TP_STUDY.host)
SHAPES = {"llama-3.1-70b": load_model_shape("llama-3.1-70b")}
SKUS = {s: asdict(load_sku(s)) for s in ("h100", "h200")}
BOTH = grid(["h100", "h200"], "llama-3.1-70b", SHAPES, SKUS)


def study_cells(seed: int = 0, truth: str = "invariant", factor: float = 0.75) -> pd.DataFrame:
    """The TP study's [2] grid on H100 and H200 from known parameters, H200 TP-4 measured at factor
    × (S(N) + T_ar), with the identity columns a selection read from MLflow carries."""
    step = clean_step_s(BOTH, 0.30, TWO_SKUS.allreduce, host_truth_s(truth, BOTH, TWO_SKUS.host))
    cells = measure(BOTH, step, 0.015, seed)
    h200_tp4 = ((cells["sku"] == "h200") & (cells["tp"] == 4)).to_numpy()
    cells = push_below_bound(cells, h200_tp4, TWO_SKUS.allreduce, TWO_SKUS.host, factor)
    return cells.assign(mode="eager", run_id=[f"run{i:02d}" for i in range(len(cells))],
                        parent_run_id="parent0", cell_key=[f"key{i}" for i in range(len(cells))],
                        host_frac=0.6, host_ms=10.0, device_ms=8.0)


def fit_of(cells: pd.DataFrame, **options) -> dict:
    return fit_study(cells, TWO_SKUS, FitOptions("h100", resamples=300, **options)).to_dict()


@pytest.fixture(scope="module")
def fitted() -> tuple[pd.DataFrame, dict]:
    cells = study_cells()
    return cells, fit_of(cells)


def test_cells_below_the_bound_are_listed_with_their_margin_and_ci_verdict(fitted):
    cells, fit = fitted
    pred = fit_tables.predictions(fit)
    below = fit_tables.below_bound_cells(pred)
    h200_tp4 = pred[(pred["sku"] == "h200") & (pred["tp"] == 4)]
    assert sorted(below["run_id"]) == sorted(h200_tp4["run_id"])  # every one of them, nothing else
    bound = pred.set_index("run_id")["bound_ms"]
    for row in below.itertuples():
        assert row.margin_ms == pytest.approx(row.step_ms - bound[row.run_id])
        assert row.margin_ms < 0 and row.ci_excludes_bound == (row.step_ci_high_ms < bound[row.run_id])


def test_a_cell_below_the_bound_whose_ci_reaches_it_is_listed_but_not_evidence():
    cells = study_cells()
    pick = ((cells["sku"] == "h200") & (cells["tp"] == 4)).to_numpy()
    cells = push_below_bound(cells, pick, TWO_SKUS.allreduce, TWO_SKUS.host, 0.99)  # 1% under, CI ±2.9%
    pred = fit_tables.predictions(fit_of(cells))
    below = fit_tables.below_bound_cells(pred)
    assert len(below) == pick.sum() and not below["ci_excludes_bound"].any()
    above = pred[~pred["run_id"].isin(below["run_id"]) & (pred["role"] == "held-out")]
    assert (above["margin_ms"] >= 0).all()


def test_group_verdicts_are_validated_falsified_and_inconclusive_as_documented(fitted):
    _, fit = fitted
    groups = fit_tables.heldout_groups(fit, fit_tables.predictions(fit)).set_index(["sku", "tp"])
    assert groups.loc[("h100", 4), "verdict"] == "validated"
    assert groups.loc[("h200", 4), "verdict"] == "falsified"
    assert groups.loc[("h200", 2), "verdict"] == "inconclusive"  # a training TP degree cannot separate families
    assert groups.loc[("h200", 4), "below_bound_ci"] >= groups.loc[("h200", 4), "needed"]
    in_ci, n = map(int, groups.loc[("h100", 4), "model_in_ci"].split("/"))
    assert n == 12 and 0 <= in_ci <= n


@pytest.mark.parametrize("truth,shape", [("invariant", "constant"), ("times_k", "grows with k"),
                                         ("over_k", "shrinks with k")])
def test_the_residual_after_compute_and_allreduce_is_constant_only_for_a_tp_invariant_term(truth, shape):
    cells = study_cells(truth=truth, factor=1.0)
    cells = cells[cells["sku"] == "h100"]
    fit = fit_study(cells, TWO_SKUS, FitOptions("h100", resamples=300)).to_dict()
    per_tp, ratios = fit_tables.residuals(fit_tables.predictions(fit), 500)
    (row,) = ratios.to_dict(orient="records")
    assert row["residual"] == shape, row
    assert set(per_tp["tp"]) == {2, 4}


def test_shrink_reports_measured_ideal_and_the_baseline_range(fitted):
    _, fit = fitted
    table = fit_tables.shrink(fit).set_index("sku")
    assert table.loc["h100", "ideal"] == 2.0
    assert 1.0 < table.loc["h100", "measured_in_regime"] < table.loc["h100", "baseline_min"] <= table.loc["h100", "baseline_max"]


def context(**changes) -> Context:
    values = dict(study="t", experiment="hostsweep-t", experiment_id="1", tracking_uri="sqlite:///x.db",
                  compare_run_id="cmp0", fit_run_id="fit0", models_experiment="models", created="2026-11-30",
                  command="python -m hostsweep stage=compare", expected_skus=("h100", "h200"),
                  sources=[{"term": "allreduce", "sku": "h100", "value": "λ", "source": "calibration", "run_id": "cal0"}])
    return Context(**{**values, **changes})


def test_the_report_names_every_run_and_embeds_its_figures(fitted, tmp_path):
    cells, fit = fitted
    doc, _ = build(context(), cells, fit, tmp_path)
    markdown, page = to_markdown(doc, tmp_path), to_html(doc)
    for run_id in ["cmp0", "fit0", "parent0", "cal0", *cells["run_id"]]:
        assert run_id in markdown and run_id in page
    assert "falsified" in markdown and "validated" in markdown
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(images) == 5 and all(base64.b64decode(data)[:4] == b"\x89PNG" for data in images)
    assert "<img" in page and 'src="figures' not in page  # nothing for a blob frame to fail to load
    assert all((tmp_path / link).is_file() for link in re.findall(r"\]\((figures/[^)]+)\)", markdown))


def test_the_report_says_what_is_absent_and_renders_without_split_modes_or_a_sku(tmp_path):
    cells = study_cells()
    cells = cells[cells["sku"] == "h100"].drop(columns=["host_frac", "host_ms", "device_ms"])
    fit = fit_study(cells, TWO_SKUS, FitOptions("h100", resamples=300)).to_dict()
    doc, _ = build(context(expected_skus=("h100", "h200")), cells, fit, tmp_path)
    markdown = to_markdown(doc, tmp_path)
    assert "absent (no cells selected): h200" in markdown
    assert "absent: no split cells" in markdown
    assert "absent: no mode other than eager in the selection" in markdown
    to_html(doc)


def test_a_present_mode_gets_its_comparison_with_eager():
    cells = study_cells().drop(columns=["run_id"]).assign(engine_args='{"enforce_eager": true}')
    graph = cells.assign(mode="graph", step_ms=cells["step_ms"] * 0.8, engine_args='{"enforce_eager": false}')
    sections = {s.title.split(":")[0]: s for s in mode_sections(pd.concat([cells, graph]))}
    assert list(sections) == ["graph vs eager"]
    section = sections["graph vs eager"]
    assert section.title.startswith("graph vs eager: graph capture")
    assert section.status == "present" and len(next(iter(section.tables.values()))) == len(cells)
    assert set(section.tables) == {"cells", "crossover"}


def test_every_figure_is_written_and_not_empty(fitted, tmp_path):
    cells, fit = fitted
    pred = fit_tables.predictions(fit)
    forms = fit_tables.form_mape(pred, [f["form"] for f in fit["forms"]], 200)
    families = {f["form"]: f["family"] for f in fit["forms"]}
    paths = write_figures(pred, cells, forms, fit_tables.regime_table(cells), families, tmp_path)
    assert set(paths) == {"step_composition", "predicted_vs_measured", "heldout_mape", "regime_map", "step_times"}
    for path in paths.values():
        with Image.open(path) as image:
            pixels = np.asarray(image.convert("L"))
        assert image.width > 300 and image.height > 200 and path.stat().st_size > 10_000
        assert pixels.std() > 10  # something is drawn, not a blank canvas


def test_the_step_composition_draws_a_model_no_batch_and_ctx_has_at_every_degree(fitted, tmp_path):
    """With unstable cells left out, a model may have no (batch, ctx) measured at every TP
    degree: the figure takes the point with the most degrees instead of failing the report."""
    _, fit = fitted
    pred = fit_tables.predictions(fit)
    smallest = (pred["batch"] == pred["batch"].min()).to_numpy()
    lowest_tp = (pred["tp"] == pred["tp"].min()).to_numpy()
    apart = pred[smallest == lowest_tp]  # the lowest degree only at the smallest batch, the others elsewhere
    assert (apart.groupby(["sku", "model", "batch", "ctx"])["tp"].nunique() == 1).all()
    path = F.save(F.step_composition(apart), tmp_path / "composition.png")
    assert path.stat().st_size > 10_000


def test_figures_for_nothing_say_so_instead_of_failing(tmp_path):
    for fig in (F.regime_map(fit_tables.regime_table(pd.DataFrame(columns=["sku", "mode", "model", "tp", "batch", "ctx"]))),
                F.heldout_mape(pd.DataFrame()), F.step_times(pd.DataFrame())):
        assert F.save(fig, tmp_path / "x.png").stat().st_size > 1000


def _step_cells(n_ctx: int, n_batch: int) -> pd.DataFrame:
    return pd.DataFrame([{"sku": "cpu", "model": "m", "mode": "eager", "tp": 1, "ctx": c, "batch": b,
                          "step_ms": 1.0 + 0.01 * b, "step_ci_low_ms": 0.9, "step_ci_high_ms": 1.2 + 0.01 * b}
                         for c in range(8, 8 + n_ctx) for b in range(1, n_batch + 1)])


def test_step_times_names_a_few_lines_in_a_legend_and_a_big_grids_lines_by_count():
    small = F.step_times(_step_cells(3, 4)).axes[0]
    assert small.get_legend() is not None and len(small.get_legend().get_texts()) == 3
    assert [t.get_text() for t in small.get_xticklabels()] == ["1", "2", "3", "4"]
    big = F.step_times(_step_cells(100, 100)).axes[0]  # a 10,000-cell study
    assert big.get_legend() is None and "100 lines" in big.get_title()
    assert len(big.get_xticks()) < 20  # not a label per batch


def test_markdown_and_html_escape_table_text_and_keep_inline_markup(tmp_path):
    png = F.save(F.empty("x"), tmp_path / "f.png")
    doc = Document("T").add(Text("a **bold** `code` <tag>"), Table(pd.DataFrame({"a|b": ["<x>"], "v": [1.23456]}), digits=2),
                            Figure(png, "cap"))
    page, markdown = to_html(doc), to_markdown(doc, tmp_path)
    assert "<strong>bold</strong>" in page and "<code>code</code>" in page and "&lt;tag&gt;" in page
    assert "&lt;x&gt;" in page and "1.23" in page and "1.235" not in page
    assert "a\\|b" in markdown and "![cap](f.png)" in markdown


def test_the_overall_verdict_says_when_every_untrained_group_was_falsified_rather_than_missing():
    from hostsweep.model.verdict import overall_verdict

    out = overall_verdict([], [("cpu", 2)])
    assert out["verdict"] == "inconclusive"
    assert "(cpu TP-2) were falsified" in out["reason"]
    assert overall_verdict([])["reason"] == "no held-out group at an untrained TP degree is left to compare"
    kept = [{"sku": "h200", "tp": 4, "verdict": "k-invariant"}]
    assert overall_verdict(kept, [("cpu", 2)])["verdict"] == "k-invariant"  # a kept group still decides


@pytest.mark.parametrize("cells, expected", [(1, "inconclusive"), (2, "inconclusive"), (3, "k-scaling"),
                                             (8, "k-scaling")])
def test_a_family_verdict_needs_cells_enough_for_a_bootstrap_interval(cells, expected):
    """One held-out cell resamples to itself: a zero-width 'CI' that clears any margin. Below 3
    cells the group is inconclusive and says why, however far apart the families' MAPEs are."""
    from hostsweep.model.verdict import MIN_CELLS_FOR_A_FAMILY, host_family_verdict

    rng = np.random.default_rng(cells)
    invariant, scaling = 30 + rng.normal(0, 1, cells), 8 + rng.normal(0, 1, cells)
    ape = {"fixed_microbench": invariant, "free_constant": invariant + 1, "c_times_k": scaling,
           "c_over_k": scaling + 20, "baseline": invariant + 40}
    verdict = host_family_verdict(ape, discriminating=True, resamples=500)
    assert verdict["verdict"] == expected
    if cells < MIN_CELLS_FOR_A_FAMILY:
        assert f"{cells} in-regime cell(s)" in verdict["reason"] and "untested" in verdict["reason"]
