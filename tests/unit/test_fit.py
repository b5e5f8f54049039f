"""The TP model: roofline sanity, calibration fits and host-form comparison recover the
parameters the synthetic data were generated with."""
from __future__ import annotations

from dataclasses import asdict
from itertools import product

import numpy as np
import pandas as pd
import pytest

from hostsweep.model.compare import cell_frame, falsified_skus, generalization, in_regime, predictions_table
from hostsweep.config.options import load_sku
from hostsweep.model.fit import AllReduceFit, HostFit, allreduce_s, fit_allreduce, fit_host, sharded_compute_s
from hostsweep.model.hostforms import compare_forms, fit_form, predict_s, verdict
from tests.conftest import compose_typed

TRUE_AR = AllReduceFit(latency_s=21.2e-6, bandwidth_Bps=307e9)   # seed 002, H100
TRUE_HOST = HostFit(s0_s=16.9e-3, s1_s=0.15e-3)                   # seed 002 intercept
TRUE_G = 0.30


def shape(model: str) -> dict:
    return asdict(compose_typed(["+sku=cpu", f"model={model}"]).config.model.shape)


SHAPES = {m: shape(m) for m in ("llama-3.1-8b", "llama-3.1-70b")}
SKUS = {s: asdict(load_sku(s)) for s in ("h100", "h200")}


def grid(sku: str, model: str, tps, batches=(1, 2, 4, 8), ctxs=(512, 2048, 4096)) -> pd.DataFrame:
    rows = [{"sku": sku, "model": model, "tp": k, "batch": n, "ctx": c, "step_ms": np.nan}
            for k, n, c in product(tps, batches, ctxs)]
    return cell_frame(pd.DataFrame(rows), SHAPES, SKUS)


def with_steps(cells: pd.DataFrame, host_s: np.ndarray, noise: float, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    clean = TRUE_G * sharded_compute_s(cells) + allreduce_s(cells, TRUE_AR) + host_s
    cells = cells.copy()
    cells["step_ms"] = clean * (1 + rng.normal(0, noise, len(cells))) * 1e3
    return cells


def test_single_gpu_decode_roofline_is_weight_streaming_bound():
    cells = grid("h100", "llama-3.1-8b", tps=[1, 2], batches=[1], ctxs=[128])
    # Decode streams every weight but the input embedding table (only N rows are gathered).
    weight_stream_s = (8_030_261_248 - 128_256 * 4096) * 2 / 3350e9
    compute = sharded_compute_s(cells)
    assert compute[0] == pytest.approx(weight_stream_s, rel=0.03)
    assert compute[1] == pytest.approx(compute[0] / 2, rel=0.03)


def test_kv_read_grows_with_batch_times_context():
    cells = grid("h100", "llama-3.1-8b", tps=[1], batches=[1, 8], ctxs=[512, 8192])
    by = dict(zip(zip(cells["batch"], cells["ctx"]), sharded_compute_s(cells)))
    assert by[(8, 8192)] > by[(8, 512)] > by[(1, 512)]


def test_allreduce_fit_recovers_latency_and_bandwidth():
    rng = np.random.default_rng(1)
    sizes = np.geomspace(4e3, 64e6, 16)
    times = TRUE_AR.time_s(sizes) * (1 + rng.normal(0, 0.01, sizes.size))
    fit = fit_allreduce(sizes, times)
    assert fit.bandwidth_Bps == pytest.approx(TRUE_AR.bandwidth_Bps, rel=0.03)
    assert fit.latency_s == pytest.approx(TRUE_AR.latency_s, rel=0.15)


def test_host_fit_recovers_intercept_and_slope():
    rng = np.random.default_rng(2)
    batch = np.repeat([1, 2, 4, 8], 5)
    times = TRUE_HOST.time_s(batch) + rng.normal(0, 0.05e-3, batch.size)
    fit = fit_host(batch, times)
    assert fit.s0_s == pytest.approx(TRUE_HOST.s0_s, rel=0.02)
    assert fit.s1_s == pytest.approx(TRUE_HOST.s1_s, rel=0.25)


def test_global_scale_is_recovered_from_tp2_and_predicts_tp4_held_out():
    cells = grid("h100", "llama-3.1-70b", tps=[2, 4])
    cells = with_steps(cells, TRUE_HOST.time_s(cells["batch"]), noise=0.01)
    train, held_out = cells[cells["tp"] == 2], cells[cells["tp"] == 4]
    fitted = fit_form("fixed_microbench", train, TRUE_AR, TRUE_HOST)
    assert fitted.g == pytest.approx(TRUE_G, rel=0.05) and fitted.host_params == ()
    predicted = predict_s(fitted, held_out, TRUE_AR, TRUE_HOST) * 1e3
    assert np.mean(np.abs(predicted - held_out["step_ms"]) / held_out["step_ms"]) < 0.03


@pytest.mark.parametrize("host_form,expected_class,expected_best", [
    ("invariant", "k-invariant", None),
    ("times_k", "k-scaling", "c_times_k"),
    ("over_k", "k-scaling", "c_over_k"),
])
def test_comparison_picks_the_host_form_the_data_were_made_with(host_form, expected_class, expected_best):
    cells = grid("h100", "llama-3.1-70b", tps=[2, 4])
    k = cells["tp"].to_numpy(float)
    host = {"invariant": np.full(len(cells), 17e-3), "times_k": 8.5e-3 * k, "over_k": 34e-3 / k}[host_form]
    cells = with_steps(cells, host, noise=0.005, seed=3)
    table = compare_forms(cells[cells["tp"] == 2], cells[cells["tp"] == 4], TRUE_AR, TRUE_HOST)
    text = verdict(table)
    assert text.startswith(expected_class)
    if expected_best:
        assert f"best held-out form: {expected_best}" in text
    baseline = table.set_index("form").loc["baseline", "heldout_mape_mean"]
    best = table[table["class"] != "none"]["heldout_mape_mean"].min()
    assert best < baseline


def test_memory_criterion_flags_only_the_tightest_tp2_cell_of_the_seed_grid():
    cells = grid("h100", "llama-3.1-70b", tps=[2, 4])
    flagged = cells[~in_regime(cells)]
    assert list(zip(flagged["tp"], flagged["batch"], flagged["ctx"])) == [(2, 8, 4096)]


def test_cells_below_host_plus_allreduce_falsify_the_additive_model_on_their_sku():
    h100 = with_steps(grid("h100", "llama-3.1-70b", tps=[2, 4]), TRUE_HOST.time_s(grid("h100", "llama-3.1-70b", tps=[2, 4])["batch"]), 0.01)
    h200 = grid("h200", "llama-3.1-70b", tps=[4], batches=[1, 2], ctxs=[512])
    h200["step_ms"] = 5.0  # far below H (~17 ms) + T_ar: impossible under the additive model
    cells = pd.concat([h100, h200], ignore_index=True)
    cells["in_regime"] = in_regime(cells)
    selected = ((cells["sku"] == "h100") & (cells["tp"] == 2)).to_numpy()
    fitted = fit_form("fixed_microbench", cells[selected & cells["in_regime"].to_numpy()], TRUE_AR, TRUE_HOST)
    table = predictions_table(fitted, cells, TRUE_AR, TRUE_HOST, selected)
    assert falsified_skus(table) == ["h200"]
    summary = generalization(table).set_index(["sku", "tp", "role"])
    assert summary.loc[("h200", 4, "held-out"), "falsifying_cells"] == 2
    assert summary.loc[("h100", 4, "held-out"), "falsifying_cells"] == 0
    assert summary.loc[("h100", 2, "excluded"), "out_of_regime"] == 1
    assert summary.loc[("h100", 2, "train"), "cells"] == 11
    assert not table.loc[table["role"] == "train", "falsifies"].any()


def test_fitting_and_scoring_scale_to_100k_cells():
    cells = grid("h100", "llama-3.1-70b", tps=[2, 4])
    big = cells.sample(100_000, replace=True, random_state=0).reset_index(drop=True)
    big = with_steps(big, TRUE_HOST.time_s(big["batch"]), noise=0.01)
    table = compare_forms(big[big["tp"] == 2], big[big["tp"] == 4], TRUE_AR, TRUE_HOST)
    assert len(table) == 6 and table["heldout_n"].sum() > 0
