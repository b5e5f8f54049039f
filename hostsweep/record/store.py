"""The tracking store from outside MLflow: does it answer (checked in seconds, before Ray
starts; MLflow's client retries a dead server for about four minutes), and keeping
MLflow's INFO chatter off the console. Imports no MLflow."""
from __future__ import annotations

import base64
import logging
import os
import tempfile
import urllib.error
import urllib.request
from urllib.request import url2pathname
from pathlib import Path
from typing import Optional
from urllib.parse import urlsplit, urlunsplit

from hostsweep.config.redact import redact
from hostsweep.config.schema import ConfigError
from hostsweep.config.validation import is_server, store_scheme
from hostsweep.run.netprobe import check_listening

TIMEOUT_S = 5.0
DEFAULT_PORTS = {"postgresql": 5432, "mysql": 3306, "mssql": 1433}


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable_folder(path: Path, what: str) -> None:
    """ConfigError unless `path` is (or can be made) a folder this process may write in:
    its nearest existing ancestor takes a temporary file (access() would say yes to root)."""
    existing = _nearest_existing(path.absolute())
    if not existing.is_dir():
        raise ConfigError(f"{what}={path}: cannot write there ({existing} is not a folder)")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        raise ConfigError(f"{what}={path}: cannot write there ({existing}: {exc.strerror or exc})") from None


def _check_server(uri: str, timeout_s: float) -> None:
    """MLflow's /health must answer 200 OK (any other answer is not an MLflow server)."""
    parts = urlsplit(uri)
    bare = urlunsplit((parts.scheme, parts.hostname + (f":{parts.port}" if parts.port else ""),
                       parts.path.rstrip("/") + "/health", "", ""))
    request = urllib.request.Request(bare)
    if parts.username:
        token = base64.b64encode(f"{parts.username}:{parts.password or ''}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = response.read(100).decode(errors="replace").strip()
            status = response.status
    except urllib.error.HTTPError as exc:
        status, body = exc.code, ""
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ConfigError(f"tracking.uri={redact(uri)} does not answer within {timeout_s:.0f} s ({reason}); "
                          "is the MLflow server up?") from None
    if status != 200 or body != "OK":
        raise ConfigError(f"tracking.uri={redact(uri)} answered /health with {status} {body[:40]!r}, "
                          "not an MLflow server's 200 OK")


def _check_database(uri: str, scheme: str, timeout_s: float) -> None:
    parts = urlsplit(uri)
    host, port = parts.hostname or "localhost", parts.port or DEFAULT_PORTS[scheme]
    check_listening(host, port, timeout_s, f"tracking.uri={redact(uri)}")


def check_store_answers(uri: str, timeout_s: float = TIMEOUT_S) -> None:
    """ConfigError (one line) unless the store answers: a server's /health, a database's
    port, a sqlite file's folder writable. (config.validation checked the scheme.)"""
    scheme = store_scheme(uri)
    if is_server(uri):
        _check_server(uri, timeout_s)
    elif scheme == "sqlite":
        check_writable_folder(Path(uri[len("sqlite:///"):]).parent, "tracking.uri (sqlite folder)")
    elif scheme in DEFAULT_PORTS:
        _check_database(uri, scheme, timeout_s)


def quiet_mlflow() -> None:
    """No INFO lines from MLflow on the console ("Creating initial MLflow database tables",
    input-example checks): MLflow gives its loggers their own stderr handler at INFO. Its
    level comes from MLFLOW_LOGGING_LEVEL when it is first imported; loggers already set up
    are lowered directly."""
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)


# HTTP libraries that log every retry of a call to an unreachable store at WARNING
# ("Retrying (Retry(total=0, ...)) after connection broken by ..."): the uploader says once
# that MLflow is unreachable and what happens to the cells; the retries go to the log file.
RETRY_CHATTER = ("urllib3", "requests")


class LogFileOnly(logging.Filter):
    """Drops the HTTP libraries' records below ERROR from the handler it is added to."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name.split(".")[0] in RETRY_CHATTER and record.levelno < logging.ERROR)


def retry_chatter_to_log_file() -> None:
    """Keep the HTTP libraries' retry lines off the console: every handler of the root logger
    but the log files (Hydra's hostsweep.log) gets the LogFileOnly filter."""
    for handler in logging.getLogger().handlers:
        if not isinstance(handler, logging.FileHandler) and not any(isinstance(f, LogFileOnly)
                                                                     for f in handler.filters):
            handler.addFilter(LogFileOnly())


def local_artifact_root(tracking_uri: str) -> Optional[Path]:
    """Artifacts beside a local sqlite store (outputs/mlartifacts), None for servers."""
    prefix = "sqlite:///"
    if not tracking_uri.startswith(prefix):
        return None
    return Path(tracking_uri[len(prefix):]).resolve().parent / "mlartifacts"


def local_folder(artifact_uri: str) -> Optional[Path]:
    """The folder of an artifact URI on this machine (a path or file://), None for a
    server's (mlflow-artifacts:, s3:, http:)."""
    parts = urlsplit(artifact_uri)
    if parts.scheme == "file":
        return Path(url2pathname(parts.path))
    return Path(artifact_uri) if parts.scheme == "" else None


# The artifact store behind a tracking server (its --artifacts-destination), for a driver
# that writes straight into the server's database (tracking.artifacts): set by the stages.
_served_artifacts: Optional[str] = None
SERVED_SCHEME = "mlflow-artifacts"


def serve_artifacts_from(destination: Optional[str]) -> None:
    """A tracking server proxies its runs' artifacts (mlflow-artifacts:/PATH is
    DESTINATION/PATH on its side). MLflow's client can reach them only through the server
    (an http tracking URI); a database tracking URI of that server's store reads and writes
    them in `destination` directly. None: through a server only."""
    global _served_artifacts
    _served_artifacts = destination.rstrip("/") if destination else None


def served_artifacts() -> Optional[str]:
    return _served_artifacts


def served_location(artifact_uri: str) -> Optional[str]:
    """Where a server-proxied artifact URI (mlflow-artifacts:[//host]/PATH) lives in the
    destination given to serve_artifacts_from; None for any other URI."""
    parts = urlsplit(artifact_uri)
    if parts.scheme != SERVED_SCHEME:
        return None
    if _served_artifacts is None:
        raise ConfigError(f"the experiment keeps its artifacts behind a tracking server ({artifact_uri}); a database "
                          "tracking.uri reaches them only with tracking.artifacts set to that server's "
                          "--artifacts-destination")
    return f"{_served_artifacts}/{parts.path.lstrip('/')}"
