"""What several commands share beyond one flag's type (`args.py`): the study and its runs as every study
command loads them, the workspace a read command names, the flag groups of `run`, `tune`, `submit` and
the read commands, and the one set-up of options, workspace, backend and tracker for `run` and `tune`
(`checked_options`, then `set_up`; a `submit` job's driver is a `reslab run`).

The execution flags (how a submission's runs execute: `ExecutionFlag`, `EXECUTION_FLAGS`) are declared
here once: `run` and `tune` add them with their defaults, `submit` with none, passing on to its job's
`reslab run` only the ones given (`cli/jobs.py`).

A leaf of the command modules: they import it, it imports none of them.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from reslab.common.errors import ConfigError
from reslab.orchestrator.cli.args import (
    MAX_OUTAGE_S,
    add_limit_args,
    gpus_per_run,
    interrupt_on_sigterm,
    outage_seconds,
    positive_float,
    positive_int,
    restarts,
    sharding,
)
from reslab.orchestrator.durability.outage import DEFAULT_TIMEOUT_S as DEFAULT_OUTAGE_S
from reslab.orchestrator.durability.storage import redact
from reslab.orchestrator.durability.workspace import Workspace

if TYPE_CHECKING:
    from reslab.experiments import RunSpec, Study
    from reslab.orchestrator.dispatch.ray_backend import RayBackend
    from reslab.orchestrator.driving.loop import ExecutionOptions
    from reslab.orchestrator.tracking.guarded import GuardedTracker


def load_study_of(args: argparse.Namespace) -> Study:
    """The study, not expanded; with `--from-tune`, each arm frozen at its best trial (printed)."""
    from reslab.experiments import load_study

    study = load_study(args.spec, args.set, args.max_runs)
    if getattr(args, "from_tune", False):
        from reslab.orchestrator.driving.tune import tuned_study

        study, lines = tuned_study(study, Workspace.at(args.workspace), args.tune_storage)
        print("\n".join(lines))
    return study


def load(args: argparse.Namespace) -> tuple[Study, list[RunSpec]]:
    """The study and its runs; with `--from-tune`, each arm frozen at its best trial (printed)."""
    from reslab.experiments import expand

    study = load_study_of(args)
    return study, expand(study)


def read_workspace(args: argparse.Namespace, study: Study | None = None,
                   runs: Iterable[RunSpec] | None = None) -> Workspace:
    """The workspace `reslab run` would use, named on stdout; a read never creates it, except with run
    storage: then the study's records are pulled into it first (`orchestrator.durability.storage`)."""
    workspace = Workspace.at(args.workspace, args.storage)
    if workspace.storage and study is not None and runs is not None:
        from reslab.orchestrator.durability.storage import pull_study

        pulled = pull_study(workspace, study.name, [r.run_id for r in runs])
        print(f"run storage {workspace.run_storage()}: pulled the records of {len(pulled)} run(s)")
    missing = "" if workspace.root.is_dir() else " (does not exist: nothing has run here; see --workspace)"
    print(f"workspace {workspace.root}{missing}")
    return workspace


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    """Where the runs execute: `--address` and `--ship-code` (run and tune; a job's driver runs on its cluster)."""
    p.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS, else start a local instance)")
    p.add_argument("--ship-code", choices=("auto", "on", "off"), default="auto",
                   help="send this reslab code to the Ray workers (runtime_env); every worker refuses to train "
                        "with code that differs from it either way (default auto: on when joining a cluster by "
                        "--address/$RAY_ADDRESS, off for the local instance)")


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


@dataclass(frozen=True)
class ExecutionFlag:
    """One execution flag: its argparse `type` (None: a switch), default and help."""

    flag: str
    kind: Callable[[str], Any] | None
    default: Any
    help: str
    metavar: str | None = None

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")


GPUS_PER_RUN_HELP = ("GPUs per run; N >= 2 trains each run on N data-parallel ranks of one GPU each (Ray Train), or "
                     "on N CPU ranks (gloo) where the cluster has no GPU or every run sets train.device: cpu. "
                     "Default: the study's resources.gpus_per_run, else 1 if the cluster has GPUs, else 0")
# how a submission's runs execute (`loop.ExecutionOptions`), for a study and a search alike
EXECUTION_FLAGS: tuple[ExecutionFlag, ...] = (
    ExecutionFlag("--max-concurrent", positive_int, None,
                  "runs at once (default: the cluster's GPUs / --gpus-per-run for GPU runs, its CPUs / --cpus-per-run "
                  "otherwise)"),
    ExecutionFlag("--cpus-per-run", positive_float, 1.0, "CPUs per run, also its torch threads (default 1)"),
    ExecutionFlag("--gpus-per-run", gpus_per_run, None, GPUS_PER_RUN_HELP),
    ExecutionFlag("--sharding", sharding, None,
                  "how a run on N ranks holds its model: ddp (replicated) or fsdp (FSDP2, sharded); default: the "
                  "study's resources.sharding, else ddp"),
    ExecutionFlag("--rank-restarts", restarts, 2,
                  "times Ray Train starts a run's ranks again, from its last checkpoint, after one dies, before the "
                  "attempt fails (default 2)"),
    ExecutionFlag("--retries", restarts, 1,
                  "extra attempts for a run that crashed (not for divergence or config errors; default 1)"),
    ExecutionFlag("--outage-timeout", outage_seconds, DEFAULT_OUTAGE_S,
                  "how long the driver waits out run storage or a tracking store that does not answer (runs in "
                  "flight train on; finished runs are pushed, and MLflow caught up from the run directories, once "
                  f"it answers) before it stops with an error (default {DEFAULT_OUTAGE_S:g}, at most "
                  f"{MAX_OUTAGE_S:g}: a week)", "SECONDS"),
)
ALLOW_UNDERPOWERED = ExecutionFlag(
    "--allow-underpowered", None, False,
    "accept a confirmatory comparison that cannot reach alpha at the study's seeds (see `reslab power`; `plan` "
    "prints the smallest attainable p)")
# a study's only (`run`, `submit`): a search reruns no failed trial and sizes no comparison
STUDY_FLAGS: tuple[ExecutionFlag, ...] = (
    ExecutionFlag("--rerun-failed", None, False, "run again runs that failed in earlier submissions"),
    ALLOW_UNDERPOWERED,
)


def add_flags(p: argparse.ArgumentParser, flags: tuple[ExecutionFlag, ...], pass_through: bool = False) -> None:
    """`flags` on `p`; `pass_through` (`submit`): no defaults, so only what is given is passed on."""
    for f in flags:
        if f.kind is None:
            p.add_argument(f.flag, action="store_true", help=f.help)
        else:
            p.add_argument(f.flag, type=f.kind, default=None if pass_through else f.default, help=f.help,
                           metavar=f.metavar)


def add_execution_args(p: argparse.ArgumentParser, *, study: bool, pass_through: bool = False) -> None:
    """The execution flags of `run` (`study`), `tune` and `submit` (`study`, `pass_through`)."""
    if pass_through:
        add_limit_args(p, pass_through=True)
    add_flags(p, EXECUTION_FLAGS + (STUDY_FLAGS if study else ()), pass_through)


def execution_options(args: argparse.Namespace, study: Study) -> ExecutionOptions:
    """The options the execution flags ask for, the study's `resources:` filling in what they leave unset."""
    from reslab.orchestrator.driving.loop import ExecutionOptions

    options = ExecutionOptions(
        max_concurrent=args.max_concurrent, cpus_per_run=args.cpus_per_run, gpus_per_run=args.gpus_per_run,
        retries=args.retries, rerun_failed=getattr(args, "rerun_failed", False), lease_timeout_s=args.lease_timeout,
        outage_timeout_s=args.outage_timeout, sharding=args.sharding, rank_restarts=args.rank_restarts,
    ).with_resources(study.resources)
    stages, gpus = study.resources.pipeline.stages, args.gpus_per_run
    if stages > 1 and gpus is not None and gpus != 1:
        if gpus < stages or not float(gpus).is_integer() or int(gpus) % stages:
            raise ConfigError(f"--gpus-per-run: {gpus:g} GPUs for a study of resources.pipeline_stages {stages}; "
                              f"allowed: a multiple of {stages} (stages x data-parallel replicas) or 1 (one "
                              "process, no stages)")
        from reslab.experiments.spec import check_study_pipeline

        check_study_pipeline(study, int(gpus) // stages)
    return options


def ray_backend(args: argparse.Namespace, workspace: Workspace) -> RayBackend:
    """The backend `--address` and `--ship-code` name; nothing starts yet."""
    from reslab.orchestrator.dispatch.ray_backend import RayBackend

    return RayBackend(args.address, workspace=workspace.root, ship_code=args.ship_code)


def checked_options(args: argparse.Namespace, study: Study, device_runs: list[RunSpec]) -> ExecutionOptions:
    """`run`'s and `tune`'s options (`execution_options`), after the checks they make before any write
    (`loop.preflight` on `device_runs`)."""
    from reslab.orchestrator.driving.loop import preflight

    options = execution_options(args, study)
    address = args.address or os.environ.get("RAY_ADDRESS")
    local = address in (None, "local")
    preflight(device_runs, None if local else address)
    if local:
        _check_local_gpus(options, "--gpus-per-run" if args.gpus_per_run is not None else "resources.gpus_per_run",
                          [r.config.train.device for r in device_runs])
    return options


def _check_local_gpus(options: ExecutionOptions, flag: str, devices: list[str]) -> None:
    """A local instance has this machine's GPUs (Ray counts the ones CUDA shows): runs that ask for more are
    refused here, before anything is written (Ray's own check, `RayBackend.resources`, comes after the study's
    MLflow parent is created). Runs on N >= 2 CPU ranks (`tasks.on_cpu_ranks`: no GPU here, or every run on
    `train.device: cpu`) ask for none."""
    import torch

    from reslab.orchestrator.tasks import on_cpu_ranks

    gpus = options.gpus_per_run or 0.0
    need = math.ceil(gpus)  # a share of one GPU needs one; N ranks need N
    have = torch.cuda.device_count()
    if options.ranks.world > 1 and on_cpu_ranks(have, devices):
        return
    if need > have:
        raise ConfigError(f"{flag}: each run asks for {gpus:g} GPU(s) but this machine has {have}; allowed here: "
                          f"{'0 (train on CPUs)' if have == 0 else f'up to {have}'}, or join a cluster with GPU "
                          "workers (--address)")


def set_up(args: argparse.Namespace, workspace: Workspace, backend: RayBackend, options: ExecutionOptions,
           prestart: bool) -> GuardedTracker:
    """`run`'s and `tune`'s set-up once their checks passed: the workspace, the backend (started now with
    `prestart`: a local Ray comes up while MLflow opens its store) and the tracker; the line naming the
    workspace and tracking printed."""
    from reslab.orchestrator.tracking.guarded import GuardedTracker

    tracking_uri = workspace.tracking_uri(args.tracking_uri)
    interrupt_on_sigterm()  # until the loop installs its own handlers
    with undone_on_error(workspace):  # a tracking store that cannot be opened leaves no workspace behind
        workspace.root.mkdir(parents=True, exist_ok=True)
        if prestart:
            backend.prestart()
        tracker = GuardedTracker(tracking_uri, workspace, outage_timeout_s=options.outage_timeout_s)
    print(f"workspace {workspace.root} | tracking {redact(tracking_uri)}")
    return tracker


@contextlib.contextmanager
def undone_on_error(workspace: Workspace) -> Iterator[None]:
    """The workspace folders made inside the block (from the outermost that did not exist before it) are removed
    again when it raises: a store refused at start (tracking, a search's storage) leaves nothing behind."""
    created, path = None, workspace.root
    while not path.exists():
        created, path = path, path.parent
    try:
        yield
    except BaseException:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise
