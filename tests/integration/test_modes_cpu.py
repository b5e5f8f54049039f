"""Modes on the real vLLM CPU build, through the CLI, a local Ray cluster and MLflow.

One sweep serves every test in this module (three engine starts): modes=[eager,graph,
spec-ngram,fp8] x workload=[random,repeat] at TP-1: eager vs the compiled path, n-gram
speculation on random vs repeat prompts, fp8 SKIPPED. (TP-2 on the CPU, its all-reduce
and the TP floor: tests/integration/test_compare_end_to_end.py; resume: test_cluster_dispatch.)
The weights are drawn per tensor with an untied LM head (model.load_format=random): with
vLLM's dummy weights every greedy output is a 2-cycle that n-gram lookup predicts on any
prompt (README, "Workloads"). ctx 256 holds the orbit of the model's own text (it runs tens
of tokens before cycling with a 4096-token vocabulary; at ctx 64 it did not fit).
The sweep runs with verbose=true, which streams the workers' and engines' output to the
console instead of log files (the quiet console: test_sweep_end_to_end.py); the measured
figures here are comparisons between engines that all stream alike.
"""
from __future__ import annotations

import json
import re

import mlflow
import pandas as pd
import pytest

from tests.conftest import run_hostsweep

pytestmark = pytest.mark.integration

COMMON = ["+sku=cpu", "batch=[1]", "ctx=[256]", "measure.T=17", "measure.reps=3", "measure.warmups=1",
          "model.load_format=random", "model.shape.tie_word_embeddings=false", "study=modes-it", "verbose=true",
          "measure.remeasure_unstable=0"]


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    root = tmp_path_factory.mktemp("modes")
    uri = f"sqlite:///{root}/mlflow.db"
    first = run_hostsweep([*COMMON, "modes=[eager,graph,spec-ngram,fp8]", "workload=[random,repeat]",
                           f"tracking.uri={uri}", f"hydra.run.dir={root}/run1"], cwd=root, timeout=1200)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-5000:]
    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=["hostsweep-modes-it"])
    parents = runs[runs["tags.mlflow.parentRunId"].isna()].sort_values("start_time")
    return {"root": root, "runs": runs, "cells": runs[runs["tags.mlflow.parentRunId"].notna()],
            "parents": parents, "first": first}


def cell(cells: pd.DataFrame, mode: str, workload: str = "random") -> pd.Series:
    rows = cells[(cells["params.mode"] == mode) & (cells["params.workload"] == workload)]
    assert len(rows) == 1, rows[["params.mode", "params.workload", "status"]]
    return rows.iloc[0]


def test_eager_and_the_compiled_path_are_measured_and_recorded_as_such(study):
    cells = study["cells"]
    eager, graph = cell(cells, "eager"), cell(cells, "graph")
    assert eager["status"] == graph["status"] == "FINISHED"
    assert eager["tags.compilation_mode"] == "NONE"
    assert graph["tags.compilation_mode"] == "DYNAMO_TRACE_ONCE"  # the CPU build's torch.compile path
    assert graph["tags.cudagraph_mode"] == "NONE" and graph["tags.cudagraph_capture_sizes"] == "none"
    assert json.loads(graph["params.engine_args"]) == {"enforce_eager": False}
    for run in (eager, graph):
        assert 0 < run["metrics.device_ms"] < run["metrics.step_ms"] and run["metrics.kernels_per_step"] > 0
        # the engine's sizing, not in the cell key, is on the run: ctx 256 + a 17-token generate, batch 1
        assert int(run["tags.max_model_len"]) >= 256 + 17 and run["tags.max_num_seqs"] == "1"
    print(f"eager {eager['metrics.step_ms']:.3f} ms/step, compiled {graph['metrics.step_ms']:.3f} ms/step")


def test_fp8_on_the_cpu_is_a_skipped_cell_with_its_reason(study):
    fp8 = study["cells"][study["cells"]["params.mode"] == "fp8"]
    assert len(fp8) == 2 and set(fp8["status"]) == {"KILLED"}
    assert set(fp8["tags.skipped"]) == {"true"}
    assert set(fp8["tags.skip_reason"]) == {"mode fp8 needs CUDA compute capability >= 8.9; sku cpu has no GPU"}
    assert "SKIPPED" in study["first"].stdout


def test_speculation_accepts_more_on_repeat_and_the_per_token_speedup_follows(study):
    cells = study["cells"]
    random_spec, repeat_spec = cell(cells, "spec-ngram", "random"), cell(cells, "spec-ngram", "repeat")
    speedup = {w: cell(cells, "eager", w)["metrics.step_ms"] / cell(cells, "spec-ngram", w)["metrics.step_ms"]
               for w in ("random", "repeat")}
    print(f"acceptance random {random_spec['metrics.spec_acceptance_rate']:.2f} "
          f"({random_spec['metrics.spec_tokens_per_cycle']:.2f} tokens/cycle), repeat "
          f"{repeat_spec['metrics.spec_acceptance_rate']:.2f} ({repeat_spec['metrics.spec_tokens_per_cycle']:.2f}); "
          f"per-token speedup random {speedup['random']:.2f}x, repeat {speedup['repeat']:.2f}x")
    assert repeat_spec["metrics.spec_tokens_per_cycle"] > random_spec["metrics.spec_tokens_per_cycle"]
    assert repeat_spec["metrics.spec_acceptance_rate"] > random_spec["metrics.spec_acceptance_rate"]
    assert speedup["repeat"] > speedup["random"]
    # the same text reached both engines of a workload
    assert cell(cells, "eager", "repeat")["tags.prompt_digest"] == repeat_spec["tags.prompt_digest"]


def test_mode_comparisons_land_on_the_sweeps_parent_run(study, tmp_path):
    parent = study["parents"].iloc[0]
    for name in ("graph_vs_eager/mean_reduction", "graph_vs_eager/peak_speedup", "spec-ngram_vs_eager/repeat/speedup",
                 "spec-ngram_vs_eager/random/acceptance_rate", "spec-ngram_vs_eager/repeat/host_cycle_ms"):
        assert pd.notna(parent[f"metrics.{name}"]), name
    path = mlflow.artifacts.download_artifacts(run_id=parent["run_id"], artifact_path="study/graph_vs_eager.csv",
                                               dst_path=str(tmp_path))
    table = pd.read_csv(path)
    assert set(table["workload"]) == {"random", "repeat"} and table["reduction"].notna().all()


def test_verbose_streams_the_workers_output_to_the_console(study):
    console = study["first"].stdout + study["first"].stderr
    assert re.search(r"\(SweepWorker pid=\d+\).*\(EngineCore pid=\d+\)", console)
    assert not list((study["root"] / "run1").glob("workers/*.log"))


def test_the_engines_processes_get_tcmalloc_and_intel_openmp_where_this_machine_has_them(study):
    # engine.preload=auto: what config/machine.cpu_preload finds here is what every engine was
    # started with, and vLLM's worker then has no warning about it in its log
    from hostsweep.config.machine import cpu_preload

    found, _ = cpu_preload()
    finished = study["cells"][study["cells"]["status"] == "FINISHED"]
    assert set(finished["tags.ld_preload"]) == {":".join(found) or "none"}
    console = study["first"].stdout + study["first"].stderr
    for library in ("libtcmalloc", "libiomp"):
        warned = f"{library} is not found in LD_PRELOAD" in console
        assert warned == (not any(name.startswith(library) for name in found)), library
