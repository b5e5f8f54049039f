"""The command line: bad input, and a world that cannot host the sweep, exit 2 with one
line within seconds, before Ray or vLLM start (both are made unimportable here)."""
from __future__ import annotations

import fcntl
import json
import shutil
import subprocess
import time
from functools import partial
from pathlib import Path

import pytest

from tests.conftest import run_concurrently, run_hostsweep
from tests.listeners import silent_listener

GUARD = "raise ImportError('{name} must not be imported for bad input')\n"


@pytest.fixture(scope="module")
def poisoned_path(tmp_path_factory) -> Path:
    """A PYTHONPATH entry whose `ray`, `vllm` and `mlflow` fail on import: proof neither
    starts, and that a refusal does not pay MLflow's import (1.5 s here) either."""
    root = tmp_path_factory.mktemp("poison")
    for name in ("ray", "vllm", "mlflow"):
        (root / name).mkdir()
        (root / name / "__init__.py").write_text(GUARD.format(name=name))
    return root


BAD_INPUT = [
    (["+sku=h300"], "unknown sku 'h300'"),
    (["+sku=cpu", "+pair.against.mode=graph", "pair.python=/nonexistent/bin/python"],
     "pair.python=/nonexistent/bin/python: no executable there"),
    (["+sku=cpu", "+pair.against.batch=[4]"], "pair.against.batch: batch is what both sides share"),
    (["model=llama-9b"], "unknown model 'llama-9b'"),
    (["mode=turbo"], "unknown mode 'turbo'"),
    (["+sku=cpu", "tp=3"], "tp=3 does not divide"),
    (["+sku=cpu", "batch=[0]"], "batch must be positive"),
    (["+sku=cpu", "ctx=-5"], "ctx must be positive"),
    (["+sku=cpu", "ctx=[5000]"], "max_position_embeddings"),
    (["+sku=cpu", "measure.T=1"], "measure.T must be >= 2"),
    (["+sku=cpu", "mode=fp8"], "mode fp8 needs CUDA compute capability >= 8.9; sku cpu has no GPU"),
    (["+sku=cpu", "+engine.engine_args.enforce_eagr=true"], "did you mean 'enforce_eager'?"),
    (["+sku=cpu", "workload=creative"], "workload='creative' is not allowed; allowed: random, repeat"),
    (["+sku=cpu", "modes=[eager,turbo]"], "unknown mode 'turbo' in modes"),
    # an unknown key, with `+` (Hydra would add it and nothing would read it: the default
    # study ran) or without (Hydra's multi-line error, exit 1), names the closest known key
    (["+mesure.T=5"], "unknown key 'mesure.T' in +mesure.T=5; did you mean 'measure.T'?"),
    (["+measure.Tt=5"], "unknown key 'measure.Tt' in +measure.Tt=5; did you mean 'measure.T'?"),
    (["mesure.T=5"], "unknown key 'mesure.T' in mesure.T=5; did you mean 'measure.T'?"),
    (["+sku=cpu", "split.enabeld=false"], "did you mean 'split.enabled'?"),
    (["+sku=cpu", "model.shape.hiden_size=64"], "did you mean 'model.shape.hidden_size'?"),
    (["+sku=cpu", "engine.engine_args.enforce_eagr=true"], "did you mean 'enforce_eager'?"),
]


def refusals(rows: list, run, tmp_path_factory) -> dict:
    """`run(args, cwd)` for every row at once (each in its own folder): (cwd, result) by args."""
    folders = {tuple(args): tmp_path_factory.mktemp("refused") for args, _ in rows}
    return run_concurrently({key: partial(lambda k, cwd: (cwd, run(list(k), cwd)), key, cwd)
                             for key, cwd in folders.items()})


@pytest.fixture(scope="module")
def bad_input_runs(tmp_path_factory, poisoned_path) -> dict:
    return refusals(BAD_INPUT, lambda args, cwd: run_hostsweep(args, cwd, pythonpath=poisoned_path), tmp_path_factory)


@pytest.mark.parametrize("args,needle", BAD_INPUT)
def test_bad_input_is_one_line_nonzero_exit_and_starts_nothing(args, needle, bad_input_runs):
    cwd, proc = bad_input_runs[tuple(args)]
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("hostsweep: error:") and needle in lines[0]
    assert not (cwd / "outputs").exists()  # no store, and no empty run directory either


def test_cfg_job_prints_the_composed_config(tmp_path):
    proc = run_hostsweep(["+sku=h200", "tp=4", "--cfg", "job"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "accelerator_type: H200" in proc.stdout and "tp: 4" in proc.stdout


def assert_refused(proc, needle: str, elapsed: float) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("hostsweep: error:") and needle in lines[0], lines[0]
    assert elapsed < 30, f"took {elapsed:.0f} s"
    return lines[0]


# Each row is a world the sweep cannot run in; the message names what to do about it.
PREFLIGHT = [
    (["ray.address=127.0.0.1:1"], "ray.address=127.0.0.1:1: nothing answers at 127.0.0.1:1"),
    (["ray.address=auto"], "no Ray cluster was started on this machine"),
    (["tracking.uri=http://127.0.0.1:9"], "tracking.uri=http://127.0.0.1:9 does not answer"),
    (["tracking.uri=file:///tmp/mlruns"], "is not a supported store (MLflow >= 3.13 refuses the file store)"),
    (["model=checkpoint", "model.path=/nonexistent"], "model.path=/nonexistent does not exist"),
    (["model=checkpoint", "model.path=meta-llama/Llama-3.2-1B"], "is a hub id and this machine has no hub access"),
    (["hydra.run.dir=/proc/x"], "hydra.run.dir=/proc/x: cannot write there"),
    (["study=../../x"], "study='../../x' is not allowed"),
    (["study=a/b"], "study='a/b' is not allowed"),
    (["tracking.stale_after_s=10"], "tracking.stale_after_s=10.0 must exceed"),
    (["faults.cell_timeout_s=0"], "faults.cell_timeout_s must be positive"),
]


def timed_preflight(args: list[str], cwd: Path, poisoned_path: Path) -> tuple[subprocess.CompletedProcess, float]:
    env = {"TMPDIR": str(cwd), "HF_ENDPOINT": "http://127.0.0.1:9", "RAY_ADDRESS": ""}
    started = time.monotonic()
    proc = run_hostsweep(["+sku=cpu", *args], cwd, pythonpath=poisoned_path, env=env)
    return proc, time.monotonic() - started


@pytest.fixture(scope="module")
def preflight_runs(tmp_path_factory, poisoned_path) -> dict:
    # side by side, each takes longer than alone: the limit of 30 s still holds for each
    return refusals(PREFLIGHT, lambda args, cwd: timed_preflight(args, cwd, poisoned_path), tmp_path_factory)


@pytest.mark.parametrize("args,needle", PREFLIGHT, ids=lambda v: v[0] if isinstance(v, list) else None)
def test_a_world_that_cannot_host_the_sweep_is_refused_in_seconds_before_ray_starts(args, needle, preflight_runs):
    cwd, (proc, elapsed) = preflight_runs[tuple(args)]
    assert_refused(proc, needle, elapsed)
    assert not (cwd / "outputs").exists()  # no store, and no empty run directory either


def test_a_cluster_address_that_accepts_and_never_answers_is_refused_in_seconds(tmp_path, poisoned_path):
    """A mistyped port on a busy head: Ray would retry its GCS for minutes, deaf to SIGTERM."""
    with silent_listener() as port:
        proc, elapsed = timed_preflight([f"ray.address=127.0.0.1:{port}"], tmp_path, poisoned_path)
    assert_refused(proc, f"ray.address=127.0.0.1:{port}: 127.0.0.1:{port} accepts connections but does not answer",
                   elapsed)
    assert elapsed < 10, f"took {elapsed:.0f} s"
    assert not (tmp_path / "outputs").exists()


def test_a_gpu_sku_without_a_cluster_on_a_machine_without_that_gpu_is_refused_before_ray(tmp_path, poisoned_path):
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has GPUs")
    started = time.monotonic()
    proc = run_hostsweep(["+sku=h200", "tp=4", "model=llama-3.1-8b"], tmp_path, pythonpath=poisoned_path)
    line = assert_refused(proc, "sku=h200 needs H200 GPUs but this machine has none", time.monotonic() - started)
    assert "ray.address" in line


def test_credentials_in_the_tracking_uri_never_reach_the_console(tmp_path, poisoned_path):
    proc = run_hostsweep(["+sku=cpu", "tracking.uri=http://alice:s3cret@127.0.0.1:9"], tmp_path,
                         pythonpath=poisoned_path)
    assert_refused(proc, "tracking.uri=http://alice:***@127.0.0.1:9 does not answer", 0)
    assert "s3cret" not in proc.stderr + proc.stdout
    # Hydra saved the overrides before the refusal; the refused run's folder is gone with them
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and b"s3cret" in p.read_bytes()]


def test_credentials_in_the_overrides_stay_hidden_when_a_job_crashes(tmp_path, poisoned_path):
    # the compare stage imports MLflow, poisoned here: an unexpected error, which Hydra
    # reports by quoting every override ("Error executing job with overrides: [...]")
    proc = run_hostsweep(["+sku=cpu", "stage=compare", "tracking.uri=http://alice:s3cret@127.0.0.1:9"], tmp_path,
                         pythonpath=poisoned_path)
    assert proc.returncode == 1 and "mlflow must not be imported" in proc.stderr, proc.stderr[-2000:]
    assert "tracking.uri=http://alice:***@127.0.0.1:9" in proc.stderr
    assert "s3cret" not in proc.stderr + proc.stdout
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and b"s3cret" in p.read_bytes()]


def test_a_second_sweep_on_this_machine_is_refused_while_the_first_measures(tmp_path, poisoned_path):
    lock = (tmp_path / "hostsweep-local-cluster.lock").open("a+")
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as the first sweep holds it
    lock.write(json.dumps({"pid": 4711, "study": "default", "run_dir": "outputs/x"}))
    lock.flush()
    try:
        proc = run_hostsweep(["+sku=cpu"], tmp_path, pythonpath=poisoned_path, env={"TMPDIR": str(tmp_path)})
    finally:
        lock.close()
    line = assert_refused(proc, "another sweep (pid 4711, study default", 0)
    assert "ray.exclusive=false" in line


def test_help_says_what_hostsweep_is_how_to_choose_skus_and_runs_and_the_main_keys(tmp_path, poisoned_path):
    proc = run_hostsweep(["--help"], tmp_path, pythonpath=poisoned_path)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert text.startswith("hostsweep: where the time in one LLM decode step goes")
    for needle in ("+sku=cpu|h100|h200", "-m (multirun)", "== Stages (stage=NAME", "  diff ", "study=NAME",
                   "verbose=true", "tracking.uri=", "== Presets (+experiment=NAME", "  generalize-cpu ",
                   "model: checkpoint", "summary.json"):
        assert needle in text, needle
    assert "_schema" not in text and "is powered by Hydra" not in text


def test_a_refused_run_leaves_no_folder_behind_where_hydra_made_one(tmp_path, poisoned_path):
    # tp=3 is refused when the study is resolved: after Hydra made the run directory
    proc = run_hostsweep(["+sku=cpu", "tp=3"], tmp_path, pythonpath=poisoned_path)
    assert_refused(proc, "tp=3 does not divide", 0)
    assert not (tmp_path / "outputs").exists()
    named = tmp_path / "named" / "run"
    proc = run_hostsweep(["+sku=cpu", "tp=3", f"hydra.run.dir={named}"], tmp_path, pythonpath=poisoned_path)
    assert_refused(proc, "tp=3 does not divide", 0)
    assert not (tmp_path / "named").exists()


def test_a_refused_rerun_into_a_run_directory_keeps_what_was_there(tmp_path, poisoned_path):
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / "hostsweep.log").write_text("the first run's log\n")
    (run_dir / "cells.csv").write_text("key\n")
    proc = run_hostsweep(["+sku=cpu", "tp=3", f"hydra.run.dir={run_dir}"], tmp_path, pythonpath=poisoned_path)
    assert_refused(proc, "tp=3 does not divide", 0)
    assert (run_dir / "cells.csv").read_text() == "key\n"
    assert (run_dir / "hostsweep.log").read_text().startswith("the first run's log\n")


def test_a_refused_run_into_an_empty_folder_of_the_users_leaves_it_empty(tmp_path, poisoned_path):
    run_dir = tmp_path / "mine"
    run_dir.mkdir()
    proc = run_hostsweep(["+sku=cpu", "tp=3", f"hydra.run.dir={run_dir}"], tmp_path, pythonpath=poisoned_path)
    assert_refused(proc, "tp=3 does not divide", 0)
    assert run_dir.is_dir() and not any(run_dir.iterdir())


def test_a_multirun_whose_every_job_is_refused_leaves_no_folder(tmp_path, poisoned_path):
    proc = run_hostsweep(["-m", "+sku=cpu", "tp=3,5"], tmp_path, pythonpath=poisoned_path)
    assert proc.returncode == 2, proc.stderr
    assert not (tmp_path / "multirun").exists(), sorted(map(str, tmp_path.rglob("*")))
