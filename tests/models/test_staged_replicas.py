"""Pipeline x data parallelism (`models.staged`, issue 38): 4 gloo ranks spawned on CPU, 2 replicas of 2 stages
(rank r stage r % 2 of replica r // 2), against one process on the same global batch, float32, within 1e-5
relative (the replicas and the stages sum the same gradients in another order).

The reference is one process: `Decoder.forward` and `backward` on the whole batch for the gradients (every
parameter a rank's stage uses, against the reference gradient the rank computes itself), and `train` on the
same run config for the loss curve, the gradient norms, the validation losses and the final weights (its
`checkpoint.pt` against the ranks' DCP checkpoint, converted by torch's own `dcp_to_torch_save`). The ranks'
run stops after step 2 and resumes its own checkpoint, and one process resumes a copy of it, each continuing
the one-process curve: the checkpoint moves between layouts.

One spawn runs both phases (importing torch in each rank is most of the cost).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from test_staged import pp_run
from test_training import stop_at
from variant_testing import make_model, perturb_pathway, reference_step, tokens

from reslab.models.config import RunConfig
from reslab.models.distributed import Parallel
from reslab.models.pipeline import PipelineOptions
from reslab.models.training import StopRun, train

pytestmark = pytest.mark.usefixtures("one_thread")

RTOL, FLOOR = 1e-5, 1e-7
STAGES, REPLICAS, BATCH, SEQ = 2, 2, 4, 16
VARIANTS = ("attnres",)  # pathway parameters on both stages, and the tied embedding


def _gradients(name: str) -> dict[str, Any]:
    """This rank's stage of a `StagedRun` step on its replica's half of the batch, against the one-process
    gradient of the whole batch: the largest ||g - g_ref|| / (RTOL ||g_ref|| + FLOOR ||G_ref||) (<= 1 passes)."""
    from reslab.models.staged import StagedRun

    model = make_model(name, {}, seed=3, n_layers=2)
    perturb_pathway(model, 0.3)
    idx, targets = tokens(BATCH, SEQ, seed=1), tokens(BATCH, SEQ, seed=2)
    out, ref = reference_step(model, idx, targets)
    staged = StagedRun(model, PipelineOptions(STAGES, "1f1b", 2), 1, (BATCH, SEQ))
    first, count = staged.samples(0)
    loss = staged.step(idx[first:first + count], targets[first:first + count])
    mine = {id(p) for p in staged.pipeline.parameters()}
    total, worst = torch.cat([g.flatten() for g in ref.values()]).norm().item(), 0.0
    for n, p in model.named_parameters():
        if id(p) in mine:
            g = torch.zeros_like(p) if p.grad is None else p.grad
            r = ref.get(n, torch.zeros_like(p))
            worst = max(worst, ((g - r).norm() / (RTOL * r.norm() + FLOOR * total)).item())
    return {"loss": loss, "ref_loss": out.loss.item(), "grad": worst, "first": first}


def _run() -> RunConfig:
    """`test_staged.pp_run` (global batch 2 x 2 = 4 samples, 2 layers) for 4 steps, evaluated at 2 and 4."""
    base = pp_run()
    return dataclasses.replace(base, train=dataclasses.replace(base.train, steps=4, eval_every=2))


def _training(root: Path, par: Parallel) -> dict[str, Any]:
    with contextlib.suppress(StopRun):
        train(_run(), root / "dp", parallel=par, on_step=stop_at(2))
    if par.is_main:
        shutil.copytree(root / "dp", root / "dp-to-one-process")
    result = train(_run(), root / "dp", parallel=par)
    return {"history": result.history, "info": result.info}


def _rank(rank: int, root: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank, world_size=STAGES * REPLICAS,
                            timeout=datetime.timedelta(seconds=120))
    try:
        out: dict[str, Any] = {name: _gradients(name) for name in VARIANTS}
        par = Parallel.from_process_group(pipeline=PipelineOptions(STAGES, "1f1b", 1))  # type: ignore[arg-type]
        out["training"] = _training(Path(root), par)
    finally:
        dist.destroy_process_group()
    torch.save(out, f"{root}/rank-{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, one_thread) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("replicas")
    torch.multiprocessing.spawn(_rank, args=(str(root),), nprocs=STAGES * REPLICAS, join=True)
    return {"root": root, "ranks": [torch.load(root / f"rank-{r}.pt", weights_only=False)
                                    for r in range(STAGES * REPLICAS)]}


def test_two_replicas_of_two_stages_give_the_one_process_gradient(ranks):
    for r, out in enumerate(ranks["ranks"]):
        assert out[VARIANTS[0]]["first"] == (r // STAGES) * BATCH // REPLICAS  # replica r // S reads its half
        for name in VARIANTS:
            assert out[name]["grad"] <= 1.0, f"rank {r}, {name}: gradients off by {out[name]['grad']} x tolerance"
    for name in VARIANTS:  # each replica's loss is its half's; their mean is the whole batch's
        halves = [ranks["ranks"][k * STAGES][name]["loss"] for k in range(REPLICAS)]
        assert sum(halves) / REPLICAS == pytest.approx(ranks["ranks"][0][name]["ref_loss"], rel=RTOL)


def _assert_curve(result: dict[str, Any], ref: Any, start: int = 0) -> None:
    for kind, metric in (("train", "train_loss"), ("train", "grad_norm"), ("eval", "val_loss")):
        got = [e for e in result["history"][kind] if e["step"] > start]
        want = [e for e in ref.history[kind] if e["step"] > start]
        assert [e["step"] for e in got] == [e["step"] for e in want]
        assert [e[metric] for e in got] == pytest.approx([e[metric] for e in want], rel=RTOL), metric


def test_two_replicas_of_two_stages_train_the_one_process_run_and_its_checkpoint_moves(ranks, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from reslab.models.checkpoint import DCP_DIR, committed

    root = ranks["root"]
    ref = train(_run(), tmp_path / "one")
    for out in ranks["ranks"]:
        _assert_curve(out["training"], ref)
        assert out["training"]["info"]["pipeline_replicas"] == REPLICAS
        assert [seg["start_step"] for seg in out["training"]["info"]["segments"]] == [0, 2]
    _assert_curve({"history": train(_run(), root / "dp-to-one-process").history}, ref, start=2)
    want = torch.load(tmp_path / "one" / "checkpoint.pt", weights_only=False)["model"]
    dcp_to_torch_save(committed(root / "dp" / DCP_DIR)[-1], tmp_path / "dp.pt")
    got = torch.load(tmp_path / "dp.pt", weights_only=False)["model"]
    assert set(got) == set(want)
    for key, value in want.items():
        assert torch.allclose(got[key], value, rtol=RTOL, atol=1e-7), key
