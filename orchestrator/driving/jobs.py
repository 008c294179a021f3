"""Ray Jobs: a study's driver as a Ray job on a cluster (`reslab submit`); this machine only submits and
follows.

    reslab submit experiments/quickstart.yaml --cluster http://HEAD:8265 \\
        --storage s3://bucket/reslab --tracking-uri http://mlflow.internal:5000 [--set ...] [--follow]

What the job is (`job_request`):

- entrypoint: `python -m reslab.orchestrator.cli run SPEC --address auto --ship-code off
  --workspace WS [run flags]`, run by the head's Ray in the job's working directory. `python` is
  the head's (Ray's convention for job entrypoints: the interpreter on the PATH `ray start` ran
  with). `--ship-code off` because the job's own runtime_env ships the code to the driver and every
  task it starts (Ray refuses a driver runtime_env that repeats a field of the job's).
- working_dir: a staged folder holding only the spec file (paths inside it, e.g. a
  `data.corpus` directory, are the cluster's), never the user's working directory
  (with `ray job submit --working-dir .` a workspace or mlflow.db there would be uploaded, and the
  records the driver writes would land in Ray's package cache, one per content hash).
- py_modules: the `reslab` package this process imports (`ray_backend.stage_code`), so the driver
  and every task of the job import the submitter's code; each worker still checks its fingerprint.
- env_vars: `RESLAB_CODE_VERSION` (the submitter's git sha, dirty flag, diff hash and `git diff
  HEAD` text, `envinfo.submitter_code_version`: the upload has no `.git`, and the runs are tagged
  with the submitter's sha), `RESLAB_STORAGE` and `MLFLOW_TRACKING_URI`. The two URIs travel as
  environment rather than in the entrypoint, the line every job listing prints; the runtime_env is
  still visible to whoever reaches the dashboard (who can run code on the cluster anyway), so
  credentials belong in the nodes' environment (`MLFLOW_TRACKING_PASSWORD`, `PGPASSFILE`,
  `AWS_*`), not in the URIs.
- metadata: study, spec, submitter, git sha, dirty flag, diff hash, the diff (capped at
  `METADATA_DIFF_BYTES`), storage and tracking URIs without secrets.

Where the records go. The driver runs on the head, so the workspace it keeps (`WS`) is a
job-scoped directory there (`${TMPDIR:-/tmp}/reslab-jobs/<job id>`), and the run records the user
reads from this machine live on `--storage` (`$RESLAB_STORAGE`), which every node writes and this
machine reads: `reslab status SPEC --storage URI` and `reslab compare SPEC --storage URI
--tracking-uri URI` follow the job from here. `--storage` is required, unless `--workspace PATH`
names a directory every node and this machine mount at that same path (NFS): then that is the
driver's workspace and the run directories are written there directly. The tracking URI
(`--tracking-uri`, else `$MLFLOW_TRACKING_URI`) is required too and must be a server or database
the cluster and this machine both reach (an MLflow server `http(s)://`, or a database URL such as
`postgresql+psycopg://`; a server is checked from here first); a SQLite file or a local path
would live on one machine only and is refused, as is a loopback host (`localhost`, `127.0.0.1`)
in either URI when the cluster is not on this machine: on the head it would name the head.

Token authentication. A cluster started with `RAY_AUTH_MODE=token` answers the job API only
with `Authorization: Bearer <token>`; Ray's `JobSubmissionClient` adds it only when this
process runs with `RAY_AUTH_MODE=token`. `reslab submit` sends the token whenever one is named,
from Ray's own sources in Ray's order: `$RAY_AUTH_TOKEN`, else the file `$RAY_AUTH_TOKEN_PATH`,
else, with `RAY_AUTH_MODE=token`, `~/.ray/auth_token` (`auth_headers`). The token is the
cluster's (`ray get-auth-token` on the head). It travels in clear over `http://`: reach a remote
dashboard through an SSH tunnel or a TLS proxy (`https://`).

`submit_job` checks what this machine can check alone first (the spec, the power check, the tracking
URI and run storage), then reaches the cluster. A head whose job agent has not registered yet answers "No
available agent" (seconds after `ray start`, minutes on a loaded machine): that is waited out as the driver
waits out run storage (`durability.outage`), with a status line when it starts and every 30 s, for up to
`--outage-timeout` (`agent_outage`). `wait_for` follows the job and `job_exit_code` turns its
end into `reslab submit`'s exit code: 0 succeeded, the driver's own exit code when it failed (1: a run
failed, 2: a usage or backend error), 2 when the job never started (its runtime environment failed),
130 when it was stopped.
"""

from __future__ import annotations

import asyncio
import getpass
import ipaddress
import json
import os
import re
import shlex
import shutil
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from reslab.common.errors import ConfigError, ReslabError
from reslab.orchestrator.durability.outage import DEFAULT_TIMEOUT_S as DEFAULT_OUTAGE_S
from reslab.orchestrator.durability.outage import Outage
from reslab.orchestrator.durability.storage import ALLOWED, RunStorage, redact, resolve_storage

DEFAULT_DASHBOARD_PORT = 8265
METADATA_DIFF_BYTES = 16 * 1024
POLL_S = 2.0
CONNECT_TIMEOUT_S = 5.0
# MLflow stores both the cluster and this machine can reach: a tracking server or a database server
_REMOTE_TRACKING = re.compile(r"(https?|postgres|postgresql|mysql|mssql)(\+\w+)?|databricks(-uc)?")
_TRACKING_ALLOWED = ("an MLflow server http(s)://HOST:PORT or a database server URL such as "
                     "postgresql+psycopg://USER@HOST/DB, reachable from the cluster and from this machine")


class JobError(ReslabError):
    """The cluster's job API refused or could not be reached, or no token could be read (exit code 2)."""


def is_loopback(host: str | None) -> bool:
    if not host:
        return False
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_tracking_uri(uri: str | None, cluster: str) -> str:
    """The job's MLflow store: required, and one the cluster and this machine both reach."""
    if not uri:
        raise ConfigError(f"--tracking-uri: required for `reslab submit` (or $MLFLOW_TRACKING_URI): the driver runs "
                          f"on the cluster and this machine reads its results; allowed: {_TRACKING_ALLOWED}")
    scheme = urlsplit(uri).scheme if "://" in uri else ""
    if not _REMOTE_TRACKING.fullmatch(scheme.lower()):
        what = "a SQLite file" if scheme.startswith("sqlite") else "a local path" if scheme in ("", "file") \
            else f"scheme {scheme!r}"
        raise ConfigError(f"--tracking-uri {redact(uri)}: {what} lives on one machine, but the driver runs on the "
                          f"cluster and this machine reads its results; allowed: {_TRACKING_ALLOWED}")
    _check_not_loopback("--tracking-uri", uri, urlsplit(uri).hostname, cluster)
    if scheme in ("http", "https"):
        from reslab.orchestrator.tracking.store import check_server

        check_server(uri)  # this machine reads the results there too
    return uri


def _check_not_loopback(flag: str, uri: str, host: str | None, cluster: str) -> None:
    head = urlsplit(cluster).hostname
    if is_loopback(host) and not is_loopback(head):
        raise ConfigError(f"{flag} {redact(uri)}: {host} is this machine here but the head {head} on the cluster; "
                          "use an address the cluster's nodes and this machine both reach")


def check_storage(storage: str | None, workspace: str | None, cluster: str) -> str | None:
    """The job's run storage: required unless `--workspace` names a directory every node mounts; a
    local path must be absolute (it is resolved on the cluster's nodes, not here). Opened here
    (`RunStorage.at`: a missing bucket, bad credentials) because this machine reads it afterwards."""
    if workspace is not None and not Path(workspace).is_absolute():
        raise ConfigError(f"--workspace {workspace}: expected an absolute path; it is the driver's workspace on the "
                          "cluster, a directory every node and this machine mount at that same path")
    if storage is None:
        if workspace is None:
            raise ConfigError(
                "--storage: required for `reslab submit` (or $RESLAB_STORAGE): the runs' records must live where "
                "every node writes them and this machine reads them; allowed: " + ALLOWED + "; or pass "
                "--workspace PATH, a directory every node and this machine mount at that same path")
        return None
    local = "://" not in storage or storage.startswith("file://")
    if local and not Path(storage.removeprefix("file://")).is_absolute():
        raise ConfigError(f"--storage {storage}: expected an absolute path (the nodes resolve it, not this machine), "
                          f"a path every node and this machine mount; allowed: {ALLOWED}")
    query = dict(q.partition("=")[::2] for q in urlsplit(storage).query.split("&") if q)
    endpoint = query.get("endpoint_override", "")
    _check_not_loopback("--storage", storage, urlsplit(f"//{endpoint}").hostname if endpoint else None, cluster)
    RunStorage.at(storage)
    return storage


def auth_headers() -> dict[str, str]:
    """The `Authorization` header for a token-auth cluster, from Ray's sources in Ray's order (see
    the module doc); {} when none is named."""
    token = os.environ.get("RAY_AUTH_TOKEN", "").strip()
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if not token and path:
        try:
            token = Path(path).expanduser().read_text().strip()
        except OSError as exc:
            raise JobError(f"$RAY_AUTH_TOKEN_PATH {path}: cannot be read ({exc.strerror}); point it at the "
                           "cluster's token file (`ray get-auth-token` on the head prints the token)") from None
        if not token:
            raise JobError(f"$RAY_AUTH_TOKEN_PATH {path}: the file is empty; expected the cluster's token")
    if not token and os.environ.get("RAY_AUTH_MODE", "").lower() == "token":
        default = Path.home() / ".ray" / "auth_token"
        token = default.read_text().strip() if default.is_file() else ""
        if not token:
            raise JobError(f"RAY_AUTH_MODE=token but no token: set $RAY_AUTH_TOKEN or $RAY_AUTH_TOKEN_PATH, or put "
                           f"the cluster's token into {default}")
    return {"Authorization": f"Bearer {token}"} if token else {}


def submission_id(study: str) -> str:
    """`reslab-<study>-<UTC time>-<6 hex>`: unique, and readable in `ray job list`."""
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", study).strip("-")[:40] or "study"
    return f"reslab-{name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True, kw_only=True)
class JobOptions:
    """What a submission is asked for: the study file, the cluster, where the records go, and the
    `reslab run` flags the job's driver is given."""

    spec: str
    cluster: str | None  # the Ray dashboard's URL, http(s)://HOST:PORT
    storage: str | None = None  # run storage; None: $RESLAB_STORAGE, else none (then `workspace` is required)
    tracking_uri: str | None = None  # None: $MLFLOW_TRACKING_URI
    workspace: str | None = None  # the driver's workspace, a path every node mounts; None: job-scoped on the head
    overrides: tuple[tuple[str, Any], ...] = ()  # the `--set` overrides, parsed: to load the study here
    run_argv: tuple[str, ...] = ()  # the `reslab run` flags the driver gets, as typed (`--set`s included)
    max_runs: int | None = None
    allow_underpowered: bool = False
    # how long to wait for a head whose job agent is not up yet (`--outage-timeout`, also passed on to the job)
    outage_timeout_s: float = DEFAULT_OUTAGE_S


@dataclass(frozen=True)
class JobRequest:
    """What `JobSubmissionClient.submit_job` is given (with `runtime_env`'s local folders staged)."""

    submission_id: str
    entrypoint: str
    runtime_env: dict[str, Any]
    metadata: dict[str, str]


def job_request(options: JobOptions, study_name: str, staged: Path, code_dir: Path,
                storage: str | None, tracking_uri: str, code: dict[str, Any]) -> JobRequest:
    """The job for `options` (see the module doc); `staged` holds the spec file, `code_dir` the staged
    `reslab` package, `code` is `submitter_code_version()`."""
    job_id = submission_id(study_name)
    spec = Path(options.spec).name
    workspace = shlex.quote(options.workspace) if options.workspace else f'"${{TMPDIR:-/tmp}}"/reslab-jobs/{job_id}'
    entrypoint = " ".join([
        "python -m reslab.orchestrator.cli run", shlex.quote(spec), "--address auto --ship-code off",
        "--workspace", workspace,
        *map(shlex.quote, options.run_argv),
    ])
    env = {"RESLAB_CODE_VERSION": json.dumps(code, ensure_ascii=False), "MLFLOW_TRACKING_URI": tracking_uri}
    if storage is not None:
        env["RESLAB_STORAGE"] = storage
    diff = code.get("git_diff") or ""
    metadata = {
        "reslab_study": study_name, "reslab_spec": spec, "submitter": f"{getpass.getuser()}@{socket.gethostname()}",
        "git_sha": code.get("git_sha") or "", "git_dirty": json.dumps(code.get("git_dirty")),
        "git_diff_sha256": code.get("git_diff_sha256") or "",
        "git_diff": diff.encode()[:METADATA_DIFF_BYTES].decode(errors="ignore"),
        "git_diff_truncated": json.dumps(bool(code.get("git_diff_truncated")) or
                                         len(diff.encode()) > METADATA_DIFF_BYTES),
        "storage": redact(storage) if storage else "", "tracking_uri": redact(tracking_uri),
        "workspace": options.workspace or f"$TMPDIR/reslab-jobs/{job_id}",
    }
    from reslab.orchestrator.attempt.envinfo import external_sources

    # the modules of variants from outside the package go with it (issue 53), as Ray ships folders and .py files
    external = [str(path) for path in external_sources().values()]
    runtime_env = {"working_dir": str(staged), "py_modules": [str(code_dir), *external], "env_vars": env}
    return JobRequest(job_id, entrypoint, runtime_env, metadata)


def connect(cluster: str) -> Any:
    """A `JobSubmissionClient` for `cluster`, token included; a `JobError` naming --cluster when
    nothing answers there or the token is refused."""
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    parts = urlsplit(cluster)
    try:  # the client sets no timeout: an address that drops packets would hang it for minutes
        with socket.create_connection((parts.hostname, parts.port or 443), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as exc:
        why = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        raise JobError(f"--cluster {cluster}: nothing answers there ({why} within {CONNECT_TIMEOUT_S:g}s); expected "
                       f"the head's dashboard URL (port {DEFAULT_DASHBOARD_PORT} unless `ray start --dashboard-port` "
                       "said otherwise)") from None
    try:
        return JobSubmissionClient(cluster, headers=auth_headers())
    except AuthenticationError as exc:
        raise JobError(f"--cluster {cluster}: {_auth_problem(exc)}") from None
    except (ConnectionError, RuntimeError) as exc:
        raise JobError(f"--cluster {cluster}: no Ray job API answers there ({' '.join(str(exc).split())}); "
                       "expected the head's dashboard URL (the head needs ray[default] and `ray start "
                       "--include-dashboard=true`)") from None


def _auth_problem(exc: Exception) -> str:
    refused = "Forbidden" in str(exc) or "invalid" in str(exc).lower()
    what = "the cluster refused the token" if refused else "the cluster uses token authentication and no token was sent"
    return (f"{what}; set $RAY_AUTH_TOKEN_PATH (or $RAY_AUTH_TOKEN) to the cluster's token (`ray get-auth-token` "
            "on the head prints it)")


def agent_outage(cluster: str, timeout_s: float, say: Callable[[str], Any]) -> Outage:
    """Waiting for the head's job agent, as the driver waits out run storage (`durability.outage`): a status
    line when the wait starts and every `outage.SAY_EVERY_S`, and past `timeout_s` (`--outage-timeout`) one
    line saying nothing was submitted."""
    def give_up(line: str) -> JobError:
        return JobError(f"{line}: stopped; nothing was submitted. `ray status` on the head says whether it is "
                        "up; submit again once it is, or with a larger --outage-timeout")

    return Outage(f"the job agent of the Ray head at --cluster {cluster}", timeout_s, say, give_up,
                  "the head has not started it yet")


def _submit(client: Any, cluster: str, request: JobRequest, timeout_s: float = DEFAULT_OUTAGE_S,
            say: Callable[[str], Any] = print) -> str:
    """Submit; a head whose job agent has not registered yet (the first seconds after `ray start`, minutes on
    a loaded machine) answers "No available agent" and is asked again (`agent_outage`) for up to `timeout_s`."""
    from ray.exceptions import AuthenticationError

    outage = agent_outage(cluster, timeout_s, say)
    while True:
        try:
            job_id = client.submit_job(entrypoint=request.entrypoint, submission_id=request.submission_id,
                                       runtime_env=request.runtime_env, metadata=request.metadata)
        except AuthenticationError as exc:
            raise JobError(f"--cluster {cluster}: {_auth_problem(exc)}") from None
        except (ConnectionError, RuntimeError) as exc:
            why = " ".join(str(exc).split())
            if "No available agent" not in why:
                raise JobError(f"--cluster {cluster}: the job was not accepted ({why})") from None
            outage.failed(why[why.index("No available agent"):])  # past the timeout: its one-line JobError
            time.sleep(max(0.0, outage.next_try - time.time()))
            continue
        outage.ok()
        return str(job_id)


@dataclass(frozen=True)
class SubmittedJob:
    """A job the cluster accepted, what it was given, and the client that follows it."""

    job_id: str
    cluster: str
    study: str
    code: dict[str, Any]  # `submitter_code_version()`
    storage: str | None
    tracking_uri: str
    token: bool  # the cluster was sent a token: `ray job` commands against it need RAY_AUTH_MODE=token
    client: Any = field(repr=False)  # the `JobSubmissionClient`


def submit_job(options: JobOptions, say: Callable[[str], Any] = print) -> SubmittedJob:
    """Submit the study's driver as a Ray job (see the module doc). What this machine can check alone
    comes first (--cluster given, the spec, the power check), then what needs the network (the tracking
    server, run storage, the cluster); a head whose job agent is still starting is waited for, with `say`'s
    status lines (`agent_outage`)."""
    from reslab.experiments import load_study
    from reslab.orchestrator.attempt.envinfo import submitter_code_version
    from reslab.orchestrator.dispatch.ray_backend import stage_code
    from reslab.orchestrator.driving.submit import check_power

    if not options.cluster:
        raise ConfigError("--cluster: required (or $RAY_API_SERVER_ADDRESS): the Ray dashboard's URL, e.g. "
                          f"http://10.0.0.5:{DEFAULT_DASHBOARD_PORT}")
    cluster = options.cluster
    study = load_study(options.spec, list(options.overrides), options.max_runs)
    check_power(study, options.allow_underpowered)
    tracking_uri = check_tracking_uri(options.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"), cluster)
    storage = check_storage(resolve_storage(options.storage), options.workspace, cluster)
    code = submitter_code_version()
    client = connect(cluster)
    with tempfile.TemporaryDirectory(prefix="reslab-submit-") as tmp:
        staged = Path(tmp) / "job"
        staged.mkdir()
        shutil.copyfile(options.spec, staged / Path(options.spec).name)
        request = job_request(options, study.name, staged, stage_code(Path(tmp) / "code"), storage, tracking_uri,
                              code)
        job_id = _submit(client, cluster, request, options.outage_timeout_s, say)
    return SubmittedJob(job_id, cluster, study.name, code, storage, tracking_uri, bool(auth_headers()), client)


def job_exit_code(info: Any) -> int:
    """0 succeeded; 130 stopped; failed: the driver's exit code, or 2 when the driver never ran
    (its runtime environment could not be set up)."""
    status = str(info.status)
    if status == "SUCCEEDED":
        return 0
    if status == "STOPPED":
        return 130
    if info.driver_exit_code is None:
        return 2
    return info.driver_exit_code or 1


def wait_for(client: Any, job_id: str, follow: bool, cluster: str) -> Any:
    """Wait for the job's end (streaming its log to stdout with `follow`); its final `JobDetails`.
    A log stream that breaks falls back to polling; a cluster that stops answering is a `JobError`
    (the job may still be running there)."""
    if follow:
        async def tail() -> None:
            async for chunk in client.tail_job_logs(job_id):
                sys.stdout.write(chunk)
                sys.stdout.flush()

        try:
            asyncio.run(tail())
        except (RuntimeError, OSError) as exc:  # aiohttp's errors are OSErrors
            print(f"reslab: the log stream of job {job_id} broke ({exc}); waiting for its end", file=sys.stderr)
    while True:
        try:
            info = client.get_job_info(job_id)
        except (ConnectionError, RuntimeError, OSError) as exc:
            raise JobError(f"--cluster {cluster}: stopped answering while job {job_id} ran "
                           f"({' '.join(str(exc).split())}); it may still be running there") from None
        if str(info.status) in ("SUCCEEDED", "FAILED", "STOPPED"):
            return info
        time.sleep(POLL_S)


__all__ = ["DEFAULT_DASHBOARD_PORT", "JobError", "JobOptions", "JobRequest", "SubmittedJob", "agent_outage",
           "auth_headers", "check_storage", "check_tracking_uri", "connect", "job_exit_code", "job_request",
           "submission_id", "submit_job", "wait_for"]
