"""`python -m hostsweep` from a non-editable install, run in an unrelated folder."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def test_wheel_ships_the_config_tree_and_composes_overrides(tmp_path):
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(wheels), str(REPO)],
                   check=True, timeout=300)
    (wheel,) = wheels.glob("hostsweep-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                    str(wheel)], check=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(target)}
    where = subprocess.run([sys.executable, "-c", "import hostsweep.conf as c; print(c.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
    assert where.stdout.startswith(str(target))
    proc = subprocess.run([sys.executable, "-m", "hostsweep", "+sku=h200", "tp=4", "--cfg", "job"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "accelerator_type: H200" in proc.stdout and "tp: 4" in proc.stdout
