"""Where a number came from: versions, git SHA, host and device names."""
from __future__ import annotations

import platform
import socket
import subprocess
from importlib import metadata
from pathlib import Path


def package_version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not-installed"


def git_sha() -> str:
    """The commit of the hostsweep checkout, or 'unknown' for an installed wheel."""
    source_dir = Path(__file__).resolve().parents[2]  # the checkout holding hostsweep/
    try:
        out = subprocess.run(
            ["git", "-C", str(source_dir), "rev-parse", "HEAD"],
            capture_output=True, text=True, timeout=5, check=True,
        )
    except (subprocess.SubprocessError, OSError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown-cpu"


def device_name(gpu: bool) -> str:
    """The GPU's name on GPU engines, the CPU's model name otherwise."""
    if gpu:
        import torch

        return torch.cuda.get_device_name(0)
    return cpu_model_name()


def hostname() -> str:
    return socket.gethostname()


def driver_tags() -> dict[str, str]:
    """Provenance known on the driver, before any worker reports back."""
    return {
        "hostsweep_version": package_version("hostsweep"),
        "ray_version": package_version("ray"),
        "git_sha": git_sha(),
        "driver_host": hostname(),
    }
