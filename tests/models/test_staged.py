"""Pipeline stages in the training loop (`models.staged`, issue 38): 2 gloo ranks spawned on CPU, one stage
each (and 4 ranks, 4 stages), train the curve of one process on the same global batches (float32, within 1e-5
relative: the stages sum the same gradients in another order), record the bytes that crossed each boundary,
which equal the variant's declaration (`models.pipeline.declared_bytes`), and checkpoint in DCP: the ranks
resume their own checkpoint, one process resumes theirs and stages resume one process's `checkpoint.pt`, each
continuing the one-process curve.

One spawn of 4 ranks runs every phase in turn (importing torch in each is most of the cost).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from test_training import stop_at, tiny_run

from reslab.models.config import RunConfig
from reslab.models.distributed import Parallel
from reslab.models.pipeline import PipelineOptions
from reslab.models.training import StopRun, train

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 6
RTOL = 1e-5  # float32 on CPU; the stages sum the shared parameters' gradients in another order


def pp_run(name: str = "attnres", layers: int = 2) -> RunConfig:
    """Global batch 2 x 2 = 4 samples, 2 layers (one per stage of 2)."""
    base = tiny_run(name, steps=STEPS)
    base = dataclasses.replace(base, model=dataclasses.replace(base.model, n_layers=layers))
    return dataclasses.replace(base, optim=dataclasses.replace(base.optim, batch_size=2, grad_accum=2),
                               train=dataclasses.replace(base.train, eval_every=3, eval_windows=5, log_every=1,
                                                         diagnostics=False, device="cpu"))


def _summary(result) -> dict[str, Any]:
    return {"history": result.history, "summary": result.summary, "info": result.info}


def _gpipe(root: Path, par: Parallel) -> dict[str, Any]:
    return {name: _summary(train(pp_run(name), parallel=par)) for name in ("prenorm", "attnres", "mhc")}


def _stopped_and_resumed(root: Path, par: Parallel) -> dict[str, Any]:
    with contextlib.suppress(StopRun):  # the test reads the stop in the resumed run's segments
        train(pp_run(), root / "pp", parallel=par, on_step=stop_at(3))
    if par.is_main:
        shutil.copytree(root / "pp", root / "pp-to-one-process")
    return _summary(train(pp_run(), root / "pp", parallel=par))


def _resumes_one_process(root: Path, par: Parallel) -> dict[str, Any]:
    """Stages resuming a run one process stopped at step 3 (its `checkpoint.pt`; the fixture wrote it)."""
    return _summary(train(pp_run(), root / "one-process-to-stages", parallel=par))


def _four_stages(root: Path, par: Parallel) -> dict[str, Any]:
    return {name: _summary(train(pp_run(name, layers=4), parallel=par)) for name in ("block_attnres", "mgr")}


# (name, stages, schedule, micro-batches per optim.batch_size, what the ranks run)
PHASES: list[tuple[str, int, str, int, Callable[[Path, Parallel], dict[str, Any]]]] = [
    ("gpipe", 2, "gpipe", 2, _gpipe),
    ("1f1b_resumed", 2, "1f1b", 1, _stopped_and_resumed),
    ("four", 4, "1f1b", 2, _four_stages),
    ("one_process_to_stages", 2, "gpipe", 1, _resumes_one_process),
]


def _rank(rank: int, root: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    for i, (name, stages, schedule, micro, job) in enumerate(PHASES):
        if rank >= stages:
            continue
        dist.init_process_group("gloo", init_method=f"file://{root}/store-{i}", rank=rank, world_size=stages,
                                timeout=datetime.timedelta(seconds=120))
        try:
            par = Parallel.from_process_group(pipeline=PipelineOptions(stages, schedule, micro))  # type: ignore[arg-type]
            out = job(Path(root), par)
        finally:
            dist.destroy_process_group()
        torch.save(out, f"{root}/{name}-{rank}.pt")


@pytest.fixture(scope="module")
def phases(tmp_path_factory, one_thread) -> dict[str, Any]:
    refs = {name: _summary(train(pp_run(name))) for name in ("prenorm", "attnres", "mhc")}
    refs4 = {name: _summary(train(pp_run(name, layers=4))) for name in ("block_attnres", "mgr")}
    root = tmp_path_factory.mktemp("stages")
    with pytest.raises(StopRun):
        train(pp_run(), root / "one-process-to-stages", on_step=stop_at(3))
    torch.multiprocessing.spawn(_rank, args=(str(root),), nprocs=max(p[1] for p in PHASES), join=True)
    out = {name: [torch.load(root / f"{name}-{r}.pt", weights_only=False) for r in range(stages)]
           for name, stages, _, _, _ in PHASES}
    return {**out, "ref": refs, "ref4": refs4, "to_one": _summary(train(pp_run(), root / "pp-to-one-process"))}


def _assert_curve(result: dict[str, Any], ref: dict[str, Any], start: int = 0) -> None:
    for kind, metric in (("train", "train_loss"), ("train", "grad_norm"), ("eval", "val_loss")):
        got = [e for e in result["history"][kind] if e["step"] > start]
        want = [e for e in ref["history"][kind] if e["step"] > start]
        assert [e["step"] for e in got] == [e["step"] for e in want]
        assert [e[metric] for e in got] == pytest.approx([e[metric] for e in want], rel=RTOL), metric


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["prenorm", "attnres", "mhc"])
def test_two_stages_train_the_one_process_curve_and_send_what_they_declare(phases, variant):
    ref = phases["ref"][variant]
    for rank in phases["gpipe"]:
        got = rank[variant]
        _assert_curve(got, ref)
        s = got["summary"]
        assert s["pipe_bytes_per_step"] == s["pipe_bytes_declared"] > 0
        # every logged step carries the boundary's bytes, forward and backward, which sum to the summary
        for e in got["history"]["train"]:
            assert e["pipe/bytes_fwd/b00"] + e["pipe/bytes_bwd/b00"] == s["pipe_bytes_per_step"]
        assert got["info"]["pipeline_stages"] == 2 and got["info"]["microbatches"] == 2
    bytes_of = {v: phases["gpipe"][0][v]["summary"]["pipe_bytes_per_step"] for v in ("prenorm", "attnres")}
    # the independent count: prenorm sends one [B, T, d] float32 stream each way per step (B = 4, T = 32, d = 32);
    # Full AttnRes before site 2 sends the embedding and both sublayer outputs: 3 streams
    assert bytes_of["prenorm"] == 2 * 4 * 32 * 32 * 4
    assert bytes_of["attnres"] == 3 * bytes_of["prenorm"]


@pytest.mark.slow
def test_a_staged_run_resumes_its_checkpoint_and_one_process_resumes_it_too(phases):
    ref = phases["ref"]["attnres"]
    for rank in phases["1f1b_resumed"]:
        _assert_curve(rank, ref)
        assert [seg["start_step"] for seg in rank["info"]["segments"]] == [0, 3]
    _assert_curve(phases["to_one"], ref, start=3)
    for rank in phases["one_process_to_stages"]:  # and the other way: one process's checkpoint.pt into stages
        _assert_curve(rank, ref, start=3)
        assert rank["info"]["segments"][-1]["start_step"] == 3
    assert phases["to_one"]["info"]["segments"][-1]["start_step"] == 3


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["block_attnres", "mgr"])
def test_four_stages_train_the_one_process_curve_and_send_what_they_declare(phases, variant):
    for rank in phases["four"]:
        got = rank[variant]
        _assert_curve(got, phases["ref4"][variant])
        assert got["summary"]["pipe_bytes_per_step"] == got["summary"]["pipe_bytes_declared"] > 0
        assert {k for k in got["history"]["train"][0] if k.startswith("pipe/")} == {
            f"pipe/bytes_{d}/b{k:02d}" for d in ("fwd", "bwd") for k in range(3)}
