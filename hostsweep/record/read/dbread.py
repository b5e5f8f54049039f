"""Runs read straight from a database-backed MLflow store (sqlite, PostgreSQL, MySQL), a
page at a time: the read-back path for thousands of cell runs.

MLflow's `search_runs` builds an ORM object per tag, param and metric (about 60 per cell
run): reading 10,000 cells that way takes tens of seconds, nearly all of it in SQLAlchemy's
object bookkeeping. The four tables it reads (`runs`, `tags`, `params`, `latest_metrics`)
have had the same columns since MLflow 1.x, so for a database URI the rows are read with
plain SELECTs instead, `PAGE` runs at a time (bounded memory). Any error (another schema, a
driver missing) makes the callers fall back to `search_runs`; a server URI (http://) always
goes through the server's API.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from hostsweep.config.validation import store_scheme

PAGE = 1000
DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
# a run's own columns, in StoredRun's order
HEAD_COLUMNS = "run_uuid, name, status, start_time, end_time"


@dataclass(frozen=True)
class StoredRun:
    run_id: str
    name: str
    status: str
    start_time: int
    end_time: int | None
    tags: dict[str, str]
    params: dict[str, str]
    metrics: dict[str, float]


def is_database(uri: str) -> bool:
    return store_scheme(uri) in DATABASE_SCHEMES


def stored_runs(uri: str, experiment_ids: Sequence[str], status: str = "FINISHED",
                page: int = PAGE) -> Iterator[list[StoredRun]]:
    """The active runs of these experiments with this status, `page` runs at a time (in
    run-id order), each with its tags, params and latest metrics."""
    from sqlalchemy import bindparam, text

    runs_q = text(f"SELECT {HEAD_COLUMNS} FROM runs "
                  "WHERE experiment_id IN :ids AND lifecycle_stage = 'active' AND status = :status "
                  "AND run_uuid > :after ORDER BY run_uuid LIMIT :page").bindparams(bindparam("ids", expanding=True))
    ids = [int(e) for e in experiment_ids]
    after = ""
    with _engine(uri) as engine:
        while True:
            with engine.connect() as conn:
                heads = conn.execute(runs_q, {"ids": ids, "status": status, "after": after, "page": page}).all()
                if not heads:
                    return
                yield _with_parts(conn, heads)
            if len(heads) < page:
                return
            after = heads[-1][0]


def runs_by_id(uri: str, run_ids: Sequence[str], page: int = PAGE) -> Iterator[list[StoredRun]]:
    """These runs (whatever their status; ids not in the store are left out), `page` at a
    time, each with its tags, params and latest metrics."""
    from sqlalchemy import bindparam, text

    runs_q = text(f"SELECT {HEAD_COLUMNS} FROM runs WHERE run_uuid IN :runs").bindparams(
        bindparam("runs", expanding=True))
    with _engine(uri) as engine:
        for first in range(0, len(run_ids), page):
            with engine.connect() as conn:
                heads = conn.execute(runs_q, {"runs": list(run_ids[first:first + page])}).all()
                if heads:
                    yield _with_parts(conn, heads)


def finished_index(uri: str, experiment_id: str, metric_keys: Sequence[str]) -> list[tuple[str, int, str, frozenset[str]]]:
    """(run id, start time, cell key, which of `metric_keys` it logged) of each active
    FINISHED run of the experiment that has a cell_key tag, in run-id order: what a resumed
    sweep decides on, read as two narrow SELECTs instead of every run's ~60 rows."""
    from sqlalchemy import bindparam, text

    finished = "r.experiment_id = :experiment AND r.lifecycle_stage = 'active' AND r.status = 'FINISHED'"
    # t.key, m.key: `key` is a reserved word in MySQL, but not after a table alias
    keyed_q = text("SELECT r.run_uuid, r.start_time, t.value FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid "
                   f"WHERE {finished} AND t.key = 'cell_key' ORDER BY r.run_uuid")
    metrics_q = text("SELECT m.run_uuid, m.key FROM latest_metrics m JOIN runs r ON r.run_uuid = m.run_uuid "
                     f"WHERE {finished} AND m.key IN :keys").bindparams(bindparam("keys", expanding=True))
    logged: dict[str, set[str]] = {}
    with _engine(uri) as engine, engine.connect() as conn:
        keyed = conn.execute(keyed_q, {"experiment": int(experiment_id)}).all()
        if metric_keys:
            for uuid, key in conn.execute(metrics_q, {"experiment": int(experiment_id), "keys": list(metric_keys)}):
                logged.setdefault(uuid, set()).add(key)
    return [(uuid, int(start or 0), key, frozenset(logged.get(uuid, ()))) for uuid, start, key in keyed]


@contextmanager
def _engine(uri: str) -> Iterator[Any]:
    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    engine = create_engine(uri, poolclass=NullPool)
    try:
        yield engine
    finally:
        engine.dispose()


def _with_parts(conn: Any, heads: Sequence[Any]) -> list[StoredRun]:
    """The runs whose `heads` (HEAD_COLUMNS rows) were read, with their tags, params and
    latest metrics, read in one SELECT each."""
    queries, runs = _part_queries(), {"runs": [h[0] for h in heads]}
    found: dict[str, tuple[dict[str, str], dict[str, str], dict[str, float]]] = {h[0]: ({}, {}, {}) for h in heads}
    for uuid, key, value in conn.execute(queries["tags"], runs):
        found[uuid][0][key] = value
    for uuid, key, value in conn.execute(queries["params"], runs):
        found[uuid][1][key] = value
    for uuid, key, value, is_nan in conn.execute(queries["latest_metrics"], runs):
        found[uuid][2][key] = math.nan if is_nan else float(value)
    return [StoredRun(h[0], h[1] or "", h[2], int(h[3] or 0), h[4], *found[h[0]]) for h in heads]


def _part_queries() -> dict[str, Any]:
    from sqlalchemy import bindparam, text

    # x.key: `key` is a reserved word in MySQL, but not after a table alias
    return {name: text(f"SELECT x.run_uuid, x.key, x.value{extra} FROM {name} x WHERE x.run_uuid IN :runs")
            .bindparams(bindparam("runs", expanding=True))
            for name, extra in (("tags", ""), ("params", ""), ("latest_metrics", ", x.is_nan"))}
