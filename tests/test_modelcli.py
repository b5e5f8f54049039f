"""The model stage end to end on synthetic cells: fit, log to MLflow, pyfunc round trip,
what-if answers; and the all-reduce microbenchmark on gloo."""
from __future__ import annotations

import json
from itertools import product

import mlflow
import mlflow.artifacts
import mlflow.pyfunc
import numpy as np
import pandas as pd
import pytest
import yaml

from hostsweep.model.inputs import model_inputs
from hostsweep.config.options import load_model_shape, load_sku
from hostsweep.model.fit import AllReduceFit, HostFit, allreduce_s, sharded_compute_s
from hostsweep.calibrate.cli import main
from hostsweep.model.tpmodel import predict_rows

AR, HOST, G = AllReduceFit(21.2e-6, 307e9), HostFit(16.9e-3, 0.1e-3), 0.30


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("model")
    rows = pd.DataFrame([{"sku": "h100", "model": "llama-3.1-70b", "tp": k, "batch": n, "ctx": c, "T": 33, "step_ms": 0.0}
                         for k, n, c in product([2, 4], [1, 2, 4, 8], [512, 2048, 4096])])
    from dataclasses import asdict

    cells = model_inputs(rows, {"llama-3.1-70b": load_model_shape("llama-3.1-70b")}, {"h100": asdict(load_sku("h100"))})
    noise = np.random.default_rng(0).normal(0, 0.01, len(cells))
    rows["step_ms"] = (G * sharded_compute_s(cells) + allreduce_s(cells, AR) + HOST.time_s(cells["batch"])) * (1 + noise) * 1e3
    rows["step_ci_low_ms"], rows["step_ci_high_ms"] = rows["step_ms"] * 0.99, rows["step_ms"] * 1.01
    rows["status"] = "FINISHED"
    rows.to_csv(root / "cells.csv", index=False)
    (root / "calib.yaml").write_text(yaml.safe_dump({
        "allreduce": {"h100": {"latency_us": 21.2, "bandwidth_gbps": 307}}, "host": {"s0_ms": 16.9, "s1_ms": 0.1}}))
    return root


def run_main(argv):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    return stop.value.code


def test_fit_prints_writes_fit_json_and_logs_a_model_that_loads_back_as_pyfunc(workspace, capsys, new_store):
    uri = new_store(workspace / "mlflow.db")
    report = workspace / "out" / "fit.json"
    code = run_main(["--tracking-uri", uri, "fit", "--cells", str(workspace / "cells.csv"), "--json", str(report),
                     "--calibration", str(workspace / "calib.yaml"), "--train-sku", "h100", "--train-tp", "2"])
    captured = capsys.readouterr()
    out = captured.out
    assert code == 0 and "k-invariant: held-out groups h100 TP-4 say k-invariant" in out
    assert "no held-out in-regime cell lies below the bound" in out and "heldout_n = 12" in out
    assert "s0_ms" in out and "C0_ms" in out and " INFO " not in captured.err
    data = json.loads(report.read_text())
    assert data["verdict"]["verdict"] == "k-invariant" and data["scale"]["g"] == pytest.approx(G, rel=0.05)
    assert (workspace / "out" / "predictions.csv").is_file()
    model_uri = out.strip().splitlines()[-1].split()[2]
    mlflow.set_tracking_uri(uri)
    (run,) = mlflow.search_runs(experiment_names=["models"]).itertuples()
    run_data = mlflow.get_run(run.run_id).data
    assert float(run_data.params["g"]) == pytest.approx(G, rel=0.05) and run_data.params["verdict"] == "k-invariant"
    assert run_data.metrics["heldout_mape_mean"] < 3.0 and run_data.metrics["heldout_n"] == 12
    assert "fitted models" in mlflow.get_experiment_by_name("models").tags["mlflow.note.content"]
    logged = mlflow.artifacts.load_text(f"runs:/{run.run_id}/fit.json")
    assert json.loads(logged)["verdict"] == data["verdict"]
    model = mlflow.pyfunc.load_model(model_uri)
    query = pd.DataFrame([{"model": "llama-3.1-70b", "sku": "h100", "tp": 4, "batch": 2, "ctx": 2048}])
    predicted = model.predict(query)
    spec = model.unwrap_python_model().spec
    assert predicted["step_ms"].iloc[0] == pytest.approx(predict_rows(spec, query)["step_ms"].iloc[0])
    assert model.metadata.get_input_schema().input_names() == ["model", "sku", "tp", "batch", "ctx"]

    code = run_main(["--tracking-uri", uri, "whatif", model_uri, "--model", "llama-3.1-70b", "--sku", "h100",
                     "--tp", "1", "2", "4", "8"])
    out = capsys.readouterr().out
    assert code == 0 and "more GPUs stop helping at tp=" in out


def test_cells_without_t_fail_in_one_line_unless_tokens_are_given(workspace, tmp_path, capsys, new_store):
    pd.read_csv(workspace / "cells.csv").drop(columns=["T"]).to_csv(tmp_path / "no_t.csv", index=False)
    argv = ["--tracking-uri", new_store(tmp_path / "x.db"), "fit", "--cells", str(tmp_path / "no_t.csv"),
            "--calibration", str(workspace / "calib.yaml"), "--train-sku", "h100", "--json", str(tmp_path / "f.json")]
    code = run_main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "no T column" in err[0]
    assert run_main(argv + ["--tokens", "33"]) == 0


def test_synth_writes_tp_study_cells_that_fit_reads_back(tmp_path, capsys, new_store):
    assert run_main(["synth", "--out", str(tmp_path / "synth.csv"), "--seed", "3"]) == 0
    cells = pd.read_csv(tmp_path / "synth.csv")
    assert len(cells) == 24 and {"T", "step_ci_high_ms"} <= set(cells)
    assert run_main(["--tracking-uri", new_store(tmp_path / "s.db"), "fit", "--cells", str(tmp_path / "synth.csv"),
                     "--calibration", "seed002-h100", "--train-sku", "h100", "--out-dir", str(tmp_path / "run")]) == 0
    data = json.loads((tmp_path / "run" / "fit.json").read_text())
    mape = {s["form"]: s["mape_mean"] for s in data["scores"] if s["role"] == "held-out"}
    assert mape["c_times_k"] > 50 and 25 < mape["c_over_k"] < 50 and mape["free_constant"] < 5


def test_fit_with_an_unknown_calibration_fails_in_one_line(workspace, capsys):
    code = run_main(["--tracking-uri", f"sqlite:///{workspace}/x.db", "fit", "--cells", str(workspace / "cells.csv"),
                     "--calibration", "nope", "--train-sku", "h100"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "calibration 'nope'" in err[0]


def test_standalone_allreduce_times_every_message_size_on_real_gloo_ranks():
    # real processes and a real gloo group; how the times grow with size is this machine's
    # business (on one busy core gloo can read flat up to 16 MB), so only their presence is checked
    from hostsweep.calibrate.allreduce_bench import run_allreduce_sweep

    sizes = np.array([4096, 65536, 1 << 20])
    frame = run_allreduce_sweep(2, sizes, reps=3, backend="gloo")
    assert list(frame["bytes"]) == list(sizes) and (frame["seconds"] > 0).all()


def test_allreduce_command_recovers_lambda_and_beta_and_records_the_standalone_method(tmp_path, capsys, new_store,
                                                                                       monkeypatch):
    # the sweep's timings come from known terms (λ 40 µs, β 2.5 GB/s, 2 % noise): the command's
    # fit, its calibration section and its MLflow run must give them back
    import hostsweep.calibrate.allreduce_bench as bench

    latency_s, bandwidth_Bps = 40e-6, 2.5e9
    noise = np.random.default_rng(7)

    def synthetic_sweep(ranks, sizes, reps, backend="gloo"):
        assert ranks == 2 and backend == "gloo"
        seconds = (latency_s + np.asarray(sizes, float) / bandwidth_Bps) * (1 + noise.normal(0, 0.02, len(sizes)))
        return pd.DataFrame({"bytes": np.asarray(sizes, int), "seconds": seconds})

    monkeypatch.setattr(bench, "run_allreduce_sweep", synthetic_sweep)
    out_file = tmp_path / "calib.yaml"
    uri = new_store(tmp_path / "c.db")
    code = run_main(["--tracking-uri", uri, "allreduce", "--path", "standalone", "--ranks", "2", "--reps", "10",
                     "--points", "8", "--max-bytes", "16e6", "--out", str(out_file)])
    assert code == 0
    # the TP study's method is recorded as such, beside (never in place of) the engine path's section
    fitted = yaml.safe_load(out_file.read_text())["allreduce_standalone"]["cpu"]
    assert fitted["path"] == "standalone" and "gloo" in fitted["method"]
    assert fitted["latency_us"] == pytest.approx(40, rel=0.15) and fitted["bandwidth_gbps"] == pytest.approx(2.5, rel=0.1)
    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=["calibration"])
    assert list(runs["tags.calibration_kind"]) == ["allreduce"]
    assert runs["metrics.beta_gbps"].iloc[0] == pytest.approx(fitted["bandwidth_gbps"])
    assert "calibrations" in mlflow.get_experiment_by_name("calibration").tags["mlflow.note.content"]


def test_allreduce_command_that_cannot_fit_a_bandwidth_says_so_in_one_line_and_writes_nothing(
        tmp_path, capsys, new_store, monkeypatch):
    import hostsweep.calibrate.allreduce_bench as bench

    monkeypatch.setattr(bench, "run_allreduce_sweep", lambda ranks, sizes, reps, backend="gloo": pd.DataFrame(
        {"bytes": np.asarray(sizes, int), "seconds": np.full(len(sizes), 2.3e-3)}))
    out_file = tmp_path / "calib.yaml"
    code = run_main(["--tracking-uri", new_store(tmp_path / "c.db"), "allreduce", "--path", "standalone",
                     "--points", "6", "--out", str(out_file)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and "does not grow with message size" in err[-1] and not out_file.exists()


def test_roofs_microbenchmark_logs_measured_next_to_datasheet_and_feeds_the_fit(tmp_path, capsys, workspace,
                                                                                 new_store):
    uri = new_store(tmp_path / "c.db")
    calib = tmp_path / "calib.yaml"
    calib.write_text((workspace / "calib.yaml").read_text())
    assert run_main(["--tracking-uri", uri, "roofs", "--sku", "cpu", "--gemm-size", "256", "--copy-mib", "16",
                     "--out", str(calib)]) == 0
    roofs = yaml.safe_load(calib.read_text())["roofs"]["cpu"]
    assert roofs["measured_tflops"] > 0 and roofs["measured_bandwidth_gbps"] > 0
    assert "allreduce" in yaml.safe_load(calib.read_text())  # merged, not overwritten
    code = run_main(["--tracking-uri", uri, "fit", "--cells", str(workspace / "cells.csv"), "--calibration",
                     str(calib), "--train-sku", "h100", "--roofs", "measured", "--out-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "needs a roofs section for sku ['h100']" in err[-1]


def test_host_calibration_recovers_s0_and_s1_from_tp1_host_residuals(tmp_path, capsys, new_store):
    rows = pd.DataFrame([{"sku": "cpu", "model": "tiny-llama", "tp": 1, "batch": n, "ctx": c,
                          "step_ms": 20.0, "host_ms": 5.0 + 0.25 * (n - 1), "status": "FINISHED"}
                         for n in (1, 2, 4, 8) for c in (128, 512)])
    rows.to_csv(tmp_path / "cells.csv", index=False)
    out = tmp_path / "calib.yaml"
    assert run_main(["--tracking-uri", new_store(tmp_path / "c.db"), "host", "--cells", str(tmp_path / "cells.csv"),
                     "--model", "tiny-llama", "--sku", "cpu", "--out", str(out)]) == 0
    host = yaml.safe_load(out.read_text())["host"]
    assert host["s0_ms"] == pytest.approx(5.0) and host["s1_ms"] == pytest.approx(0.25)


def test_every_option_of_every_subcommand_says_what_it_is():
    import argparse

    from hostsweep.calibrate.cli import parser

    def silent(p: argparse.ArgumentParser, where: str) -> list[str]:
        found = []
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    found += silent(sub, f"{where} {name}")
            elif not isinstance(action, argparse._HelpAction) and not (action.help or "").strip():
                found.append(f"{where} {action.option_strings or action.dest}")
        return found

    assert silent(parser(), "hostsweep-model") == []


@pytest.mark.parametrize("argv,needle", [
    (["fit", "--cells", "nowhere.csv", "--calibration", "seed002-h100", "--train-sku", "h100"],
     "--cells nowhere.csv: no such file"),
    (["synth", "--calibration", "seed002-h100", "--below-bound", "h200:4"],
     "--below-bound h200:4 matches no cell: the grid has sku h100 and tp 2, 4"),
    (["synth", "--calibration", "seed002-h100", "--below-bound", "h100"], "--below-bound h100 matches no cell"),
])
def test_cli_mistakes_are_one_line_errors_that_write_nothing(argv, needle, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = ["--out", str(tmp_path / "s.csv")] if argv[0] == "synth" else []
    code = run_main(["--tracking-uri", f"sqlite:///{tmp_path}/x.db", *argv, *out])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "s.csv").exists()


def test_the_tracking_uri_defaults_to_hostsweep_tracking_uri_as_the_sweeps_does(monkeypatch):
    """A cluster's head exports HOSTSWEEP_TRACKING_URI (ray_cluster.yaml): hostsweep-model
    reads the same store as the sweeps it models, without --tracking-uri."""
    from hostsweep.calibrate.cli import parser
    from hostsweep.config.schema import DEFAULT_TRACKING_URI, TRACKING_URI_ENV
    from tests.conftest import compose_typed

    monkeypatch.setenv(TRACKING_URI_ENV, "http://10.0.0.5:5000")
    assert parser().parse_args(["synth", "--out", "x.csv"]).tracking_uri == "http://10.0.0.5:5000"
    assert compose_typed(["+sku=cpu"]).config.tracking.uri == "http://10.0.0.5:5000"  # the sweep's, alike
    given = ["--tracking-uri", "sqlite:///x.db", "synth", "--out", "x.csv"]
    assert parser().parse_args(given).tracking_uri == "sqlite:///x.db"
    monkeypatch.delenv(TRACKING_URI_ENV)
    assert parser().parse_args(["synth", "--out", "x.csv"]).tracking_uri == DEFAULT_TRACKING_URI

