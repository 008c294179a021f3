"""Tracking outages, against a real PostgreSQL (the image's `initdb`/`pg_ctl`, as in test_postgres.py).

PostgreSQL is stopped mid-study for longer than MLflow's client retries, behind an `mlflow server`
and as a direct `postgresql+psycopg://` store: the study finishes, the driver says the outage in a
status line, and MLflow ends with one FINISHED child per run, its parent closed and every metric
step of every run directory's metrics.jsonl once, counted in SQL. And one line (exit 2, no password)
for every store that cannot be used at start: a wrong password, an unknown database, a server that
is down, a corrupt mlflow.db, in `run`, `compare` and `dashboard`.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import secrets
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from orch_helpers import free_port, write_study
from test_postgres import Postgres, mlflow_server, postgres_cluster

from reslab.experiments import expand, load_study
from reslab.orchestrator.cli import main
from reslab.orchestrator.dispatch.local_backend import LocalBackend
from reslab.orchestrator.driving.submit import submit
from reslab.orchestrator.durability.workspace import Workspace
from reslab.orchestrator.tasks import RunState
from reslab.orchestrator.tracking.guarded import GuardedTracker
from reslab.orchestrator.tracking.store import TrackingUnavailable

OUTAGE_S = 6.0  # longer than MLflow's HTTP retries as reslab bounds them (store.HTTP_RETRIES: ~2-3 s)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Postgres]:
    """test_postgres.py's cluster, for this module: the tests stop and start it."""
    with postgres_cluster() as pg:
        yield pg


@contextlib.contextmanager
def outage_mid_training(pg: Postgres, ws: Workspace, study: str, at_rows: int = 4) -> Iterator[dict[str, float]]:
    """Stop PostgreSQL once a run directory's metrics.jsonl has `at_rows` rows (training is under
    way, the driver has written the runs before it), start it again `OUTAGE_S` later."""
    times: dict[str, float] = {}
    stop = threading.Event()

    def watch() -> None:
        runs = ws.study_dir(study)
        while not stop.is_set():
            files = list(runs.glob("*/metrics.jsonl")) if runs.is_dir() else []
            if any(len(f.read_text().splitlines()) >= at_rows for f in files):
                break
            time.sleep(0.02)
        else:
            return
        pg.stop()
        times["stopped"] = time.time()
        stop.wait(OUTAGE_S)
        pg.start()
        times["started"] = time.time()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield times
    finally:
        stop.set()
        thread.join(120)


def assert_mirrored_exactly(pg: Postgres, ws: Workspace, study: str, runs: list) -> None:
    """One FINISHED child per run under one FINISHED parent, and each metric of each row of each
    run directory's metrics.jsonl exactly once, counted in SQL."""
    with pg.connect() as con:
        (experiment_id,) = con.execute("SELECT experiment_id FROM experiments WHERE name = %s", (study,)).fetchone()
        rows = con.execute(
            "SELECT r.run_uuid, r.status, r.lifecycle_stage, kind.value, rid.value FROM runs r "
            "JOIN tags kind ON kind.run_uuid = r.run_uuid AND kind.key = 'reslab_kind' "
            "LEFT JOIN tags rid ON rid.run_uuid = r.run_uuid AND rid.key = 'run_id' "
            "WHERE r.experiment_id = %s", (experiment_id,)).fetchall()
        metrics = con.execute("SELECT m.run_uuid, m.key, m.step FROM metrics m JOIN runs r ON r.run_uuid = m.run_uuid "
                              "WHERE r.experiment_id = %s", (experiment_id,)).fetchall()
        params = dict(con.execute("SELECT run_uuid, count(*) FROM params GROUP BY run_uuid").fetchall())
    parents = [r for r in rows if r[3] == "submission"]
    children = [r for r in rows if r[3] == "run"]
    assert [(p[1], p[2]) for p in parents] == [("FINISHED", "active")], parents
    assert sorted(c[4] for c in children) == sorted(r.run_id for r in runs), children
    assert {(c[1], c[2]) for c in children} == {("FINISHED", "active")}, children
    by_run = {c[4]: c[0] for c in children}
    expected: collections.Counter = collections.Counter()
    for run in runs:
        assert params[by_run[run.run_id]] > 20
        for row in ws.run_dir(study, run.run_id).metrics():
            for key, value in row.items():
                number = isinstance(value, int | float) and not isinstance(value, bool)
                if key not in ("kind", "step", "time") and number:
                    expected[(by_run[run.run_id], key, row["step"])] += 1
    got = collections.Counter(m for m in metrics if m[0] in by_run.values())
    assert got == expected, (sorted((got - expected).items())[:5], sorted((expected - got).items())[:5])


def run_through_outage(tmp_path: Path, pg: Postgres, uri: str, name: str) -> list[str]:
    study = load_study(write_study(tmp_path, name=name, steps=12))
    runs = expand(study)
    ws = Workspace(tmp_path / "ws")
    ws.root.mkdir()
    said: list[str] = []
    tracker = GuardedTracker(uri, ws, say=said.append)
    with outage_mid_training(pg, ws, name) as times:
        result = submit(study, runs, ws, LocalBackend(), tracker, stream=io.StringIO(), say=said.append)
    assert "stopped" in times and "started" in times, "the outage did not land mid-study"
    assert result.ok and result.count("succeeded") == len(runs), result.summary()
    assert any("unreachable for" in line and "runs continue; metrics queued" in line for line in said), said
    assert any("answers again after" in line for line in said), said
    assert_mirrored_exactly(pg, ws, name, runs)
    return said


@pytest.mark.slow
def test_postgresql_stopped_behind_an_mlflow_server_mid_study(tmp_path, cluster):
    """(The outage the issue saw: the driver stalled 5.5 min, then died with `too many 503 error
    responses`, a finished run KILLED in MLflow with no metrics.)"""
    with mlflow_server(cluster.uri(password=False), "127.0.0.1:{port}", tmp_path,
                       env={"PGPASSWORD": cluster.password}) as url:
        t0 = time.monotonic()
        said = run_through_outage(tmp_path, cluster, url, "outage_server")
        print(f"study through a {OUTAGE_S:g} s outage: {time.monotonic() - t0:.1f} s; {said}")


@pytest.mark.slow
def test_postgresql_stopped_under_a_direct_store_mid_study(tmp_path, cluster):
    """(The issue saw a 1,026-line traceback, and the run, its child and the parent left RUNNING.)"""
    t0 = time.monotonic()
    said = run_through_outage(tmp_path, cluster, cluster.uri(), "outage_direct")
    print(f"study through a {OUTAGE_S:g} s outage: {time.monotonic() - t0:.1f} s; {said}")


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[Path, Workspace]:
    """A tiny study trained to the end without tracking: `reslab run` of it has nothing to run, so it
    opens the tracking store (and fails there) without starting Ray."""
    root = tmp_path_factory.mktemp("finished")
    spec = write_study(root, name="tiny_done")
    ws = Workspace(root / "ws")
    ws.root.mkdir()
    study = load_study(spec)
    result = submit(study, expand(study), ws, LocalBackend(), None, stream=io.StringIO(), say=lambda *_: None)
    assert result.ok
    return spec, ws


def one_line(capsys, argv: list[str], secret: str | None = None) -> str:
    """`reslab ARGV`: exit 2 and one line on stderr, which it returns; `secret` printed nowhere."""
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, (rc, out, err)
    assert len(err.strip().splitlines()) == 1 and err.startswith("reslab: error: "), err
    assert "Traceback" not in out + err
    if secret:
        assert secret not in out + err, out + err
    return err


@pytest.mark.slow
@pytest.mark.parametrize("case", ["wrong password", "unknown database", "database down", "server down"])
def test_a_store_that_cannot_be_used_at_start_is_one_line_in_every_command(case, cluster, finished, capsys):
    """(The issue saw a 190-line traceback for each, after MLflow's ~100 s of engine retries.)"""
    spec, ws = finished
    wrong = "wrong-" + secrets.token_hex(6)
    uri, why = {
        "wrong password": (f"postgresql://{cluster.user}:{wrong}@127.0.0.1:{cluster.port}/{cluster.dbname}",
                           f'password authentication failed for user "{cluster.user}"'),
        "unknown database": (cluster.uri(scheme="postgresql").rsplit("/", 1)[0] + "/nosuchdb",
                             'database "nosuchdb" does not exist'),
        "database down": (f"postgresql://{cluster.user}:{cluster.password}@127.0.0.1:{free_port()}/mlflow",
                          "Connection refused"),
        "server down": (f"http://reslab:{wrong}@127.0.0.1:{free_port()}", "does not answer"),
    }[case]
    t0 = time.monotonic()
    commands = [["run", str(spec)], ["compare", str(spec)]]
    if case != "server down":  # the dashboard starts no server for an http:// store: it names it, exit 0
        commands.append(["dashboard", "--port", str(free_port())])
    for command in commands:
        err = one_line(capsys, [*command, "--workspace", str(ws.root), "--tracking-uri", uri], secret=wrong)
        assert why in err and cluster.password not in err, err
        assert ":***@127.0.0.1:" in err, err  # the URI is named, its password redacted
    assert time.monotonic() - t0 < 30  # seconds, not MLflow's minutes of retries


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["random bytes", "truncated"])
def test_a_corrupt_mlflow_db_is_one_line_for_run_and_dashboard(damage, finished, tmp_path, capsys, mlflow_db_template):
    """(`compare` and `report` already said so in one line; `run` and `dashboard` printed a 75-line traceback.)"""
    spec, done = finished
    ws = Workspace(tmp_path / "ws")
    shutil.copytree(done.root, ws.root)
    good = mlflow_db_template.read_bytes()
    ws.mlflow_db.write_bytes(os.urandom(200_000) if damage == "random bytes" else good[: len(good) // 3])
    for command in (["run", str(spec)], ["dashboard", "--port", str(free_port())]):
        err = one_line(capsys, [*command, "--workspace", str(ws.root)])
        assert str(ws.mlflow_db) in err and "not a usable MLflow database" in err and "move it away" in err, err


@pytest.mark.slow
def test_a_run_in_flight_is_caught_up_and_an_outage_past_the_timeout_is_one_line(tmp_path, cluster):
    """What a driver with runs in flight (Ray) sees: tracking goes down while a run trains and answers
    again before it ends; the probe catches the child up from the run directory (the steps MLflow
    missed, RUNNING), later live events are logged once. Then an outage past the timeout ends the
    driver with one line that says nothing is lost."""
    name = "outage_inflight"
    run = expand(load_study(write_study(tmp_path, name=name)))[0]
    ws = Workspace(tmp_path / "ws")
    rd = ws.run_dir(name, run.run_id)
    rd.path.mkdir(parents=True)
    said: list[str] = []
    tracker = GuardedTracker(cluster.uri(), ws, say=said.append)
    tracker.begin(name, submission="s1", code={}, plan={})

    def train(*steps: int, late: bool = False) -> None:
        """What a worker appends to its run directory, and its events to the driver (`late`: the
        events alone, delivered again, as by a restarted progress actor)."""
        for step in steps:
            row = {"kind": "train", "step": step, "time": time.time(), "train_loss": 1.0 / step, "lr": 0.1}
            if not late:
                with rd.metrics_file.open("a") as f:
                    f.write(json.dumps(row) + "\n")
            tracker.on_event(run, {"type": "train", "step": step, "time": row["time"],
                                   "metrics": {"train_loss": row["train_loss"], "lr": 0.1}})
        tracker.flush()

    tracker.on_event(run, {"type": "start", "attempt": 1, "start_step": 0})
    train(1, 2, 3)
    cluster.stop()
    try:
        train(4, 5, 6)
        assert tracker.outage.down and any("unreachable for" in line for line in said), said
    finally:
        cluster.start()
    time.sleep(max(0.0, tracker.outage.next_try - time.time()) + 0.05)  # the first probe is due (1 s after)
    tracker.flush()
    assert not tracker.outage.down and any("caught up 1 run(s)" in line for line in said), said
    with cluster.connect() as con:
        status, steps = con.execute(
            "SELECT r.status, array_agg(m.step ORDER BY m.step) FROM runs r JOIN metrics m ON m.run_uuid = r.run_uuid "
            "JOIN tags t ON t.run_uuid = r.run_uuid AND t.key = 'run_id' AND t.value = %s "
            "WHERE m.key = 'train_loss' GROUP BY r.status", (run.run_id,)).fetchone()
    assert (status, steps) == ("RUNNING", [1, 2, 3, 4, 5, 6])
    train(5, 6, late=True)  # events for steps already caught up
    train(7, 8)
    tracker.finish(run, {"val_loss": 1.0}, metrics=rd.metrics())
    tracker.end(RunState.SUCCESS, {"planned": 1, "succeeded": 1})
    assert_mirrored_exactly(cluster, ws, name, [run])

    quick = GuardedTracker(cluster.uri(), ws, say=said.append, outage_timeout_s=1.0)
    quick.begin(name, submission="s2", code={}, plan={})
    cluster.stop()
    try:
        quick.on_event(run, {"type": "start", "attempt": 1, "start_step": 0})
        time.sleep(1.2)
        with pytest.raises(TrackingUnavailable) as exc:
            quick.end(RunState.SUCCESS, {"planned": 1})
    finally:
        cluster.start()
    msg = str(exc.value)
    assert "\n" not in msg and "unreachable for" in msg and "gave up" in msg and "next `reslab run`" in msg, msg
    assert cluster.password not in msg
