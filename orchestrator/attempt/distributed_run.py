"""One attempt's training on N ranks through Ray Train (issue 25, the orchestrator's half).

A run whose task says `ranks.world` = N >= 2 (`--gpus-per-run N`) is an attempt like any other
(`orchestrator.attempt.worker`): the task a backend started claims the run, holds its lease and heartbeat,
writes its records and status, pulls and pushes it to run storage and reports the outcome. Only its
training moves out: `train_on_ranks` starts N ranks as a Ray Train `TorchTrainer` and waits for
them. Each rank runs `rank_main`, which calls
`models.training.train(..., parallel=Parallel.from_process_group(sharding))`; rank 0 also records
(`RankZero`), with the hooks the attempt itself uses for a run in one process
(`orchestrator.attempt.hooks.step_hooks`), and hands its `RankEnd` back to the attempt.

Launch. `ScalingConfig(num_workers=N, use_gpu=True, resources_per_worker={"GPU": 1, "CPU": cpus})`:
one GPU per rank and an equal share of `--cpus-per-run`, the N ranks on one node (`STRICT_PACK`). CPU
ranks (`tasks.on_cpu_ranks`: the Ray cluster has no GPU, or the run sets `train.device: cpu`) ask for
their share of CPUs only (`use_gpu=False`), and train on gloo.
When the run trains in a node-local scratch directory (`$RESLAB_SCRATCH`, with run storage) they
are also pinned to the attempt's own node, since every rank reads and writes the run directory;
without scratch, the run directory is in the workspace, which a multi-node cluster shares. The torch
backend is chosen as the ranks start, by rank 0 (`RankTorchConfig`): NCCL when the run trains on
CUDA there, gloo otherwise. Ray Train alone would pick NCCL for any rank that holds a GPU, including
a GPU declared on a CPU machine and a run set to `train.device: cpu`. So the launch is the same on
CPUs and GPUs; only the backend and the device differ.

Faults. `FailureConfig(max_failures=ranks.restarts)`: when a rank dies, or raises anything the rank
loop does not return as a value, Ray Train stops every rank and starts them again. They resume from
the newest committed DCP checkpoint, and rank 0's `on_start` keeps metrics.jsonl up to that step,
as for any resume, so the curve holds each step once (the driver's tracker skips the steps MLflow
already has). A stop (`StopRun`) and a divergence, which every rank meets at the same step, come
back as rank 0's return value instead, because Ray Train would restart the ranks for an exception
(`rank_main` says why nothing else does). After the last restart, Ray Train's
`TrainingFailedError` is unwrapped to the exception of the lowest failing rank (`rank_error`), so
the attempt fails as a run in one process would: retried by the driver, or not (a config error).

Ray Train's own files (a storage check) go in `<run dir>/.ray_train/`, removed when the ranks end.
Every rank calls the `$RESLAB_STEP_HOOK` factory (`orchestrator.attempt.hooks`), which is how a test kills
one rank mid-run.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import ray
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer
from ray.train.torch.config import _TorchBackend

from reslab.orchestrator.attempt.envinfo import check_code_fingerprint, code_fingerprint
from reslab.orchestrator.attempt.hooks import Recorder, StepHooks, flush_events, log_line, step_hooks
from reslab.orchestrator.attempt.threads import set_threads
from reslab.orchestrator.durability.workspace import RunDir
from reslab.orchestrator.tasks import EventReporter, Ranks, RunTask, on_cpu_ranks

if TYPE_CHECKING:
    from reslab.models.distributed import Parallel
    from reslab.models.training import TrainResult

RAY_TRAIN_DIR = ".ray_train"  # in the run directory: Ray Train's storage path while the ranks run
NODE_ID_LABEL = "ray.io/node-id"  # the label Ray gives every node (ray._raylet.RAY_NODE_ID_KEY)


def _trains_on_cuda(device: str) -> bool:
    """On a rank: whether `train.device` resolves to CUDA there (`models.training.pick_device`'s rule)."""
    import torch

    return device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())


class _RankBackend(_TorchBackend):
    """Ray Train's torch backend with the process group's backend chosen on rank 0 (module docstring)."""

    def on_start(self, worker_group: Any, backend_config: Any) -> None:
        cuda = worker_group.execute_single(0, _trains_on_cuda, backend_config.device)
        super().on_start(worker_group, dataclasses.replace(backend_config, backend="nccl" if cuda else "gloo"))


@dataclasses.dataclass
class RankTorchConfig(TorchConfig):
    """`TorchConfig` whose backend follows the run's `train.device` on rank 0: NCCL on CUDA, else gloo."""

    device: str = "auto"

    @property
    def backend_cls(self) -> type[_RankBackend]:
        return _RankBackend


def _scaling(ranks: Ranks, node_local: bool, on_cpus: bool = False) -> ScalingConfig:
    """One GPU (none `on_cpus`) and `ranks.cpus` CPUs per rank, all on one node; on this node when `node_local`."""
    here = {NODE_ID_LABEL: ray.get_runtime_context().get_node_id()} if node_local else None
    per_rank = {"CPU": ranks.cpus} if on_cpus else {"GPU": 1, "CPU": ranks.cpus}
    # ray.train's names are Ray Train v2's classes at run time; the type checker sees v1's
    return ScalingConfig(num_workers=ranks.world, use_gpu=not on_cpus,  # type: ignore[call-arg]
                         resources_per_worker=per_rank, placement_strategy="STRICT_PACK", label_selector=here)


def rank_error(exc: Exception) -> BaseException:
    """What the ranks raised, from Ray Train's `TrainingFailedError`: the lowest failing rank's own exception,
    else the controller's, else `exc`."""
    failures = getattr(exc, "worker_failures", None) or {}
    if failures:
        return failures[min(failures)]
    return getattr(exc, "controller_failure", None) or exc


def cpu_ranks_here(device: str) -> bool:
    """Whether this attempt's ranks are CPU ranks (`tasks.on_cpu_ranks` for the cluster it is on and `device`)."""
    return on_cpu_ranks(float(ray.cluster_resources().get("GPU", 0)), [device])


def ranks_words(ranks: Ranks, on_cpus: bool) -> str:
    """What each rank holds, for the run's log: "ddp; 1 GPU and 2 CPU each", or on CPU ranks "ddp; CPU ranks of
    2 CPU each, gloo" (they ask Ray for no GPU)."""
    each = f"CPU ranks of {ranks.cpus:g} CPU each, gloo" if on_cpus else f"1 GPU and {ranks.cpus:g} CPU each"
    return f"{ranks.sharding}; {each}"


def train_on_ranks(loop: Callable[[dict[str, Any]], Any], config: dict[str, Any], ranks: Ranks, run_dir: Path, *,
                   device: str, name: str, node_local: bool) -> Any:
    """Run `loop(config)` on `ranks.world` ranks and return rank 0's return value (module docstring).

    `run_dir` is the run directory every rank sees, `device` the run's `train.device`, `name` unique to
    the attempt. Raises the ranks' own exception (`rank_error`) once Ray Train gives up restarting them.
    """
    from ray.train import TrainingFailedError

    storage = run_dir / RAY_TRAIN_DIR
    on_cpus = cpu_ranks_here(device)
    trainer = TorchTrainer(
        loop, train_loop_config=config, torch_config=RankTorchConfig(device=device),
        scaling_config=_scaling(ranks, node_local, on_cpus),
        run_config=RunConfig(name=name, storage_path=str(storage),
                             failure_config=FailureConfig(max_failures=ranks.restarts)),
    )
    try:
        return trainer.fit().return_value  # type: ignore[attr-defined]  # v2's Result, see _scaling
    except TrainingFailedError as exc:
        raise rank_error(exc) from exc
    finally:
        shutil.rmtree(storage, ignore_errors=True)


@dataclasses.dataclass
class RankEnd:
    """What rank 0 of a run on N ranks hands back to its attempt (`worker._Attempt._train_on_ranks`): the result,
    or the stop or failure that ends the attempt (`error`, raised there) and whether the search's pruner
    stopped it."""

    result: TrainResult | None = None
    error: BaseException | None = None
    pruned: bool = False


class RankZero:
    """Rank 0's share of the attempt (`rank_main`), held with `with`: its own `Recorder` (the attempt's
    fence token, no per-checkpoint push) and train.log. Leaving fsyncs the records, then waits until the
    driver has every event (the attempt writes SUCCESS after this returns)."""

    def __init__(self, task: RunTask, rd: RunDir, reporter: EventReporter, token: int) -> None:
        self.task, self.rd, self.reporter = task, rd, reporter
        self.recorder = Recorder(task, rd, reporter, token)
        self.log_f: TextIO | None = None

    def __enter__(self) -> RankZero:
        self.log_f = open(self.rd.log_file, "a")  # noqa: SIM115 - closed by __exit__
        ranks = self.task.ranks
        self.log(f"rank 0 of {ranks.world} ({ranks.layout}) on {socket.gethostname()}, pid {os.getpid()}")
        return self

    def log(self, line: str) -> None:
        if self.log_f is not None:
            log_line(self.log_f, line)

    def __exit__(self, *exc: Any) -> None:
        try:
            self.recorder.close()
            flush_events(self.reporter, self.log)
        finally:
            if self.log_f is not None:
                self.log_f.close()


def rank_main(config: dict[str, Any]) -> RankEnd | None:
    """The train loop of every rank of a run on N ranks; Ray Train calls it in each rank's process
    (`train_on_ranks`). `config`: the task, the run directory, the attempt's fence token and its event
    reporter.

    Every rank checks its code against the driver's and trains with `parallel` and its step hooks
    (`orchestrator.attempt.hooks.step_hooks`); rank 0 also records as the attempt of a run in one process does
    (`RankZero`). A stop (`StopRun`, which rank 0 broadcasts) and a divergence (judged on all-reduced
    values) end every rank at the same step, and are returned, not raised, or Ray Train would start the
    ranks again for them. Anything else is raised, even an error that would fail every attempt alike: it
    may have hit one rank only, and a rank that returned would leave the others waiting in a collective;
    Ray Train stops them all and, after its restarts, the attempt fails with that error (a lost lease, a
    config error: as in one process). Rank 0's return value (a `RankEnd`) is the attempt's; the other
    ranks return None.
    """
    from reslab.models.distributed import Parallel

    task: RunTask = config["task"]
    set_threads(task.ranks.threads)
    check_code_fingerprint(task.code.get("fingerprint"), code_fingerprint(), socket.gethostname())
    parallel = Parallel.from_process_group(task.ranks.sharding, _pipeline(task))  # type: ignore[arg-type]
    rd = RunDir(Path(config["run_dir"]))
    if not parallel.is_main:
        _train_rank(task, rd, parallel, step_hooks(task, parallel.rank, None, None))
        return None
    with RankZero(task, rd, config["reporter"], config["token"]) as zero:
        hooks = step_hooks(task, 0, zero.recorder, zero.log)
        stopped = _train_rank(task, rd, parallel, hooks)
        if isinstance(stopped, BaseException):
            zero.log(f"every rank stopped: {type(stopped).__name__}: {stopped}")
            return RankEnd(error=stopped, pruned=hooks.pruner is not None and hooks.pruner.pruned)
    return RankEnd(result=stopped)


def _pipeline(task: RunTask) -> Any:
    """The run's pipeline stages (`models.pipeline.PipelineOptions`), or None: its ranks are data-parallel."""
    from reslab.models.pipeline import PipelineOptions

    r = task.ranks
    return (PipelineOptions(r.stages, r.schedule, r.microbatches, r.virtual_stages, r.cache)  # type: ignore[arg-type]
            if r.stages > 1 else None)


def _train_rank(task: RunTask, rd: RunDir, parallel: Parallel, hooks: StepHooks) -> TrainResult | BaseException:
    """This rank's `train`: its result, or the stop or divergence that ended every rank at the same step."""
    from reslab.models.training import StopRun, TrainingDiverged, train

    try:
        return train(task.run.config, rd.path, resume=True, parallel=parallel, **hooks.train_kwargs)
    except (StopRun, TrainingDiverged) as exc:
        return exc


__all__ = ["RAY_TRAIN_DIR", "RankEnd", "RankTorchConfig", "rank_error", "rank_main", "train_on_ranks"]
