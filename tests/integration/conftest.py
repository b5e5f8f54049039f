"""Fixtures the integration modules share: PostgreSQL and an `mlflow server` on it, started
once for the session (a fake-engine and a real-engine sweep both record into it)."""
from __future__ import annotations

import pytest

from tests.integration.mlflow_server import MlflowServer, Postgres, pg_bin


@pytest.fixture(scope="session")
def postgres():
    pytest.importorskip("psycopg2", reason="pip install psycopg2-binary (the PostgreSQL driver MLflow uses)")
    pg_bin("initdb")
    db = Postgres()
    yield db
    db.stop()


@pytest.fixture(scope="session")
def pg_server(postgres, tmp_path_factory):
    """`mlflow server --workers 2` on PostgreSQL with proxied artifacts, on loopback: the
    service as ray_cluster.yaml's head runs it."""
    server = MlflowServer(tmp_path_factory.mktemp("pg-mlflow"), postgres.uri, workers=2, proxied=True,
                          start_timeout_s=180)
    server.start()
    yield server
    server.stop()
