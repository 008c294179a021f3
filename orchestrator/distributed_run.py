"""One attempt's training on N ranks through Ray Train (issue 25, the orchestrator's half).

A run whose task says `ranks.world` = N >= 2 (`--gpus-per-run N`) is an attempt like any other
(`orchestrator.worker`): the task a backend started claims the run, holds its lease and heartbeat,
writes its records and status, pulls and pushes it to run storage and reports the outcome. Only its
training moves out: `train_on_ranks` starts N ranks as a Ray Train `TorchTrainer` and waits for
them. Each rank runs the worker's rank loop (`worker.rank_main`), which calls
`models.training.train(..., parallel=Parallel.from_process_group(sharding))`; rank 0 also records,
as the attempt itself does for a run in one process (see `worker.rank_main`).

Launch. `ScalingConfig(num_workers=N, use_gpu=True, resources_per_worker={"GPU": 1, "CPU": cpus})`:
one GPU per rank and an equal share of `--cpus-per-run`, the N ranks on one node (`STRICT_PACK`).
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
(`worker.rank_main` says why nothing else does). After the last restart, Ray Train's
`TrainingFailedError` is unwrapped to the exception of the lowest failing rank (`rank_error`), so
the attempt fails as a run in one process would: retried by the driver, or not (a config error).

Ray Train's own files (a storage check) go in `<run dir>/.ray_train/`, removed when the ranks end.

Test-only: `$RESLAB_TEST_KILL_RANK` (`kill_rank_hook`) kills one rank of one run once, after a given
step, as a lost process or node would; it does nothing unless a test arms it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer
from ray.train.torch.config import _TorchBackend

from reslab.common.io import write_atomic
from reslab.orchestrator.tasks import Ranks

RAY_TRAIN_DIR = ".ray_train"  # in the run directory: Ray Train's storage path while the ranks run
NODE_ID_LABEL = "ray.io/node-id"  # the label Ray gives every node (ray._raylet.RAY_NODE_ID_KEY)
KILL_RANK_ENV = "RESLAB_TEST_KILL_RANK"


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


def _scaling(ranks: Ranks, node_local: bool) -> ScalingConfig:
    """One GPU and `ranks.cpus` CPUs per rank, all on one node; on this node when `node_local`."""
    here = {NODE_ID_LABEL: ray.get_runtime_context().get_node_id()} if node_local else None
    # ray.train's names are Ray Train v2's classes at run time; the type checker sees v1's
    return ScalingConfig(num_workers=ranks.world, use_gpu=True,  # type: ignore[call-arg]
                         resources_per_worker={"GPU": 1, "CPU": ranks.cpus}, placement_strategy="STRICT_PACK",
                         label_selector=here)


def rank_error(exc: Exception) -> BaseException:
    """What the ranks raised, from Ray Train's `TrainingFailedError`: the lowest failing rank's own exception,
    else the controller's, else `exc`."""
    failures = getattr(exc, "worker_failures", None) or {}
    if failures:
        return failures[min(failures)]
    return getattr(exc, "controller_failure", None) or exc


def train_on_ranks(loop: Callable[[dict[str, Any]], Any], config: dict[str, Any], ranks: Ranks, run_dir: Path, *,
                   device: str, name: str, node_local: bool) -> Any:
    """Run `loop(config)` on `ranks.world` ranks and return rank 0's return value (module docstring).

    `run_dir` is the run directory every rank sees, `device` the run's `train.device`, `name` unique to
    the attempt. Raises the ranks' own exception (`rank_error`) once Ray Train gives up restarting them.
    """
    from ray.train import TrainingFailedError

    storage = run_dir / RAY_TRAIN_DIR
    trainer = TorchTrainer(
        loop, train_loop_config=config, torch_config=RankTorchConfig(device=device),
        scaling_config=_scaling(ranks, node_local),
        run_config=RunConfig(name=name, storage_path=str(storage),
                             failure_config=FailureConfig(max_failures=ranks.restarts)),
    )
    try:
        return trainer.fit().return_value  # type: ignore[attr-defined]  # v2's Result, see _scaling
    except TrainingFailedError as exc:
        raise rank_error(exc) from exc
    finally:
        shutil.rmtree(storage, ignore_errors=True)


def kill_rank_hook(run_id: str, rank: int) -> Callable[[int], None] | None:
    """Test-only fault injection, for tests/orchestrator/test_multi_rank.py; nothing unless armed.

    Armed when `$RESLAB_TEST_KILL_RANK` names a file that exists and holds `{"run_id": ..., "rank": R,
    "step": S}`: that run's rank R writes its pid to `<file>.pid` as it starts, and the hook returned
    to its rank 0 (its part of `on_step`) SIGKILLs that process once step S is done. The hook removes
    the file first, so it fires once and the ranks Ray Train starts again train on. Every other rank,
    and every rank of another run, gets None.
    """
    armed = os.environ.get(KILL_RANK_ENV)
    if not armed or not os.path.isfile(armed):
        return None
    plan = json.loads(Path(armed).read_text())
    if plan["run_id"] != run_id:
        return None
    pid_file = Path(f"{armed}.pid")
    if rank == plan["rank"]:
        write_atomic(pid_file, str(os.getpid()))
    if rank != 0:
        return None

    def kill(done: int) -> None:
        if done != plan["step"]:
            return
        try:
            os.unlink(armed)
        except FileNotFoundError:  # fired already
            return
        os.kill(int(pid_file.read_text()), signal.SIGKILL)

    return kill


__all__ = ["KILL_RANK_ENV", "RAY_TRAIN_DIR", "RankTorchConfig", "kill_rank_hook", "rank_error", "train_on_ranks"]
