"""MLflow on PostgreSQL: a real PostgreSQL (the image's `initdb` and `pg_ctl`, run as an
unprivileged user), an `mlflow server` on it and a `reslab run` against that server, whose runs,
params and metric rows are then counted in SQL; and the one-line error for a server whose
`--allowed-hosts` leaves out the Host header the client sends."""

from __future__ import annotations

import collections
import contextlib
import glob
import http.server
import io
import json
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from orch_helpers import free_port, write_study

from reslab.experiments import expand, load_study
from reslab.orchestrator.cli import main
from reslab.orchestrator.dispatch.local_backend import LocalBackend
from reslab.orchestrator.driving.submit import submit
from reslab.orchestrator.durability import reaper
from reslab.orchestrator.durability.storage import redact
from reslab.orchestrator.durability.workspace import Workspace
from reslab.orchestrator.tracking.dashboard import start_dashboard
from reslab.orchestrator.tracking.guarded import GuardedTracker
from reslab.orchestrator.tracking.readers import fetch_study_runs
from reslab.orchestrator.tracking.store import TrackingUnavailable, check_server, host_header, store_uri

MLFLOW = Path(sys.executable).with_name("mlflow")


def pg_bin() -> Path | None:
    """The folder of `initdb`, `pg_ctl` and `postgres`: PATH (a symlink there is followed), else
    Debian's /usr/lib/postgresql/<version>/bin of the newest version."""
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    return Path(versions[-1]).parent if versions else None


@dataclass
class Postgres:
    port: int
    user: str = "reslab"
    password: str = ""
    dbname: str = "mlflow"
    ctl: list[str] = field(default_factory=list)  # pg_ctl -D <data>, run as the cluster's user
    start_args: list[str] = field(default_factory=list)

    def uri(self, scheme: str = "postgresql+psycopg", password: bool = True) -> str:
        auth = f"{self.user}:{self.password}" if password else self.user
        return f"{scheme}://{auth}@127.0.0.1:{self.port}/{self.dbname}"

    def connect(self):
        import psycopg

        return psycopg.connect(host="127.0.0.1", port=self.port, user=self.user, password=self.password,
                               dbname=self.dbname, autocommit=True)

    def start(self) -> None:
        subprocess.run([*self.ctl, *self.start_args, "-w", "-t", "60", "start"], check=True, capture_output=True,
                       timeout=90)

    def stop(self) -> None:
        subprocess.run([*self.ctl, "-m", "fast", "-w", "stop"], check=True, capture_output=True, timeout=60)


@contextlib.contextmanager
def postgres_cluster() -> Iterator[Postgres]:
    """A PostgreSQL cluster in a temp dir on 127.0.0.1 and a unix socket there, with a role and a
    database for MLflow; `stop` and `start` take it down and up again. initdb refuses root: as root,
    the binaries run as `postgres` (Debian's package creates it) or else `nobody`, owning the temp dir."""
    bindir = pg_bin()
    if bindir is None:
        pytest.skip("no PostgreSQL binaries (initdb) on PATH or under /usr/lib/postgresql/*/bin; "
                    "`apt-get install postgresql` (.ci/run does)")
    prefix: list[str] = []
    root = Path(tempfile.mkdtemp(prefix="reslab-pg-"))  # not under pytest's 0700 tmp_path: the user must reach it
    if os.geteuid() == 0:
        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            user = pwd.getpwnam("nobody")
        os.chown(root, user.pw_uid, user.pw_gid)
        prefix = ["runuser", "-u", user.pw_name, "--"]
    data, log = root / "data", root / "postgres.log"
    port = free_port()
    options = f"-c listen_addresses=127.0.0.1 -c port={port} -c unix_socket_directories={root} -c fsync=off"
    pg = Postgres(port=port, password=secrets.token_hex(8), ctl=[*prefix, str(bindir / "pg_ctl"), "-D", str(data)],
                  start_args=["-l", str(log), "-o", options])
    watcher = None
    try:
        subprocess.run([*prefix, str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "-E", "UTF8", "--no-sync",
                        "--auth-local=trust", "--auth-host=scram-sha-256"], check=True, capture_output=True,
                       timeout=120)
        pg.start()
        watcher = reaper.watch([int((data / "postmaster.pid").read_text().split()[0])])
        import psycopg

        # the superuser over the unix socket (trust); the role MLflow uses logs in with a password over TCP
        with psycopg.connect(host=str(root), port=pg.port, user="postgres", dbname="postgres",
                             autocommit=True) as con:
            con.execute(f"CREATE ROLE {pg.user} LOGIN PASSWORD '{pg.password}'")
            con.execute(f"CREATE DATABASE {pg.dbname} OWNER {pg.user}")
        yield pg
    except subprocess.CalledProcessError as exc:
        raise AssertionError(f"{exc.cmd}: {exc.stderr.decode()}\n{log.read_text() if log.exists() else ''}") from None
    finally:
        if (data / "postmaster.pid").exists():
            subprocess.run([*pg.ctl, "-m", "fast", "-w", "stop"], capture_output=True, timeout=60)
        if watcher is not None:
            watcher.terminate()
            watcher.wait()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def postgres() -> Iterator[Postgres]:
    with postgres_cluster() as pg:
        yield pg


@contextlib.contextmanager
def mlflow_server(backend: str, allowed_hosts: str, tmp: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    """`mlflow server` on 127.0.0.1 with its host check set to `allowed_hosts`; yields its URL once
    /health answers, and stops its process group after."""
    port = free_port()
    cmd = [str(MLFLOW), "server", "--backend-store-uri", backend, "--allowed-hosts", allowed_hosts.format(port=port),
           "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
           "--artifacts-destination", (tmp / "artifacts").as_uri()]
    log = tmp / f"mlflow-{port}.log"
    server_env = {**os.environ, **(env or {}), "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
                  "MLFLOW_DISABLE_TELEMETRY": "true"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=server_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while True:
            assert proc.poll() is None, f"mlflow server exited:\n{log.read_text()}"
            assert time.time() < deadline, f"mlflow server did not answer:\n{log.read_text()}"
            with contextlib.suppress(urllib.error.URLError, OSError), \
                    urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    break
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_store_uri_pins_psycopg3_for_a_bare_postgresql_uri():
    assert store_uri("postgresql://u:p@db:5432/mlflow") == "postgresql+psycopg://u:p@db:5432/mlflow"
    assert store_uri("postgres://u@db/mlflow") == "postgresql+psycopg://u@db/mlflow"  # Heroku's spelling
    assert store_uri("postgresql+psycopg://u@db/mlflow") == "postgresql+psycopg://u@db/mlflow"
    for kept in ("sqlite:////tmp/mlflow.db", "http://mlflow:5000", "mysql+pymysql://u@db/m"):
        assert store_uri(kept) == kept


def test_a_missing_postgres_driver_is_one_line_naming_the_extra_and_hiding_the_password():
    with pytest.raises(TrackingUnavailable) as exc:
        store_uri("postgresql+nosuchdriver://reslab:s3cret@db:5432/mlflow")
    msg = str(exc.value)
    assert "'nosuchdriver' is not installed" in msg and "reslab[postgres]" in msg and "\n" not in msg
    assert "s3cret" not in msg and "reslab:***@db:5432" in msg
    assert redact("http://mlflow:5000") == "http://mlflow:5000"


@pytest.mark.parametrize(("url", "host"), [
    ("http://mlflow:5000", "mlflow:5000"),
    ("http://mlflow:80/", "mlflow"),  # the scheme's default port is not sent (requests, http.client)
    ("https://mlflow.example.org", "mlflow.example.org"),
    ("http://[::1]:5000", "[::1]:5000"),
])
def test_host_header_is_the_one_an_http_client_sends(url, host):
    assert host_header(url) == host


def test_a_dead_tracking_server_fails_in_seconds():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(TrackingUnavailable, match=rf"^the MLflow tracking server at {url} does not answer \("):
        check_server(url)
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize(("api_status", "error"), [
    (401, None),  # a server with authentication: MLflow's client brings the credentials, the probe has none
    (404, r"does not answer \(HTTP 404 on /api/2\.0/mlflow/experiments/search\)"),  # not an MLflow server
])
def test_the_api_probe_reads_other_statuses(api_status, error):
    """A stand-in HTTP server, not MLflow: what is under test is how `check_server` reads a status
    (an MLflow server with authentication needs the auth app, its own database and users)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else api_status)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        if error is None:
            check_server(url)
        else:
            with pytest.raises(TrackingUnavailable, match=error):
                check_server(url)
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.slow
def test_a_server_whose_allowed_hosts_exclude_the_client_fails_run_before_dispatch(tmp_path, capsys,
                                                                                   mlflow_db_template):
    """/health answers any Host; the API answers 403. `reslab run` names the Host it sent and the
    server's --allowed-hosts, exits 2, and starts no run."""
    db = tmp_path / "server.db"
    shutil.copy(mlflow_db_template, db)
    spec = write_study(tmp_path)
    ws = Workspace(tmp_path / "ws")
    with mlflow_server(f"sqlite:///{db}", "localhost:{port}", tmp_path) as url:
        with urllib.request.urlopen(f"{url}/health", timeout=10) as resp:
            assert resp.status == 200
        rc = main(["run", str(spec), "--workspace", str(ws.root), "--tracking-uri", url])
    err = capsys.readouterr().err.strip()
    host = url.removeprefix("http://")
    assert rc == 2, err
    assert len(err.splitlines()) == 1, err
    assert f"(Host: {host};" in err and "--allowed-hosts" in err and "HTTP 403" in err
    assert not (ws.root / "runs").exists() or not any((ws.root / "runs").rglob("status.json"))


@pytest.mark.slow
def test_a_study_against_mlflow_on_postgresql_counted_in_sql(tmp_path, postgres):
    spec = write_study(tmp_path, name="tiny_pg")
    runs = expand(load_study(spec))
    ws = Workspace(tmp_path / "ws")
    # the server's password comes from libpq's environment, never its command line
    with mlflow_server(postgres.uri(password=False), "127.0.0.1:{port},localhost:{port}", tmp_path,
                       env={"PGPASSWORD": postgres.password}) as url:
        env = dict(os.environ)
        env.pop("RAY_ADDRESS", None)
        env.pop("MLFLOW_TRACKING_URI", None)
        out = subprocess.run([sys.executable, "-m", "reslab.orchestrator.cli", "run", str(spec), "--workspace",
                              str(ws.root), "--tracking-uri", url], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr

    with postgres.connect() as con:
        (experiment_id,) = con.execute("SELECT experiment_id FROM experiments WHERE name = %s",
                                       ("tiny_pg",)).fetchone()
        rows = con.execute(
            "SELECT r.run_uuid, r.status, r.lifecycle_stage, kind.value, rid.value, parent.value FROM runs r "
            "JOIN tags kind ON kind.run_uuid = r.run_uuid AND kind.key = 'reslab_kind' "
            "LEFT JOIN tags rid ON rid.run_uuid = r.run_uuid AND rid.key = 'run_id' "
            "LEFT JOIN tags parent ON parent.run_uuid = r.run_uuid AND parent.key = 'mlflow.parentRunId' "
            "WHERE r.experiment_id = %s", (experiment_id,)).fetchall()
        params = dict(con.execute("SELECT run_uuid, count(*) FROM params GROUP BY run_uuid").fetchall())
        d_model = dict(con.execute("SELECT run_uuid, value FROM params WHERE key = 'model.d_model'").fetchall())
        metrics = con.execute("SELECT run_uuid, key, step FROM metrics").fetchall()
        summaries = con.execute("SELECT run_uuid, key FROM tags WHERE key LIKE 'summary/%'").fetchall()

    parents = [r for r in rows if r[3] == "submission"]
    children = {r[4]: r for r in rows if r[3] == "run"}
    child_uuids = {r[0] for r in children.values()}
    metric_rows = collections.Counter(m for m in metrics if m[0] in child_uuids)  # the parent's runs_* counts aside
    summary_keys: dict[str, set[str]] = collections.defaultdict(set)
    for run_uuid, key in summaries:
        summary_keys[run_uuid].add(key)  # the summary is tags (orchestrator.tracking.writer.MlflowWriter.finish)
    assert len(parents) == 1 and parents[0][1] == "FINISHED"
    assert len(children) == len(runs) == 4 and len([r for r in rows if r[3] == "run"]) == len(runs)
    assert sorted(children) == sorted(r.run_id for r in runs)
    for run_uuid, status, stage, _, _, parent in children.values():
        assert (status, stage, parent) == ("FINISHED", "active", parents[0][0])
        assert params[run_uuid] > 20 and d_model[run_uuid] == "32"  # the study's d_model: 32

    # every train and eval row of every run directory's metrics.jsonl is one metric row per number in it
    expected = collections.Counter()
    for run in runs:
        run_uuid = children[run.run_id][0]
        lines = (ws.run_dir(run.study, run.run_id).path / "metrics.jsonl").read_text().splitlines()
        evals = [json.loads(line) for line in lines if json.loads(line)["kind"] == "eval"]
        assert [e["step"] for e in evals] == [3, 6]
        for row in map(json.loads, lines):
            for key, value in row.items():
                if key not in ("kind", "step", "time") and isinstance(value, (int, float)) \
                        and not isinstance(value, bool):
                    expected[(run_uuid, key, row["step"])] += 1
        assert "summary/val_loss" in summary_keys[run_uuid]
    assert metric_rows == expected
    print(f"postgres counts: runs {len(rows)} (1 parent + {len(children)} children), params per child "
          f"{sorted(params[c[0]] for c in children.values())}, metric rows {sum(metric_rows.values())} "
          f"(+ {sum(len(v) for v in summary_keys.values())} summary tags)")


@pytest.mark.slow
def test_a_bare_postgresql_uri_is_a_direct_store_with_the_workspace_artifacts(tmp_path, postgres, monkeypatch):
    """`--tracking-uri postgresql://...` (no driver named, the password in the URI) without a server:
    the driver writes the database itself, and the artifacts go to the workspace, not ./mlruns."""
    monkeypatch.chdir(tmp_path)
    study = load_study(write_study(tmp_path, name="tiny_direct"))
    runs = expand(study)
    ws = Workspace(tmp_path / "ws")
    ws.root.mkdir()
    uri = postgres.uri(scheme="postgresql")
    result = submit(study, runs, ws, LocalBackend(), GuardedTracker(uri, ws), stream=io.StringIO(),
                    say=lambda *_: None)
    assert result.ok
    found = fetch_study_runs(uri, "tiny_direct")
    assert sorted(r["tags"]["run_id"] for r in found) == sorted(r.run_id for r in runs)
    assert {r["status"] for r in found} == {"FINISHED"}
    with postgres.connect() as con:
        (location,) = con.execute("SELECT artifact_location FROM experiments WHERE name = 'tiny_direct'").fetchone()
    assert location == (ws.artifacts / "tiny_direct").as_uri()
    assert len(list((ws.artifacts / "tiny_direct").rglob("config.json"))) == len(runs)
    assert not (tmp_path / "mlruns").exists()


@pytest.mark.slow
def test_the_dashboard_on_postgresql_keeps_the_password_off_the_command_line(tmp_path, postgres):
    """`reslab dashboard --tracking-uri postgresql://user:pw@...`: the server gets the password through libpq's
    PGPASSWORD, so `ps` (any user's /proc/PID/cmdline) never shows it, and the UI still reads the store."""
    ws = Workspace(tmp_path / "ws")
    dash = start_dashboard(ws, port=free_port(), tracking_uri=postgres.uri(scheme="postgresql"))
    try:
        cmdline = Path(f"/proc/{dash.process.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        assert "--backend-store-uri" in cmdline and postgres.password not in cmdline, cmdline
        with urllib.request.urlopen(f"{dash.url}/api/2.0/mlflow/experiments/search?max_results=100",
                                    timeout=30) as resp:
            assert resp.status == 200
    finally:
        dash.stop()
