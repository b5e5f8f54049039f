"""Where a number came from: versions, git SHA, host and device names."""
from __future__ import annotations

import subprocess
from importlib import metadata
from pathlib import Path

from hostsweep.config.machine import hostname


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


def driver_tags() -> dict[str, str]:
    """Provenance known on the driver, before any worker reports back."""
    return {
        "hostsweep_version": package_version("hostsweep"),
        "ray_version": package_version("ray"),
        "git_sha": git_sha(),
        "driver_host": hostname(),
    }
