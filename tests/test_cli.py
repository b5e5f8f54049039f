"""The command line: bad input exits non-zero with one line, before Ray or vLLM start."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_hostsweep

GUARD = "raise ImportError('{name} must not be imported for bad input')\n"


@pytest.fixture(scope="module")
def poisoned_path(tmp_path_factory) -> Path:
    """A PYTHONPATH entry whose `ray` and `vllm` fail on import: proof neither starts."""
    root = tmp_path_factory.mktemp("poison")
    for name in ("ray", "vllm"):
        (root / name).mkdir()
        (root / name / "__init__.py").write_text(GUARD.format(name=name))
    return root


@pytest.mark.parametrize("args,needle", [
    (["+sku=h300"], "unknown sku 'h300'"),
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
])
def test_bad_input_is_one_line_nonzero_exit_and_starts_nothing(args, needle, tmp_path, poisoned_path):
    proc = run_hostsweep(args, tmp_path, pythonpath=poisoned_path)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("hostsweep: error:") and needle in lines[0]
    assert not (tmp_path / "outputs" / "mlflow.db").exists()


def test_cfg_job_prints_the_composed_config(tmp_path):
    proc = run_hostsweep(["+sku=h200", "tp=4", "--cfg", "job"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "accelerator_type: H200" in proc.stdout and "tp: 4" in proc.stdout
