"""`submit`: run a study's driver on a Ray cluster as a Ray job; this machine only submits and follows.

    reslab submit experiments/quickstart.yaml --cluster http://HEAD:8265 \\
        --storage s3://bucket/reslab --tracking-uri http://mlflow.internal:5000 [--set ...] [--follow]

What the job is, where its records go and how a token-auth cluster is reached: `orchestrator.driving.jobs`,
which this command calls (`submit_job`, then `wait_for` with `--wait`/`--follow`). A head whose job agent
is still starting is waited for, with a status line, for up to `--outage-timeout` (which the job's driver
is also given, when set).

After submitting it prints the job id and the commands that follow it; `--wait` waits for the
job's end and `--follow` also streams its log, and both exit with the job's outcome: 0 succeeded,
the driver's own exit code when it failed (1: a run failed, 2: a usage or backend error), 2 when
the job never started (its runtime environment failed), 130 when it was stopped. Ctrl-C stops
following, never the job.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import Any
from urllib.parse import urlsplit

from reslab.orchestrator.cli.args import parse_assignment
from reslab.orchestrator.cli.common import EXECUTION_FLAGS, STUDY_FLAGS, add_execution_args
from reslab.orchestrator.driving.jobs import (
    DEFAULT_DASHBOARD_PORT,
    JobOptions,
    SubmittedJob,
    job_exit_code,
    submit_job,
    wait_for,
)
from reslab.orchestrator.durability.storage import redact

# `reslab run` flags a submission passes on unchanged when given
PASSED_ON = ("--max-runs", "--lease-timeout", *(f.flag for f in EXECUTION_FLAGS + STUDY_FLAGS))
SWITCHES = {f.flag for f in EXECUTION_FLAGS + STUDY_FLAGS if f.kind is None}


def cluster_url(text: str) -> str:
    """`--cluster`: the Ray dashboard's URL, http(s)://HOST[:PORT] (the job API lives there)."""
    parts = urlsplit(text.strip())
    ok = parts.scheme in ("http", "https") and parts.hostname and not parts.path.strip("/") and not parts.query
    try:
        port = parts.port
    except ValueError:
        ok = False
    if not ok or parts.username:
        hint = " (ray:// is Ray Client; `reslab run --address` joins a cluster that way)" if parts.scheme == "ray" \
            else ""
        raise argparse.ArgumentTypeError(
            f"expected the Ray dashboard's URL http(s)://HOST[:PORT], e.g. http://10.0.0.5:{DEFAULT_DASHBOARD_PORT}, "
            f"got {text!r}{hint}")
    # plain http without a port: Ray's default dashboard port; https: the proxy's own
    return f"{parts.scheme}://{parts.netloc}" + (f":{DEFAULT_DASHBOARD_PORT}" if port is None and parts.scheme == "http"
                                                 else "")


def run_argv(args: argparse.Namespace) -> list[str]:
    """The `reslab run` flags passed through, as given."""
    argv = [f"--set={text}" for text in args.set]
    for flag in PASSED_ON:
        value = getattr(args, flag[2:].replace("-", "_"))
        if flag in SWITCHES and value:
            argv.append(flag)
        elif flag not in SWITCHES and value is not None:
            argv += [flag, str(value)]
    return argv


def job_options(args: argparse.Namespace) -> JobOptions:
    """The submission `args` ask for."""
    return JobOptions(spec=args.spec, cluster=args.cluster, storage=args.storage, tracking_uri=args.tracking_uri,
                      workspace=args.workspace, overrides=tuple(parse_assignment(text) for text in args.set),
                      run_argv=tuple(run_argv(args)), max_runs=args.max_runs,
                      allow_underpowered=args.allow_underpowered,
                      **({} if args.outage_timeout is None else {"outage_timeout_s": args.outage_timeout}))


def _follow_commands(args: argparse.Namespace, job: SubmittedJob) -> list[str]:
    sets = "".join(f" --set {shlex.quote(text)}" for text in args.set)
    where = (f" --storage {shlex.quote(redact(job.storage))}" if job.storage
             else f" --workspace {shlex.quote(args.workspace)}")
    token = "RAY_AUTH_MODE=token " if job.token else ""
    return [
        f"  logs:    {token}ray job logs --follow {job.job_id} --address {job.cluster}",
        f"  status:  reslab status {shlex.quote(args.spec)}{sets}{where}",
        f"  compare: reslab compare {shlex.quote(args.spec)}{sets}{where} "
        f"--tracking-uri {shlex.quote(redact(job.tracking_uri))}",
        f"  stop:    {token}ray job stop {job.job_id} --address {job.cluster}",
    ]


def cmd_submit(args: argparse.Namespace) -> int:
    from reslab.orchestrator.attempt.envinfo import short_code_version

    job = submit_job(job_options(args))
    print(f"submitted job {job.job_id} to {job.cluster}: study {job.study!r}, code {short_code_version(job.code)}, "
          f"{'storage ' + redact(job.storage) if job.storage else 'workspace ' + args.workspace}, "
          f"tracking {redact(job.tracking_uri)}")
    print("\n".join(_follow_commands(args, job)))
    if not (args.wait or args.follow):
        return 0
    try:
        info = wait_for(job.client, job.job_id, args.follow, job.cluster)
    except KeyboardInterrupt:
        print(f"reslab: stopped following; job {job.job_id} keeps running (stop it with `ray job stop {job.job_id} "
              f"--address {job.cluster}`)", file=sys.stderr)
        return 130
    code_out = job_exit_code(info)
    exited = f" (exit code {info.driver_exit_code})" if info.driver_exit_code else ""
    print(f"job {job.job_id}: {info.status}{exited}" + (f": {info.message}" if code_out and info.message else ""))
    return code_out


def _raw_assignment(text: str) -> str:
    """`--set` checked like `reslab run`'s, kept as typed (it is passed on to the job)."""
    parse_assignment(text)
    return text


def register(sub: Any) -> None:
    p = sub.add_parser("submit", help="run a study on a Ray cluster as a Ray job (the driver runs on the cluster)")
    p.add_argument("spec", metavar="SPEC", help="study YAML file; only this file is uploaded with the job")
    p.add_argument("--cluster", type=cluster_url, default=os.environ.get("RAY_API_SERVER_ADDRESS"),
                   help="the Ray dashboard's URL, http(s)://HEAD:8265 (default: $RAY_API_SERVER_ADDRESS); with "
                        "token auth set $RAY_AUTH_TOKEN_PATH or $RAY_AUTH_TOKEN")
    p.add_argument("--storage", metavar="URI",
                   help="run storage every node writes and this machine reads (default: $RESLAB_STORAGE): "
                        "s3://bucket/prefix, gs://..., or an absolute path every node mounts; required unless "
                        "--workspace is such a path")
    p.add_argument("--tracking-uri",
                   help="MLflow server or database the cluster and this machine both reach (default: "
                        "$MLFLOW_TRACKING_URI); a SQLite file is refused")
    p.add_argument("--workspace", metavar="PATH",
                   help="the driver's workspace: an absolute path every node and this machine mount (default: a "
                        "job-scoped directory on the head, with the records on --storage)")
    p.add_argument("--set", action="append", type=_raw_assignment, default=[], metavar="FIELD=VALUE",
                   help="override a config field in every run, repeatable (changes run ids)")
    add_execution_args(p, study=True, pass_through=True)
    p.add_argument("--wait", action=argparse.BooleanOptionalAction, default=False,
                   help="wait until the job ends and exit with its outcome (default: return once submitted)")
    p.add_argument("--follow", action="store_true", help="stream the job's log until it ends (implies --wait)")
    p.set_defaults(func=cmd_submit)
