"""The tracking store: its URI, the MLflow client, retries on a locked database, and the server probe.

Which store. The default is the workspace's embedded SQLite file (`sqlite_file` names it). A
database URI goes through `store_uri` (a bare `postgresql://` is pinned to psycopg 3, the
`reslab[postgres]` extra); a tracking server (`http(s)://`, e.g. `mlflow server
--backend-store-uri postgresql+psycopg://... --allowed-hosts mlflow:5000`) is probed by
`check_server` before a writer or reader uses it, so a server that is down, or whose
`--allowed-hosts` refuses the Host header this client sends, is a one-line error
(`TrackingUnavailable`), not a traceback; a database store is connected to first (`check_database`),
so a wrong password, an unknown database or a database that is down is one line in seconds, not
MLflow's ~100 s of engine retries and a traceback. `probe_store` makes whichever check a URI needs,
and `store_error` turns any other failure to open a store into one line naming it (redacted).

The only place that imports mlflow (`import_mlflow`, lazily: it costs ~3 s). It bounds MLflow's
HTTP retries (`HTTP_RETRIES`: a write to a server that answers 503 gives up in seconds, not after
~5 minutes of backoff; the driver's tracker waits out a longer outage itself, `tracking.guarded`), and
`is_outage` tells such a failure (a server or database that does not answer) from any other. Writes
retry briefly on a locked SQLite database (`retry`), for a second `reslab` process (or the
dashboard) touching the same file.
"""

from __future__ import annotations

import base64
import importlib.util
import logging
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from reslab.common.errors import ReslabError
from reslab.orchestrator.durability.storage import redact

T = TypeVar("T")
# MLflow's HTTP client, unless the environment says otherwise: 2 retries (urllib3 waits 0 s, then 2 s
# plus up to 1 s of jitter), 60 s per request. MLflow's own default, 7 retries at backoff factor 2,
# stalled a driver for ~5 minutes per write while a server's database was down.
HTTP_RETRIES = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                "MLFLOW_HTTP_REQUEST_TIMEOUT": "60"}
_API_PROBE = "/api/2.0/mlflow/experiments/search?max_results=1"


class TrackingUnavailable(ReslabError, RuntimeError):
    """The tracking server does not answer."""


def import_mlflow() -> Any:
    """`mlflow.MlflowClient`, imported on first use (with telemetry off and alembic's chatter quiet)."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    for name, value in HTTP_RETRIES.items():
        os.environ.setdefault(name, value)
    from mlflow import MlflowClient

    logging.getLogger("alembic").setLevel(logging.WARNING)
    # MLflow logs every database error with its traceback (~40 lines) before it raises it: the error
    # itself reaches reslab, which says it in one line
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)
    return MlflowClient


def retry(fn: Callable[[], T], what: str, attempts: int = 6) -> T:
    """Retry a write that hit a locked SQLite database (another process holds the write lock)."""
    delay = 0.2
    for i in range(attempts):
        try:
            return fn()
        except Exception as exc:  # mlflow wraps sqlalchemy errors variously
            if "locked" not in str(exc).lower() or i == attempts - 1:
                raise
            logging.getLogger(__name__).warning("%s: database locked, retrying in %.1fs", what, delay)
            time.sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")


_SQLITE, _PYSQLITE = "sqlite:///", "sqlite+pysqlite:///"


def sqlite_file(uri: str) -> Path | None:
    """The database file of a `sqlite:///` URI (or `store_uri`'s `sqlite+pysqlite:///`), its path unquoted as
    SQLAlchemy reads it (`%3F` is a `?` in the name, a bare `?` starts the query); None for any other store."""
    prefix = next((p for p in (_SQLITE, _PYSQLITE) if uri.startswith(p)), None)
    if prefix is None:
        return None
    return Path(urllib.parse.unquote(uri.removeprefix(prefix).split("?", 1)[0]))


def store_uri(uri: str) -> str:
    """The tracking URI as MLflow is given it. A PostgreSQL store named without a driver
    (`postgresql://`, or `postgres://`, which SQLAlchemy rejects) gets psycopg 3,
    `postgresql+psycopg://` (the `reslab[postgres]` extra): SQLAlchemy 2.0 picks psycopg2 for a bare
    `postgresql://` and 2.1 psycopg, so naming the driver makes every driver process and server use
    the one the extra installs. A URI that names its driver (`postgresql+psycopg2://`) is kept as
    given. A PostgreSQL driver that is not installed is a one-line error, not a traceback from
    SQLAlchemy's import.

    A SQLite path with a percent-escape (`Workspace.default_tracking_uri` quotes `%` and `?`) is named by
    its driver too, `sqlite+pysqlite:///`, the same file to SQLAlchemy: MLflow creates the folder of a
    `sqlite:///` path from the path as written, without unquoting it, which would leave an empty sibling
    folder (`ws_q%3Fx=1` beside `ws_q?x=1`); it leaves a URI so named alone."""
    path = uri.removeprefix(_SQLITE).split("?", 1)[0]
    if uri.startswith(_SQLITE) and urllib.parse.unquote(path) != path:
        return _PYSQLITE + uri.removeprefix(_SQLITE)
    scheme, sep, rest = uri.partition("://")
    if not sep or scheme.split("+", 1)[0] not in ("postgresql", "postgres"):
        return uri
    driver = scheme.partition("+")[2] or "psycopg"
    if importlib.util.find_spec(driver) is None:
        raise TrackingUnavailable(
            f"tracking URI {redact(uri)} (--tracking-uri / $MLFLOW_TRACKING_URI): the PostgreSQL driver {driver!r} "
            "is not installed; pip install 'reslab[postgres]' (psycopg 3), or name an installed driver "
            "(postgresql+<driver>://)")
    return f"postgresql+{driver}://{rest}"


def first_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of an error's message (its type's name when it has none), at most `limit` characters."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0].strip()[:limit]


def _scrubbed(text: str, uri: str) -> str:
    """`text` without the URI's password, should a driver's message quote it."""
    password = urllib.parse.urlsplit(uri).password
    for secret in {password, urllib.parse.unquote(password or "")} - {None, ""}:
        text = text.replace(str(secret), "***")
    return text


def unusable(db: Path, exc: Exception) -> TrackingUnavailable:
    """The error for a SQLite file MLflow cannot open as its store."""
    return TrackingUnavailable(f"{db}: not a usable MLflow database ({first_line(exc)}); move it away and run "
                               "`reslab run` again: it rebuilds the store from the run directories")


def host_header(url: str) -> str:
    """The Host header an HTTP client (requests, under MLflow's client) sends for `url`: its host,
    with the port unless that is the scheme's default."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    return host if parts.port in (None, 443 if parts.scheme == "https" else 80) else f"{host}:{parts.port}"


def _without_userinfo(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def _basic_auth(url: str) -> dict[str, str]:
    """`user:password@` of a URL as the Basic Authorization header MLflow's client (requests) would
    send; urllib would instead take `user:password@host` for a host name."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None:
        return {}
    pair = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
    return {"Authorization": "Basic " + base64.b64encode(pair.encode()).decode()}


def check_server(uri: str, timeout: float = 10.0) -> None:
    """Fail in seconds, not after MLflow's minutes of HTTP retries, when a server is down or refuses
    this client. `/health` answers any Host, while MLflow's host check (`mlflow server
    --allowed-hosts`, its DNS-rebinding protection) answers 403 on the API to a Host it does not
    list; so an API endpoint is probed as well, with the Host header MLflow's client sends. A 401
    there (a server with authentication) passes: MLflow's client brings the credentials."""
    base, host, auth = _without_userinfo(uri.rstrip("/")), host_header(uri), _basic_auth(uri)
    path = "/health"
    try:
        with urllib.request.urlopen(urllib.request.Request(base + path, headers=auth), timeout=timeout):
            pass  # a status other than 2xx raises
        path = _API_PROBE
        probe = urllib.request.Request(base + path, headers=auth)
        probe.add_unredirected_header("Host", host)
        with urllib.request.urlopen(probe, timeout=timeout):
            return
    except urllib.error.HTTPError as exc:
        body = exc.read(500).decode(errors="replace")
        if exc.code == 403 and "Invalid Host header" in body:
            raise TrackingUnavailable(
                f"the MLflow tracking server at {redact(uri)} refuses the Host header this client sends (Host: {host}; "
                f"HTTP 403 on its API, while /health answers): add {host} to the server's --allowed-hosts "
                "(or $MLFLOW_SERVER_ALLOWED_HOSTS), or use a --tracking-uri host it allows") from None
        if exc.code == 401 and path == _API_PROBE:
            return
        why = f"HTTP {exc.code} on {path.split('?')[0]}"
    except (urllib.error.URLError, OSError) as exc:
        why = str(getattr(exc, "reason", exc))
    raise TrackingUnavailable(f"the MLflow tracking server at {redact(uri)} does not answer ({why}); start it, or drop "
                              "--tracking-uri / MLFLOW_TRACKING_URI to use the workspace's SQLite store")


def check_database(uri: str, timeout: float = 10.0) -> None:
    """Connect once to a database store (PostgreSQL, MySQL, ...): a wrong user or password, an unknown
    database, a server that is down or a malformed URI is a one-line error in seconds, naming the URI
    with its password redacted. MLflow itself would retry building its engine for ~100 s and then
    raise a traceback of ~190 lines."""
    import sqlalchemy
    from sqlalchemy.pool import NullPool

    scheme = uri.partition("://")[0].split("+")[0]
    connect_args = {"connect_timeout": int(timeout)} if scheme in ("postgresql", "mysql") else {}
    try:
        engine = sqlalchemy.create_engine(uri, poolclass=NullPool, connect_args=connect_args)
        try:
            with engine.connect():
                return
        finally:
            engine.dispose()
    except Exception as exc:  # sqlalchemy's, the driver's, a bad URI's: all say why in their message
        cause = getattr(exc, "orig", None) or exc
        why = _scrubbed(" ".join(str(cause).split()) or type(cause).__name__, uri)[:300]
        raise TrackingUnavailable(
            f"the tracking database {redact(uri)} cannot be used ({why}); check that it runs and the user, password "
            "and database name of --tracking-uri / $MLFLOW_TRACKING_URI") from None


def probe_store(uri: str) -> None:
    """The check a store needs before MLflow opens it: a server's probe (`check_server`), a
    database's connection (`check_database`); nothing for a SQLite file."""
    scheme = uri.partition("://")[0]
    if scheme in ("http", "https"):
        check_server(uri)
    elif scheme.split("+")[0] in ("postgresql", "mysql", "mssql"):
        check_database(uri)


def store_error(uri: str, exc: Exception) -> TrackingUnavailable:
    """One line for a store MLflow could not open (a SQLite file: `unusable`, which says how to rebuild it)."""
    db = sqlite_file(uri)
    if db is not None:
        return unusable(db, exc)
    return TrackingUnavailable(f"tracking URI {redact(uri)} (--tracking-uri / $MLFLOW_TRACKING_URI): MLflow cannot "
                               f"use it as a tracking store ({_scrubbed(first_line(exc), uri)})")


# A store that does not answer, as the failures look: MLflow's HTTP client past its retries ("Max
# retries exceeded ... too many 503 error responses", a refused connection), MLflow's database store
# (its error code TEMPORARILY_UNAVAILABLE over sqlalchemy's OperationalError), a database driver's.
_OUTAGE_TYPES = frozenset({
    "OperationalError", "InterfaceError", "DisconnectionError", "ConnectionError", "ConnectTimeout",
    "ReadTimeout", "Timeout", "RetryError", "MaxRetryError", "NewConnectionError", "ProtocolError",
    "RemoteDisconnected", "TrackingUnavailable",
})
_OUTAGE_TEXT = ("Max retries exceeded", "error responses", "TEMPORARILY_UNAVAILABLE", "Connection refused",
                "connection failed", "server closed the connection", "could not connect", "database is locked")


def is_outage(exc: BaseException) -> bool:
    """Whether `exc` (or what it wraps) says the store does not answer, rather than that the request was wrong."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, (ConnectionError, TimeoutError)) or type(cur).__name__ in _OUTAGE_TYPES:
            return True
        if getattr(cur, "error_code", None) == "TEMPORARILY_UNAVAILABLE" or any(t in str(cur) for t in _OUTAGE_TEXT):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def outage_reason(exc: BaseException) -> str:
    """What the innermost error of an outage says, in one short line ("too many 503 error responses",
    "connection failed: ... Connection refused")."""
    chain: list[BaseException] = [exc]
    while (cur := chain[-1].__cause__ or chain[-1].__context__) is not None and all(cur is not c for c in chain):
        chain.append(cur)
    texts = [first_line(c, 160).removeprefix("(psycopg.OperationalError) ") for c in chain]
    return next((t for t in reversed(texts) if len(t.strip("()[]' ")) >= 8), texts[0])
