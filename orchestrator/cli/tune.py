"""Searches: `tune` (`plan` and `run --from-tune` read its result; their flags are in `common.py`)."""

from __future__ import annotations

import argparse
from typing import Any

from reslab.orchestrator.cli.args import add_study_args
from reslab.orchestrator.cli.common import (
    add_cluster_args,
    add_execution_args,
    add_tune_storage_arg,
    checked_options,
    ray_backend,
    set_up,
    undone_on_error,
)
from reslab.orchestrator.durability.workspace import Workspace


def cmd_tune(args: argparse.Namespace) -> int:
    from reslab.common.errors import ConfigError
    from reslab.experiments import load_study
    from reslab.orchestrator.attempt.pruning import open_search_storage
    from reslab.orchestrator.driving.tune import default_storage, trial_run, tune, tuned_lines

    study = load_study(args.spec, args.set, args.max_runs)
    if study.tune is None:
        raise ConfigError(f"{study.path}: tune: missing; `reslab tune` needs a `tune:` block (see "
                          "experiments/tune_lr_tiny.yaml)")
    # the checks `reslab run` makes, on each arm's config at the tuning seed, before any write
    options = checked_options(args, study, [trial_run(study, arm.name, {}) for arm in study.arms])
    workspace = Workspace.at(args.workspace, args.storage)
    backend = ray_backend(args, workspace)
    with undone_on_error(workspace):  # a search storage or tracking store refused now leaves no workspace behind
        open_search_storage(args.tune_storage or default_storage(workspace, study.name))
        tracker = set_up(args, workspace, backend, options, prestart=False)
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
    add_execution_args(p, study=False)
    p.set_defaults(func=cmd_tune)
