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
from dataclasses import dataclass
from typing import Iterator, Sequence
from urllib.parse import urlsplit

PAGE = 1000
DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")


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
    return urlsplit(uri).scheme.split("+")[0].lower() in DATABASE_SCHEMES


def stored_runs(uri: str, experiment_ids: Sequence[str], status: str = "FINISHED",
                page: int = PAGE) -> Iterator[list[StoredRun]]:
    """The active runs of these experiments with this status, `page` runs at a time (in
    run-id order), each with its tags, params and latest metrics."""
    from sqlalchemy import bindparam, create_engine, text
    from sqlalchemy.pool import NullPool

    engine = create_engine(uri, poolclass=NullPool)
    ids = [int(e) for e in experiment_ids]
    runs_q = text("SELECT run_uuid, name, status, start_time, end_time FROM runs "
                  "WHERE experiment_id IN :ids AND lifecycle_stage = 'active' AND status = :status "
                  "AND run_uuid > :after ORDER BY run_uuid LIMIT :page").bindparams(bindparam("ids", expanding=True))
    # x.key: `key` is a reserved word in MySQL, but not after a table alias
    parts = {name: text(f"SELECT x.run_uuid, x.key, x.value{extra} FROM {name} x WHERE x.run_uuid IN :runs")
             .bindparams(bindparam("runs", expanding=True))
             for name, extra in (("tags", ""), ("params", ""), ("latest_metrics", ", x.is_nan"))}
    after = ""
    try:
        while True:
            with engine.connect() as conn:
                heads = conn.execute(runs_q, {"ids": ids, "status": status, "after": after, "page": page}).all()
                if not heads:
                    return
                found = {h[0]: ({}, {}, {}) for h in heads}
                for uuid, key, value in conn.execute(parts["tags"], {"runs": list(found)}):
                    found[uuid][0][key] = value
                for uuid, key, value in conn.execute(parts["params"], {"runs": list(found)}):
                    found[uuid][1][key] = value
                for uuid, key, value, is_nan in conn.execute(parts["latest_metrics"], {"runs": list(found)}):
                    found[uuid][2][key] = math.nan if is_nan else float(value)
            yield [StoredRun(h[0], h[1] or "", h[2], int(h[3] or 0), h[4], *found[h[0]]) for h in heads]
            if len(heads) < page:
                return
            after = heads[-1][0]
    finally:
        engine.dispose()
