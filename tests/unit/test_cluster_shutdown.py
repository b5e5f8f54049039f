"""Stopping the local cluster: its autoscaler monitor goes first (run/cluster.py)."""
from __future__ import annotations

import subprocess
import sys

from hostsweep.run.cluster import AUTOSCALER_MONITOR, stop_autoscaler_monitor


def test_only_the_local_clusters_autoscaler_monitor_is_killed_before_shutdown(tmp_path):
    monitor = tmp_path / AUTOSCALER_MONITOR
    monitor.parent.mkdir(parents=True)
    monitor.write_text("import time; time.sleep(60)\n")
    other = tmp_path / "log_monitor.py"
    other.write_text("import time; time.sleep(60)\n")
    procs = [subprocess.Popen([sys.executable, "-u", str(script), "--logs-dir=/tmp"]) for script in (monitor, other)]
    try:
        assert stop_autoscaler_monitor() == [procs[0].pid]
        assert procs[0].wait(timeout=10) == -9
        assert procs[1].poll() is None
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
