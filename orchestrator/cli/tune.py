"""Searches: `tune` (`plan` and `run --from-tune` read its result; their flags are in `common.py`)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from reslab.orchestrator.cli.args import (
    GPUS_PER_RUN_HELP,
    add_ranks_args,
    add_study_args,
    interrupt_on_sigterm,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from reslab.orchestrator.cli.common import add_cluster_args, add_tune_storage_arg
from reslab.orchestrator.storage import redact
from reslab.orchestrator.workspace import Workspace


def cmd_tune(args: argparse.Namespace) -> int:
    from reslab.common.errors import ConfigError
    from reslab.experiments import load_study
    from reslab.orchestrator.dispatch.ray_backend import RayBackend
    from reslab.orchestrator.loop import SubmitOptions, preflight
    from reslab.orchestrator.pruning import open_search_storage
    from reslab.orchestrator.tracking.guarded import GuardedTracker
    from reslab.orchestrator.tune import default_storage, trial_run, tune, tuned_lines

    study = load_study(args.spec, args.set, args.max_runs)
    if study.tune is None:
        raise ConfigError(f"{study.path}: tune: missing; `reslab tune` needs a `tune:` block (see "
                          "experiments/tune_lr_tiny.yaml)")
    options = SubmitOptions(max_concurrent=args.max_concurrent, cpus_per_run=args.cpus_per_run,
                            gpus_per_run=args.gpus_per_run, retries=args.retries, lease_timeout_s=args.lease_timeout,
                            outage_timeout_s=args.outage_timeout, sharding=args.sharding,
                            rank_restarts=args.rank_restarts).with_resources(study.resources)
    address = args.address or os.environ.get("RAY_ADDRESS")
    # the checks `reslab run` makes, on each arm's config at the tuning seed, before any write
    preflight([trial_run(study, arm.name, {}) for arm in study.arms], None if address in (None, "local") else address)
    workspace = Workspace.at(args.workspace, args.storage)
    # a bad --tune-storage fails before any write
    open_search_storage(args.tune_storage or default_storage(workspace, study.name))
    workspace.root.mkdir(parents=True, exist_ok=True)
    tracking_uri = workspace.tracking_uri(args.tracking_uri)
    interrupt_on_sigterm()
    tracker = GuardedTracker(tracking_uri, workspace, outage_timeout_s=args.outage_timeout)
    backend = RayBackend(args.address, workspace=workspace.root, ship_code=args.ship_code)
    print(f"workspace {workspace.root} | tracking {redact(tracking_uri)}")
    result = tune(study, workspace, backend, tracker, options, storage_url=args.tune_storage)
    for arm, s in result.arms.items():
        print(f"{arm}: {s.counts['complete']} complete, {s.counts['pruned']} pruned, {s.counts['failed']} failed")
    left = sum(s.inflight for s in result.arms.values())  # asked, not finished: the next `reslab tune` resumes them
    print(f"{study.name}: {result.trials_run - left} trial(s) finished in {result.wall_s:.0f}s"
          + (f" ({left} left in flight, resumed by the next `reslab tune`)" if left else "")
          + f"; best per arm ({study.tune.direction} {study.tune.metric}):")
    for line in tuned_lines(result.best, study.tune.metric):
        print(line)
    if result.interrupted:
        return 130
    print(f"next: reslab run {args.spec} --from-tune"
          + (f" --tune-storage {args.tune_storage}" if args.tune_storage else ""))
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("tune", help="search each arm's `tune:` space with Optuna (trials run like study runs)")
    add_study_args(p)
    add_tune_storage_arg(p)
    add_cluster_args(p)
    p.add_argument("--max-concurrent", type=positive_int,
                   help="trials at once (default: the cluster's GPUs / --gpus-per-run for GPU runs, "
                        "its CPUs / --cpus-per-run otherwise)")
    p.add_argument("--cpus-per-run", type=positive_float, default=1.0,
                   help="CPUs per trial, also its torch threads (default 1)")
    p.add_argument("--gpus-per-run", type=non_negative_float, help=GPUS_PER_RUN_HELP)
    add_ranks_args(p)
    p.add_argument("--retries", type=non_negative_int, default=1,
                   help="extra attempts for a trial whose run crashed (default 1)")
    p.set_defaults(func=cmd_tune)
