"""T_ar on the engine's path (issue 46 item 1): the all-reduce measured through vLLM's own TP
communicator (the CPU build's shared-memory op, asserted by the profiler's op names), the GPU
path's choices tested with fakes, `fit.allreduce=engine|standalone` validated and carried
into fit.json, MLflow and the report; and the roofs in the engine's dtype (item 3)."""
from __future__ import annotations

import json
from dataclasses import asdict

import mlflow
import numpy as np
import pandas as pd
import pytest
import yaml

from hostsweep.calibrate.allreduce_terms import allreduce_entry, decode_sizes
from hostsweep.calibrate.engine_allreduce import (CPU_SHM, CUSTOM, GLOO, NCCL, SYMM_MEM, UNKNOWN, path_from_op_names,
                                                  rank_device, summarize_samples)
from hostsweep.calibrate.microbench import roof_dtype
from hostsweep.calibrate.terms import check_fit_sources, fixed_terms
from hostsweep.config.machine import default_dtype
from hostsweep.config.options import load_calibration, load_model_shape, load_sku
from hostsweep.config.schema import (AllReduceCalibration, CalibrationConfig, ConfigError, FitConfig, HostCalibration,
                                     RoofsCalibration)
from hostsweep.model.fit import fit_allreduce
from hostsweep.model.inputs import model_inputs
from hostsweep.model.synthetic import clean_step_s, grid, host_truth_s, measure
from hostsweep.record.read.selection import Selection
from hostsweep.report.fit_tables import allreduce_paths_table, allreduce_paths_text
from tests.conftest import compose_typed

SHAPES = {"llama-3.1-70b": load_model_shape("llama-3.1-70b")}
SKUS = {s: asdict(load_sku(s)) for s in ("h100", "h200")}
PAPER = load_calibration("seed002-h100").allreduce["h100"]  # λ 21.2 µs, β 307 GB/s: standalone NCCL
ENGINE_FAST = AllReduceCalibration(8.0, 150.0, "engine", "vllm get_tp_group().all_reduce (CudaCommunicator: "
                                                         "custom_allreduce; 4 ranks, bfloat16)")


# ---- the engine path, measured on the CPU build -------------------------------------------

@pytest.mark.integration
def test_engine_path_allreduce_on_the_cpu_build_takes_the_path_vllm_selects_on_this_cpu(capfd):
    from hostsweep.calibrate.engine_allreduce import cpu_engine_path, run_engine_allreduce
    from hostsweep.config.machine import cpu_flags, default_dtype

    # in the dtype this machine's engine runs (bfloat16 only where the CPU computes it)
    frame = run_engine_allreduce(2, np.array([4096, 262144]), 7, default_dtype(False, cpu_flags()))
    # path comes from the torch profiler's names of each size's all-reduce (`_C::shm_allreduce`
    # names it cpu_shm, gloo's op gloo), expected from vLLM's own selection on this CPU: its
    # shared-memory op where the kernels it loads here carry it (AVX-512), else gloo
    expected = cpu_engine_path()
    assert list(frame["path"]) == [expected, expected], frame
    assert set(frame["communicator"]) == {"CpuCommunicator"}
    assert (frame["ci_low_s"] <= frame["seconds"]).all() and (frame["seconds"] <= frame["ci_high_s"]).all()
    assert (frame["seconds"] > 0).all()
    # the profiler's native start/stop lines stay off the console the ranks share with the user
    out, err = capfd.readouterr()
    assert "profiler_start" not in out + err and "profiler_stop" not in out + err


def test_a_rank_that_fails_hands_its_traceback_to_the_parent_and_still_fails():
    import queue

    from hostsweep.calibrate.engine_allreduce import _rank_entry

    failures: queue.Queue = queue.Queue()
    with pytest.raises(TypeError):
        _rank_entry(1, failures, "not enough arguments")
    rank, text = failures.get_nowait()
    assert rank == 1 and "TypeError" in text and "_rank_main" in text


# ---- the path's logic, with fakes for what cannot run here (GPUs) -------------------------

@pytest.mark.parametrize("names,path", [
    (["aten::zeros", "_C::shm_allreduce"], CPU_SHM),
    (["c10d::allreduce_", "aten::add"], GLOO),
    (["void vllm::cross_device_reduce_1stage<__nv_bfloat16, 4>(...)", "cudaLaunchKernel"], CUSTOM),
    (["ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"], NCCL),
    (["void c10d::symmetric_memory::multimem_all_reduce_kernel<...>"], SYMM_MEM),
    (["aten::mm", "aten::copy_"], UNKNOWN),
])
def test_the_path_is_named_from_the_profiled_op_and_kernel_names(names, path):
    assert path_from_op_names(names) == path


def test_a_gpu_rank_reduces_on_its_own_gpu_and_a_cpu_rank_on_the_cpu():
    assert rank_device("cuda", 3).device == "cuda:3" and rank_device("cuda", 3).gpu
    assert rank_device("cpu", 1).device == "cpu" and not rank_device("cpu", 1).gpu
    with pytest.raises(ValueError, match="cuda and cpu"):
        rank_device("tpu", 0)


def test_a_sample_is_the_slowest_rank_and_the_size_gets_a_median_ci():
    samples = np.array([[1.0, 2.0], [3.0, 1.0], [2.0, 2.5], [1.5, 4.0], [2.0, 1.0], [5.0, 0.5], [1.0, 1.2]]) * 1e-6
    row = summarize_samples(4096, samples)
    slowest = samples.max(axis=1)
    assert row["seconds"] == pytest.approx(np.median(slowest)) and row["reps"] == 7
    assert row["ci_low_s"] <= row["seconds"] <= row["ci_high_s"] and row["ci_coverage"] >= 0.95


def test_the_sizes_include_every_decode_message_of_the_cells():
    messages = np.array([1 * 4096 * 2, 8 * 4096 * 2, 8 * 8192 * 2])
    sizes = decode_sizes(messages)
    assert set(messages) <= set(sizes) and sizes.max() >= 16 * messages.max() and sizes.min() == messages.min()


@pytest.mark.parametrize("seed", range(5))
def test_the_allreduce_fit_recovers_lambda_and_beta_from_sizes_drawn_from_them(seed):
    rng = np.random.default_rng(seed)
    latency_s, bandwidth = 6e-6, 8e9  # a shared-memory all-reduce: microseconds, GB/s
    sizes = decode_sizes(np.array([2 * 2048, 16 * 2048 * 2]))
    seconds = (latency_s + sizes / bandwidth) * (1 + rng.normal(0, 0.03, sizes.size))
    fitted = fit_allreduce(sizes, seconds)
    assert fitted.latency_s == pytest.approx(latency_s, rel=0.15)
    assert fitted.bandwidth_Bps == pytest.approx(bandwidth, rel=0.1)


# ---- fit.allreduce: validated, selected, recorded -----------------------------------------

def test_a_bad_fit_allreduce_is_a_one_line_error_naming_the_allowed_paths():
    with pytest.raises(ConfigError, match=r"^fit.allreduce='nccl' is not allowed; allowed: engine, standalone$"):
        check_fit_sources(FitConfig(allreduce="nccl"))
    check_fit_sources(FitConfig(allreduce="standalone"))


def test_a_calibration_entry_without_a_path_is_the_standalone_one():
    calibration = CalibrationConfig(allreduce={"h100": PAPER}, allreduce_standalone={})
    assert allreduce_entry(calibration, "h100", "standalone") is PAPER
    assert allreduce_entry(calibration, "h100", "engine") is None


def _cells(seed: int = 0) -> pd.DataFrame:
    both = grid(["h100", "h200"], "llama-3.1-70b", SHAPES, SKUS)
    terms = load_calibration("seed002-h100")
    from hostsweep.model.study_fit import calibration_terms

    truth = calibration_terms(terms)
    ar = {s: truth.allreduce["h100"] for s in ("h100", "h200")}
    cells = measure(both, clean_step_s(both, 0.3, ar, host_truth_s("invariant", both, truth.host)), 0.015, seed)
    cells = cells[["sku", "model", "tp", "batch", "ctx", "T", "step_ms", "step_ci_low_ms", "step_ci_high_ms"]].copy()
    cells["mode"], cells["dtype"], cells["parent_run_id"] = "eager", "bfloat16", "sweep0"
    return cells


def test_engine_requested_with_only_the_papers_standalone_entry_warns_and_records_standalone():
    calibration = CalibrationConfig(allreduce={"h100": PAPER, "h200": PAPER}, host=HostCalibration(16.9, 0.0))
    fixed = fixed_terms(_cells(), "h100", calibration, FitConfig(train_sku="h100", calibrate=False), "unused", None)
    assert fixed.terms.allreduce_paths == {"h100": "standalone", "h200": "standalone"}
    assert any("NOT the engine's path" in w and "sku h200" in w for w in fixed.warnings)


def test_engine_requested_with_nothing_measurable_is_a_config_error():
    with pytest.raises(ConfigError, match="sku h100 has TP>1 cells but the calibration has no all-reduce for it on the "
                                          "engine path"):
        fixed_terms(_cells(), "h100", CalibrationConfig(host=HostCalibration(16.9, 0.0)),
                    FitConfig(train_sku="h100", calibrate=False), "unused", None)


@pytest.mark.parametrize("which", ["engine", "standalone"])
def test_the_selected_allreduce_path_reaches_fit_json_mlflow_and_the_report(which, tmp_path):
    from hostsweep.stages.fit import fit_selection

    calibration = tmp_path / "calib.yaml"
    calibration.write_text(yaml.safe_dump({
        "allreduce": {s: asdict(ENGINE_FAST) for s in ("h100", "h200")},
        "allreduce_standalone": {s: {"latency_us": PAPER.latency_us, "bandwidth_gbps": PAPER.bandwidth_gbps}
                                 for s in ("h100", "h200")}}))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    study = compose_typed(["+experiment=tp70b", "calibration=seed002-h100", "fit.calibrate=false",
                           f"fit.calibration_file={calibration}", f"fit.allreduce={which}", "fit.resamples=200",
                           f"tracking.uri={uri}"])
    result = fit_selection(study, Selection(_cells(), "hostsweep-tp70b", "0", uri), tmp_path)
    data = json.loads((tmp_path / "fit" / "fit.json").read_text())
    used = data["calibration"]["allreduce"]["h200"]
    expected = ENGINE_FAST if which == "engine" else PAPER
    assert data["calibration"]["allreduce_requested"] == which and used["path"] == which
    assert used["latency_us"] == pytest.approx(expected.latency_us)
    # the paper's method is recorded beside the engine path's either way
    assert data["calibration"]["allreduce_standalone"]["h200"]["latency_us"] == pytest.approx(PAPER.latency_us)
    run = mlflow.MlflowClient(uri).get_run(result.outcome.run_id)
    assert run.data.params["fit.allreduce"] == which and run.data.params["allreduce_path.h200"] == which
    table = allreduce_paths_table(data["calibration"])
    assert set(table["path_used"]) == {which} and allreduce_paths_text(table) == ""


def test_the_report_says_loudly_when_t_ar_is_not_on_the_requested_path():
    table = allreduce_paths_table({"allreduce_requested": "engine", "allreduce": {
        "cpu": {"latency_us": 750.6, "bandwidth_gbps": 2.03, "path": "standalone", "method": "gloo"}}})
    assert "NOT ON THE ENGINE'S PATH" in allreduce_paths_text(table) and "sku cpu" in allreduce_paths_text(table)


# ---- roofs in the engine's dtype ------------------------------------------------------------

@pytest.mark.parametrize("gpu,flags,recorded,expected", [
    (False, {"avx512f", "avx512_bf16"}, None, "bfloat16"),
    (False, {"avx512f", "amx_bf16"}, None, "bfloat16"),
    (False, {"avx2", "avx512f"}, None, "float32"),
    (True, set(), None, "bfloat16"),
    (False, {"avx512_bf16"}, "float32", "float32"),  # the cells' recorded dtype wins (engine.dtype=float32)
    (False, {"avx2"}, "auto", "float32"),
])
def test_the_roof_dtype_is_the_engines(monkeypatch, gpu, flags, recorded, expected):
    monkeypatch.setattr("hostsweep.config.machine.cpu_flags", lambda: flags)
    assert roof_dtype(gpu, recorded) == expected
    if recorded in (None, "auto"):
        assert expected == default_dtype(gpu, flags)  # the rule engine.dtype=auto resolves by


def test_a_study_mixing_dtypes_gets_one_roof_per_dtype():
    cells = pd.DataFrame([{"sku": "cpu", "model": "llama-3.1-70b", "tp": 1, "batch": 1, "ctx": 512, "T": 33,
                           "step_ms": 1.0, "dtype": d} for d in ("bfloat16", "float32")])
    calibration = CalibrationConfig(roofs_by_dtype={
        "cpu/bfloat16": RoofsCalibration(0.5, 40.0, "bfloat16", "onednn"),
        "cpu/float32": RoofsCalibration(0.2, 40.0, "float32", "onednn")}, host=HostCalibration(1.0, 0.0))
    fixed = fixed_terms(cells, "cpu", calibration, FitConfig(calibrate=False, roofs="measured"), "unused", None)
    spec = fixed.skus["cpu"]
    assert set(spec["roofs_by_dtype"]) == {"bfloat16", "float32"}
    inputs = model_inputs(cells, SHAPES, fixed.skus)
    assert list(inputs["peak_flops"]) == [0.5e12, 0.2e12]
    assert [s["value"].endswith(f"cells in {d})") for s, d in
            zip([s for s in fixed.sources if s["term"] == "roofs"], ("bfloat16", "float32"))] == [True, True]


def test_a_roof_recorded_in_another_dtype_is_not_used_for_the_cells():
    cells = pd.DataFrame([{"sku": "cpu", "model": "llama-3.1-70b", "tp": 1, "batch": 1, "ctx": 512, "T": 33,
                           "step_ms": 1.0, "dtype": "bfloat16"}])
    calibration = CalibrationConfig(roofs={"cpu": RoofsCalibration(0.186, 40.0, "float32", "torch.mm")},
                                    host=HostCalibration(1.0, 0.0))
    with pytest.raises(ConfigError, match="sku cpu needs measured roofs in bfloat16"):
        fixed_terms(cells, "cpu", calibration, FitConfig(calibrate=False, roofs="measured"), "unused", None)


@pytest.mark.parametrize("name,key", [
    ("allreduce (standalone, beside)_source.cpu", "allreduce_standalone_beside_source.cpu"),
    ("allreduce_path.h100", "allreduce_path.h100"),
    ("fit.allreduce", "fit.allreduce"),
    ("roofs/bf16 (oneDNN)", "roofs/bf16_oneDNN"),
])
def test_a_term_named_for_a_reader_logs_under_a_key_mlflow_accepts(name, key):
    from mlflow.utils.validation import _validate_param_name

    from hostsweep.record.registry import mlflow_key

    assert mlflow_key(name) == key
    _validate_param_name(mlflow_key(name))
