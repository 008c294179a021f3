"""What several commands share beyond one flag's type (`args.py`): the study and its runs as every study
command loads them, the workspace a read command names, and the flag groups of `run`, `tune` and the
read commands.

A leaf of the command modules: they import it, it imports none of them.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from reslab.orchestrator.cli.args import non_negative_float
from reslab.orchestrator.outage import DEFAULT_TIMEOUT_S as DEFAULT_OUTAGE_S
from reslab.orchestrator.workspace import Workspace

if TYPE_CHECKING:
    from reslab.experiments import RunSpec, Study


def load(args: argparse.Namespace) -> tuple[Study, list[RunSpec]]:
    """The study and its runs; with `--from-tune`, each arm frozen at its best trial (printed)."""
    from reslab.experiments import expand, load_study

    study = load_study(args.spec, args.set, args.max_runs)
    if getattr(args, "from_tune", False):
        from reslab.orchestrator.tune import tuned_study

        study, lines = tuned_study(study, Workspace.at(args.workspace), args.tune_storage)
        print("\n".join(lines))
    return study, expand(study)


def read_workspace(args: argparse.Namespace, study: Study | None = None,
                   runs: list[RunSpec] | None = None) -> Workspace:
    """The workspace `reslab run` would use, named on stdout; a read never creates it, except with run
    storage: then the study's records are pulled into it first (`orchestrator.storage`)."""
    workspace = Workspace.at(args.workspace, args.storage)
    if workspace.storage and study is not None and runs is not None:
        from reslab.orchestrator.storage import pull_study

        pulled = pull_study(workspace, study.name, [r.run_id for r in runs])
        print(f"run storage {workspace.run_storage()}: pulled the records of {len(pulled)} run(s)")
    missing = "" if workspace.root.is_dir() else " (does not exist: nothing has run here; see --workspace)"
    print(f"workspace {workspace.root}{missing}")
    return workspace


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    """Where the runs execute: `--address` and `--ship-code` (run and tune)."""
    p.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS, else start a local instance)")
    p.add_argument("--ship-code", choices=("auto", "on", "off"), default="auto",
                   help="send this reslab code to the Ray workers (runtime_env); every worker refuses to train "
                        "with code that differs from it either way (default auto: on when joining a cluster by "
                        "--address/$RAY_ADDRESS, off for the local instance)")
    p.add_argument("--outage-timeout", type=non_negative_float, default=DEFAULT_OUTAGE_S, metavar="SECONDS",
                   help="how long the driver waits out run storage or a tracking store that does not answer (runs "
                        "in flight train on; finished runs are pushed, and MLflow caught up from the run directories, "
                        f"once it answers) before it stops with an error (default {DEFAULT_OUTAGE_S:g})")


def add_tune_storage_arg(p: argparse.ArgumentParser) -> None:
    """`--tune-storage`: where a search lives (`tune`, and the commands that read its result)."""
    p.add_argument("--tune-storage", metavar="URL_OR_PATH",
                   help="the Optuna storage of the search: a journal file path or an RDB URL such as "
                        "postgresql://... (default <workspace>/tune/<study>.journal)")


def add_tune_args(p: argparse.ArgumentParser) -> None:
    """`--from-tune` and `--tune-storage`: read a study frozen at its search's best trials (plan, run, status,
    compare, export, report)."""
    p.add_argument("--from-tune", action="store_true",
                   help="freeze each arm at its best trial of `reslab tune` (its parameters become arm overrides)")
    add_tune_storage_arg(p)
