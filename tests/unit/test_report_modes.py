"""Study-level mode comparisons from cell tables with known answers."""
from __future__ import annotations

import math

import pandas as pd
import pytest

from hostsweep.report.modes import (
    comparison_kind, crossover_batches, finished_cells, logged_engine_args, mode_pairs, modes_in, paired,
    study_summary,
)
from hostsweep.report.study_modes import mode_sections


def row(mode, batch, ctx, step, host=None, tp=1, workload="random", **extra):
    device = None if host is None else step - host
    return {"sku": "h200", "model": "llama-3.1-8b", "mode": mode, "tp": tp, "batch": batch, "ctx": ctx,
            "workload": workload, "status": "FINISHED", "step_ms": step, "host_ms": host, "device_ms": device,
            "host_frac": None if host is None else host / step, **extra}


@pytest.mark.parametrize("mode_args,kind", [
    ({"enforce_eager": False}, "graph"),
    ({"enforce_eager": True, "quantization": "fp8"}, "fp8"),
    ({"enforce_eager": True, "speculative_config": {"method": "ngram"}}, "spec"),
    ({"enforce_eager": True, "block_size": 32}, "ratio"),
])
def test_the_comparison_follows_the_arguments_that_differ_from_the_baseline(mode_args, kind):
    assert comparison_kind(mode_args, {"enforce_eager": True}) == kind


def test_graph_reduction_crossover_and_what_part_of_the_step_it_removed():
    # eager 10 ms/step with 6 ms host at every batch; graph removes 4, 2, 0.4, 0.2 ms of host.
    removed = {1: 4.0, 2: 2.0, 4: 0.4, 8: 0.2}
    rows = [row("eager", b, 512, 10.0, 6.0) for b in removed]
    rows += [row("graph", b, 512, 10.0 - r, 6.0 - r) for b, r in removed.items()]
    rows += [row("eager", 1, 2048, 20.0, 6.0), row("graph", 1, 2048, 19.5, 5.5)]  # ctx 2048: 2.5 % at b1
    tables, metrics = study_summary(finished_cells(rows), [("graph", "eager", "graph")], crossover_threshold=0.05)
    cells = tables["graph_vs_eager"].sort_values(["ctx", "batch"])
    assert list(cells["reduction"].round(3)) == [0.4, 0.2, 0.04, 0.02, 0.025]
    assert list(cells["host_removed_ms"].round(3)) == [4.0, 2.0, 0.4, 0.2, 0.5]
    assert (cells["device_removed_ms"].abs() < 1e-12).all()
    crossover = tables["graph_vs_eager_crossover"].set_index("ctx")["crossover_batch"]
    assert crossover[512] == 4 and crossover[2048] == 1
    assert metrics["graph_vs_eager/mean_reduction"] == pytest.approx((0.4 + 0.2 + 0.04 + 0.02 + 0.025) / 5)
    assert metrics["graph_vs_eager/peak_speedup"] == pytest.approx(10 / 6)


@pytest.mark.parametrize("reductions,threshold,expected", [
    ([0.30, 0.10, 0.04, 0.02], 0.05, 4),
    ([0.30, 0.04, 0.10, 0.02], 0.05, 8),      # a dip that recovers is not the crossover
    ([0.30, 0.10, 0.08, 0.06], 0.05, math.nan),  # never below
    ([0.30, 0.10, 0.08, 0.06], 0.15, 2),      # the threshold is configurable
])
def test_crossover_is_the_batch_from_which_the_reduction_stays_below_the_threshold(reductions, threshold, expected):
    table = pd.DataFrame({"sku": "h200", "model": "m", "tp": 1, "ctx": 512, "workload": "random",
                          "batch": [1, 2, 4, 8], "reduction": reductions})
    (got,) = crossover_batches(table, threshold)["crossover_batch"]
    assert (math.isnan(got) and math.isnan(expected)) or got == expected


def test_fp8_decode_and_prefill_ratios_and_launches_per_step():
    rows = []
    for i, ctx in enumerate((512, 1024, 2048)):
        rows.append(row("eager", 1, ctx, 10.0, 6.0, wall_1_ms=29.0, launches_per_step=100.0, kernels_per_step=100.0))
        rows.append(row("fp8", 1, ctx, 10.0 / 0.79, 6.5, wall_1_ms=20.0, launches_per_step=170.0,
                        kernels_per_step=170.0))
    tables, metrics = study_summary(finished_cells(rows), [("fp8", "eager", "fp8")])
    assert metrics["fp8_vs_eager/mean_decode_ratio"] == pytest.approx(0.79)  # the host-exposed-latency paper [1]: 0.79x, slower
    assert metrics["fp8_vs_eager/cells_slower"] == 3 and metrics["fp8_vs_eager/n_cells"] == 3
    assert metrics["fp8_vs_eager/mean_prefill_ratio"] == pytest.approx(1.45)  # [1]: 1.45x faster
    assert metrics["fp8_vs_eager/mean_launches_ratio"] == pytest.approx(1.7)  # [1]: ~1.7x launches
    assert set(tables["fp8_vs_eager"]["host_ms_mode"]) == {6.5}  # the FP8 split itself


def test_speculation_speedup_and_acceptance_per_workload():
    spec = {"spec_acceptance_rate": 0.9, "spec_accepted_per_cycle": 3.6, "spec_tokens_per_cycle": 4.6,
            "spec_host_cycle_ms": 0.768}
    rows = [row("eager", 1, 512, 6.0, 5.0, workload="repeat"), row("eager", 1, 512, 6.0, 5.0),
            row("spec-ngram", 1, 512, 6.0 / 6.15, 0.8, workload="repeat", **spec),
            row("spec-ngram", 1, 512, 6.0 / 0.98, 5.0, spec_acceptance_rate=0.01, spec_accepted_per_cycle=0.04,
                spec_tokens_per_cycle=1.04, spec_host_cycle_ms=5.2)]
    _, metrics = study_summary(finished_cells(rows), [("spec-ngram", "eager", "spec")])
    assert metrics["spec-ngram_vs_eager/repeat/speedup"] == pytest.approx(6.15)
    assert metrics["spec-ngram_vs_eager/random/speedup"] == pytest.approx(0.98)
    assert metrics["spec-ngram_vs_eager/repeat/host_cycle_ms"] == pytest.approx(0.768)
    assert metrics["spec-ngram_vs_eager/repeat/acceptance_rate"] > metrics["spec-ngram_vs_eager/random/acceptance_rate"]


def test_tp_floor_reports_the_host_exposed_latency_papers_split_per_degree():
    # The host-exposed-latency paper [1] §4.1, Llama-3.1-8B: host floor 5.79 -> 0.48 ms, GPU-active 6.3 -> 15.4 ms (TP-1 -> TP-2).
    rows = [row("eager", 1, 128, 5.79 + 6.3, 5.79, tp=1), row("eager", 1, 128, 0.48 + 15.4, 0.48, tp=2)]
    tables, metrics = study_summary(finished_cells(rows), [])
    assert metrics["tp_floor/h200/llama-3.1-8b/eager/tp1/host_ms"] == pytest.approx(5.79)
    assert metrics["tp_floor/h200/llama-3.1-8b/eager/tp2/host_ms"] == pytest.approx(0.48)
    assert metrics["tp_floor/h200/llama-3.1-8b/eager/tp2/device_ms"] == pytest.approx(15.4)
    assert list(tables["tp_floor"]["tp"]) == [1, 2]


def test_resumed_rows_read_back_as_strings_pair_with_fresh_ones():
    fresh = row("eager", 2, 512, 10.0, 6.0)
    resumed = {**{k: str(v) for k, v in row("graph", 2, 512, 8.0, 4.0).items()}, "step_ms": 8.0, "host_ms": 4.0}
    del resumed["workload"]  # logged before the workload param existed
    skipped = {**row("fp8", 2, 512, 0.0), "status": "SKIPPED", "step_ms": None}
    pairs = paired(finished_cells([fresh, resumed, skipped]), "graph", "eager")
    assert len(pairs) == 1 and pairs["speedup"].iloc[0] == pytest.approx(1.25)


def test_only_modes_whose_baseline_is_in_the_study_are_compared():
    modes = [("eager", None, {"enforce_eager": True}), ("graph", "eager", {"enforce_eager": False}),
             ("fp8", "bf16-graph", {"quantization": "fp8"})]
    assert mode_pairs(modes) == [("graph", "eager", "graph")]
    assert mode_pairs(iter(modes)) == [("graph", "eager", "graph")]  # any iterable, read once


def test_the_report_compares_every_mode_the_cells_hold_even_one_no_code_names():
    eager_args, new_args = '{"enforce_eager": true}', '{"block_size": 32, "enforce_eager": true}'
    cells = pd.DataFrame([row("eager", b, 128, 2.0, 1.0, engine_args=eager_args) for b in (1, 4)]
                         + [row("paged-32", b, 128, 1.6, 0.8, engine_args=new_args) for b in (1, 4)])
    assert modes_in(cells, "eager") == [("paged-32", "eager", "ratio")]
    [section] = mode_sections(cells)
    assert section.title.startswith("paged-32 vs eager") and section.status == "present"
    assert section.summary["mean_speedup"] == pytest.approx(1.25)


def test_a_modes_comparison_kind_comes_from_the_engine_arguments_its_cells_logged():
    cells = pd.DataFrame([row("eager", 1, 128, 2.0, engine_args='{"enforce_eager": true}'),
                          row("q8", 1, 128, 1.5, engine_args='{"enforce_eager": true, "quantization": "fp8"}'),
                          row("old", 1, 128, 1.9)])  # logged before engine_args: a plain ratio
    assert logged_engine_args(cells, "q8") == {"enforce_eager": True, "quantization": "fp8"}
    assert modes_in(cells, "eager") == [("old", "eager", "ratio"), ("q8", "eager", "fp8")]


def test_a_mode_without_baseline_cells_or_no_other_mode_is_reported_absent():
    only_graph = pd.DataFrame([row("graph", 1, 128, 1.0)])
    [section] = mode_sections(only_graph)
    assert section.status == "absent: graph cells but no eager cells to compare with"
    [section] = mode_sections(pd.DataFrame([row("eager", 1, 128, 1.0)]))
    assert section.status == "absent: no mode other than eager in the selection"
