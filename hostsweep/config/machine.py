"""What this machine is: its SKU kind (nvidia-smi), CPU flags and model name, and the
device name an engine runs on. Read by config resolution (default SKU and dtype), the
engines and provenance; the one place /proc/cpuinfo is parsed.
"""
from __future__ import annotations

import platform
import shutil
import socket
import subprocess
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
