"""`mlflow server` on loopback for the integration tests: started, killed (the server and its
workers at once, as a crash would) and started again on the same port and store; and a
throwaway PostgreSQL cluster for it to run on (Debian's postgresql: `make test-postgres`)."""
from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import pytest
import requests


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MlflowServer:
    """`mlflow server` on 127.0.0.1 over `store` (default: a sqlite file in `root` that
    outlives restarts). Artifacts: under `root`/artifacts, written by the clients
    (--default-artifact-root), or with `proxied` through the server
    (--artifacts-destination, as ray_cluster.yaml runs it)."""

    def __init__(self, root: Path, store: Optional[str] = None, workers: int = 1, proxied: bool = False,
                 start_timeout_s: float = 120) -> None:
        self.root, self.port, self.proc = root, free_port(), None
        self.store = store or f"sqlite:///{root}/mlflow.db"
        self.workers, self.proxied, self.start_timeout_s = workers, proxied, start_timeout_s
        self.uri = f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        artifacts = (["--artifacts-destination", (self.root / "artifacts").as_uri()] if self.proxied
                     else ["--default-artifact-root", str(self.root / "artifacts")])
        return [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
                "--workers", str(self.workers), "--backend-store-uri", self.store, *artifacts]

    def start(self) -> None:
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # starts in seconds, not a minute
        with (self.root / "server.log").open("a") as log:
            self.proc = subprocess.Popen(self.command(), env=env, stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            try:
                if requests.get(f"{self.uri}/health", timeout=1).text == "OK":
                    return
            except requests.RequestException:
                time.sleep(0.3)
        raise RuntimeError(f"mlflow server did not start: {(self.root / 'server.log').read_text()[-2000:]}")

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)  # the server and its uvicorn workers, at once
        self.proc.wait()

    def stop(self) -> None:
        """At the end of a fixture: kill it if it still runs."""
        if self.proc is not None and self.proc.poll() is None:
            self.kill()


def fake_sweep_into(uri: str, cells: int, study: str) -> list[str]:
    """Overrides of a fake-engine sweep of `cells` quick cells recording into `uri`, with a
    1-s heartbeat (the tests add their outage settings)."""
    return ["+sku=cpu", "engine.name=fake", "measure.T=5", "measure.reps=3", "measure.warmups=1", "ctx=[16]",
            f"batch=[{','.join(map(str, range(1, cells + 1)))}]",
            "split.enabled=false", "ray.exclusive=false", f"tracking.uri={uri}", f"study={study}",
            "tracking.heartbeat_s=1"]


def pg_bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if not found:
        pytest.skip("PostgreSQL is not installed: `make test-postgres` installs Debian's postgresql")
    return found[-1]


def as_postgres(command: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: root runs it as the postgres user."""
    return ["runuser", "-u", "postgres", "--", *command] if os.geteuid() == 0 else command


class Postgres:
    """A PostgreSQL cluster in a temporary folder, listening on 127.0.0.1 only, trust auth."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="hostsweep-pg-"))  # /tmp: the postgres user can reach it
        self.data, self.port = self.root / "data", free_port()
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
        subprocess.run(as_postgres([pg_bin("initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust",
                                    "--no-sync"]), check=True, capture_output=True)
        subprocess.run(as_postgres([pg_bin("pg_ctl"), "-D", str(self.data), "-l", str(self.root / "pg.log"), "-w",
                                    "-o", f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c fsync=off",
                                    "start"]), check=True, capture_output=True)
        subprocess.run(as_postgres([pg_bin("createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres",
                                    "mlflow"]), check=True, capture_output=True)
        self.uri = f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/mlflow"

    def stop(self) -> None:
        subprocess.run(as_postgres([pg_bin("pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop"]),
                       capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)
