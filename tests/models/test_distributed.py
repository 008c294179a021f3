"""Data-parallel training (`models.distributed`): N gloo ranks spawned on CPU train the curve of one
process on the same global batches, checkpoint with DCP, and resume at another world size.

The multi-process tests share one spawn of 4 ranks (importing torch in each is most of the cost):
`phases` runs every scenario in turn, each in a fresh process group of the ranks it needs, and
the tests assert on what the ranks saved.
"""

from __future__ import annotations

import dataclasses
import datetime
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from test_training import stop_at, tiny_run

from reslab.models.checkpoint import COMMITTED, DCP_DIR, newer_checkpoint
from reslab.models.config import ConfigError, CostConfig, RunConfig
from reslab.models.distributed import Parallel, rank_batches, rank_sample_ranges
from reslab.models.generation import load_run_model
from reslab.models.training import StopRun, train

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 6
# float32 on CPU: N ranks sum the same gradients in another order (ranks, then micro-batches);
# measured at most 3e-7 (FSDP's grad norm), 3e-8 for the losses, over these 6 steps
RTOL = 1e-5


def dp_run(**train_kw) -> RunConfig:
    """Global batch B = 2 x 4 = 8 samples; 5 eval windows make 3 val batches of 2, 2, 1 rows, so
    the ranks' shares of the evaluation are uneven."""
    base = tiny_run("attnres", steps=STEPS)
    train_kw = {"eval_every": 3, "eval_windows": 5, "log_every": 1, "diagnostics": False, "device": "cpu",
                **train_kw}
    return dataclasses.replace(base, optim=dataclasses.replace(base.optim, batch_size=2, grad_accum=4),
                               train=dataclasses.replace(base.train, **train_kw))


def measured(cfg: RunConfig) -> RunConfig:
    """`cfg` measuring its serving cost, cheaply (the rank-0 measurement is what is tested)."""
    return dataclasses.replace(cfg, cost=CostConfig(decode_batch=2, new_tokens=2, repeats=1))


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_rank_sample_ranges_partition_each_global_batch(world):
    micros, size = rank_batches(8, 2, world)
    assert (micros, size) == {1: (4, 2), 2: (2, 2), 4: (1, 2), 8: (1, 1)}[world]
    for step in range(3):
        ranges = [rank_sample_ranges(step, 8, world, rank, micros) for rank in range(world)]
        assert all(len(r) == size for rank in ranges for r in rank)
        assert [i for rank in ranges for r in rank for i in r] == list(range(step * 8, (step + 1) * 8))


def test_rank_batches_keeps_micro_batches_equal_and_within_batch_size():
    assert rank_batches(12, 4, 2) == (2, 3)  # 6 samples per rank: two of 3, not 4 + 2
    assert rank_batches(10, 4, 1) == (5, 2)


def test_a_world_size_that_does_not_divide_the_global_batch_names_the_allowed_ones():
    with pytest.raises(ConfigError, match=r"= 8 samples cannot be split evenly over 3 ranks; "
                                          r"allowed world sizes: 1, 2, 4, 8"):
        rank_batches(8, 2, 3)
    with pytest.raises(ConfigError, match=r"over 16 ranks"):
        rank_batches(8, 2, 16)


def test_a_rank_without_its_process_group_is_refused():
    from reslab.models.training import Trainer

    with pytest.raises(ValueError, match="rank 2 is outside a world of 2"):
        Parallel(world=2, rank=2)
    with pytest.raises(RuntimeError, match=r"needs an initialised default process group .* found none"):
        Trainer(dp_run(), parallel=Parallel(world=2, rank=0))


# ----------------------------------------------------------------------------- the spawned ranks


def _summary(result) -> dict[str, Any]:
    return {"history": result.history, "summary": result.summary, "info": result.info}


def _listing(root: Path) -> dict[str, bool]:
    """Step directory -> committed, under `root/checkpoint.dcp`."""
    return {d.name: (d / COMMITTED).is_file() for d in sorted((root / DCP_DIR).iterdir())}


def _raised(call: Callable[[], Any]) -> tuple[str, str]:
    try:
        call()
    except (StopRun, RuntimeError) as exc:
        return type(exc).__name__, str(exc)
    return "nothing", ""


def _n4(root: Path, par: Parallel, seen: list) -> dict[str, Any]:
    return _summary(train(measured(dp_run()), parallel=par))


def _n2_stopped_and_resumed(root: Path, par: Parallel, seen: list) -> dict[str, Any]:
    stopped = _raised(lambda: train(dp_run(), root / "n2", parallel=par, on_step=stop_at(3)))
    if par.is_main:
        shutil.copytree(root / "n2", root / "n2-to1")
        shutil.copytree(root / "n2", root / "n2-to4")
        shutil.copytree(root / "n2", root / "n2-to-one-process")
    return {"stopped": stopped, **_summary(train(dp_run(), root / "n2", parallel=par)),
            "listing": _listing(root / "n2")}


def _n4_fsdp_resumes_n2(root: Path, par: Parallel, seen: list) -> dict[str, Any]:
    return _summary(train(dp_run(), root / "n2-to4", parallel=par))


def _n1_resumes_n2_then_finished(root: Path, par: Parallel, seen: list) -> dict[str, Any]:
    first = train(dp_run(), root / "n2-to1", parallel=par)
    trained = len(seen)
    again = train(dp_run(), root / "n2-to1", parallel=par)
    return {**_summary(first), "again": _summary(again), "trained_again": len(seen) - trained}


def _resumes_one_process(root: Path, par: Parallel, seen: list) -> dict[str, Any]:
    """Ranks resuming a run that one process stopped at step 3 (its `checkpoint.pt`; the fixture wrote it)."""
    return _summary(train(dp_run(), root / f"one-process-to-{par.sharding}", parallel=par))


def _fenced_at_step_4(root: Path, par: Parallel, seen: list) -> dict[str, Any]:
    commits: list[int] = []

    def fence(rename: Callable[[], None]) -> None:
        commits.append(1)
        if len(commits) == 2:
            raise RuntimeError("lease lost: commit refused")
        rename()

    raised = _raised(lambda: train(dp_run(checkpoint_every=2), root / "fenced", parallel=par, commit=fence))
    listing = _listing(root / "fenced")
    return {"raised": raised, "listing_after_fence": listing,
            **_summary(train(dp_run(checkpoint_every=2), root / "fenced", parallel=par)),
            "listing": _listing(root / "fenced")}


def _fsdp_with_diagnostics(root: Path, par: Parallel, seen: list) -> dict[str, Any]:
    return _summary(train(measured(dp_run(diagnostics=True)), parallel=par))


# (name, world size, sharding, what the ranks run)
PHASES: list[tuple[str, int, str, Callable[[Path, Parallel, list], dict[str, Any]]]] = [
    ("n4", 4, "ddp", _n4),
    ("n2", 2, "ddp", _n2_stopped_and_resumed),
    ("n4_fsdp_resumed", 4, "fsdp", _n4_fsdp_resumes_n2),
    ("n1_resumed", 1, "ddp", _n1_resumes_n2_then_finished),
    ("fenced", 2, "ddp", _fenced_at_step_4),
    ("one_process_to_n2", 2, "ddp", _resumes_one_process),
    ("one_process_to_n2_fsdp", 2, "fsdp", _resumes_one_process),
    ("fsdp_diag", 2, "fsdp", _fsdp_with_diagnostics),
]


def _recording(seen: list) -> None:
    """Keep every batch of token ids the model trains on (grad-enabled forwards with targets)."""
    from reslab.models import backbone

    real = backbone.Decoder.forward

    def forward(self, idx, targets=None):
        if targets is not None and torch.is_grad_enabled():
            seen.append(idx.clone())
        return real(self, idx, targets)

    backbone.Decoder.forward = forward  # type: ignore[method-assign]


def _rank(rank: int, root: str) -> None:
    """One spawned rank: every phase it belongs to, each in a process group of its own."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    seen: list[torch.Tensor] = []
    _recording(seen)
    for i, (name, world, sharding, job) in enumerate(PHASES):
        if rank >= world:
            continue
        dist.init_process_group("gloo", init_method=f"file://{root}/store-{i}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        seen.clear()
        try:
            out = job(Path(root), Parallel.from_process_group(sharding), seen)  # type: ignore[arg-type]
        finally:
            dist.destroy_process_group()
        torch.save({**out, "xs": list(seen)}, f"{root}/{name}-{rank}.pt")


def _train_recorded(cfg: RunConfig) -> tuple[Any, list[torch.Tensor]]:
    from reslab.models import backbone

    real, seen = backbone.Decoder.forward, []
    _recording(seen)
    try:
        return train(cfg), seen
    finally:
        backbone.Decoder.forward = real  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def phases(tmp_path_factory, one_thread) -> dict[str, list[dict[str, Any]]]:
    """Each phase's per-rank results, plus the 1-process references ("ref", "ref_diag"), which
    also prepare the corpus before the ranks start."""
    ref, ref_xs = _train_recorded(dp_run())
    ref_diag = train(measured(dp_run(diagnostics=True)))
    root = tmp_path_factory.mktemp("ranks")
    for sharding in ("ddp", "fsdp"):  # one process stops at step 3; ranks resume its checkpoint.pt
        with pytest.raises(StopRun):
            train(dp_run(), root / f"one-process-to-{sharding}", on_step=stop_at(3))
    torch.multiprocessing.spawn(_rank, args=(str(root),), nprocs=max(w for _, w, _, _ in PHASES), join=True)
    out = {name: [torch.load(root / f"{name}-{r}.pt", weights_only=False) for r in range(world)]
           for name, world, _, _ in PHASES}
    to_one = train(dp_run(), root / "n2-to-one-process")  # one process resumes the ranks' DCP step 3
    # what `reslab generate` loads: the ranks' final DCP step and the one process's checkpoint.pt of the same curve
    loaded = {name: (newer_checkpoint(root / name), load_run_model(newer_checkpoint(root / name), torch.device("cpu")))
              for name in ("n2", "n2-to-one-process")}
    return {**out, "ref": [{**_summary(ref), "xs": ref_xs}], "ref_diag": [_summary(ref_diag)],
            "n2_to_one_process": [_summary(to_one)],
            "loaded": [{"path": path, "state": model.state_dict(), "step": step}
                       for path, (model, _, _, step) in loaded.values()]}


def _global_batches(ranks: list[dict[str, Any]]) -> list[torch.Tensor]:
    """Per step, the token ids all ranks trained on, in rank order: [B, T] each."""
    per_rank = [torch.stack(r["xs"]).reshape(STEPS, -1, r["xs"][0].shape[-1]) for r in ranks]
    return [torch.cat([p[s] for p in per_rank]) for s in range(STEPS)]


def _assert_curve(result: dict[str, Any], ref: dict[str, Any], start: int = 0) -> None:
    got = {k: [e for e in result["history"][k] if e["step"] > start] for k in ("train", "eval")}
    want = {k: [e for e in ref["history"][k] if e["step"] > start] for k in ("train", "eval")}
    for kind, metric in (("train", "train_loss"), ("train", "grad_norm"), ("eval", "val_loss")):
        assert [e["step"] for e in got[kind]] == [e["step"] for e in want[kind]]
        assert [e[metric] for e in got[kind]] == pytest.approx([e[metric] for e in want[kind]], rel=RTOL), metric


@pytest.mark.slow
@pytest.mark.parametrize("name", ["n4", "n2", "fsdp_diag"])
def test_every_world_size_trains_the_same_global_batches_and_curve(phases, name):
    ranks, ref = phases[name], phases["ref"][0]
    want = torch.stack(ref["xs"]).reshape(STEPS, 8, -1)
    assert all(torch.equal(a, b) for a, b in zip(_global_batches(ranks), want, strict=True))
    for r in ranks:  # every rank returns the result, with the same curve
        _assert_curve(r, ref)
        assert r["summary"]["tokens"] == ref["summary"]["tokens"]
    info = ranks[0]["info"]
    assert (info["world_size"], info["sharding"]) == (len(ranks), "fsdp" if "fsdp" in name else "ddp")
    assert info["params"] == ref["info"]["params"]  # counted over the whole model, sharded or not


@pytest.mark.slow
@pytest.mark.parametrize("name", ["n4", "n2", "fsdp_diag"])
def test_magnitudes_across_depth_are_one_process_ones_on_every_rank(phases, name):
    """The eval windows' RMS per site (uneven shares: 3 val batches over 2 or 4 ranks, a rank scoring none under
    DDP, a discarded forward under FSDP) summed over the ranks, and the step's gradient norms per sublayer and
    layer (DDP: whole and averaged; FSDP: DTensor shards, their squares summed over the ranks) equal one process's."""
    ref = phases["ref"][0]["history"]["eval"]
    for r in phases[name]:
        got = r["history"]["eval"]
        for g, w in zip(got, ref, strict=True):
            mags = sorted(k for k in w if k.startswith("mag/"))
            assert {"mag/grad_norm/l01", "mag/in_rms/s03", "mag/growth", "mag/grad_cv"} <= set(mags)
            assert sorted(k for k in g if k.startswith("mag/")) == mags
            assert [g[k] for k in mags] == pytest.approx([w[k] for k in mags], rel=RTOL), name
        assert r["summary"]["growth"] == pytest.approx(phases["ref"][0]["summary"]["growth"], rel=RTOL)
        assert r["summary"]["grad_cv"] == pytest.approx(phases["ref"][0]["summary"]["grad_cv"], rel=RTOL)


@pytest.mark.slow
def test_fsdp_diagnostics_are_rank_0s_whole_model_ones_on_every_rank(phases):
    ref = phases["ref_diag"][0]["history"]["eval"]
    for r in phases["fsdp_diag"]:
        got = r["history"]["eval"]
        assert got[-1].keys() == ref[-1].keys() and "d_eff" in got[-1]
        for g, w in zip(got, ref, strict=True):
            assert g == pytest.approx(w, rel=RTOL, abs=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["n4", "fsdp_diag"])
def test_rank_0_measures_the_serving_cost_of_the_whole_model_for_every_rank(phases, name):
    """Under DDP rank 0's model is whole; under FSDP its replica is loaded with the gathered weights:
    the state bytes and FLOPs are one process's, and every rank returns rank 0's figures."""
    ranks, ref = phases[name], phases["ref_diag"][0]
    for key in ("decode_state_bytes", "flops_per_token"):
        assert [r["summary"][key] for r in ranks] == [ref["summary"][key]] * len(ranks), key
    for key in ("prefill_tps", "decode_tps", "decode_tps_batch", "decode_peak_mem_mb"):
        assert all(r["summary"][key] == ranks[0]["summary"][key] for r in ranks) and ranks[0]["summary"][key] > 0
    assert [r["info"]["cost"] for r in ranks] == [ranks[0]["info"]["cost"]] * len(ranks)


@pytest.mark.slow
def test_a_finished_runs_model_loads_from_the_ranks_dcp_step_as_from_checkpoint_pt(phases):
    dcp, pt = phases["loaded"]
    assert dcp["path"].parent.name == DCP_DIR and pt["path"].name == "checkpoint.pt"
    assert dcp["step"] == pt["step"] == STEPS and dcp["state"].keys() == pt["state"].keys()
    for key, value in dcp["state"].items():  # the same curve: equal up to the ranks' order of sums
        torch.testing.assert_close(value, pt["state"][key], rtol=1e-4, atol=1e-6, msg=key)


@pytest.mark.slow
def test_a_run_stopped_at_2_ranks_resumes_at_1_2_and_4_on_the_same_curve(phases):
    ref = phases["ref"][0]
    n2 = phases["n2"]
    assert [r["stopped"] for r in n2] == [("StopRun", "stopped at step 3")] * 2
    assert n2[0]["listing"] == {f"step-{STEPS:06d}": True}  # the final checkpoint only
    for name in ("n2", "n4_fsdp_resumed", "n1_resumed"):
        ranks = phases[name]
        assert all(r["info"]["start_step"] == 3 for r in ranks), name
        if name != "n2":  # n2 recorded its steps before the stop too
            assert len(ranks[0]["xs"]) == (STEPS - 3) * 8 // len(ranks) // 2, name
        for r in ranks:
            _assert_curve(r, ref)
            assert r["summary"]["val_loss"] == pytest.approx(ref["summary"]["val_loss"], rel=RTOL)
    segments = phases["n4_fsdp_resumed"][0]["info"]["segments"]
    assert [(s["start_step"], s["end_step"], s["world_size"], s["sharding"]) for s in segments] == [
        (0, 3, 2, "ddp"), (3, STEPS, 4, "fsdp")]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["one_process_to_n2", "one_process_to_n2_fsdp", "n2_to_one_process"])
def test_a_run_moves_between_one_process_and_ranks_on_the_same_curve(phases, name):
    """checkpoint.pt (one process) resumed by 2 ranks, DDP or FSDP (whole tensors sharded as they load), and
    the ranks' DCP step resumed by one process: both continue the uninterrupted curve from step 3."""
    ref = phases["ref"][0]
    for r in phases[name]:
        assert r["info"]["start_step"] == 3
        _assert_curve(r, ref)
        assert r["summary"]["val_loss"] == pytest.approx(ref["summary"]["val_loss"], rel=RTOL)


@pytest.mark.slow
def test_a_finished_checkpoint_returns_its_result_and_trains_nothing(phases):
    n1 = phases["n1_resumed"][0]
    assert n1["trained_again"] == 0
    assert n1["again"]["summary"] == n1["summary"] and n1["again"]["history"] == n1["history"]


@pytest.mark.slow
def test_an_uncommitted_checkpoint_is_never_loaded(phases):
    """The fence refuses step 4's marker: every rank raises, step 4's files stay uncommitted, the
    next attempt resumes from step 2, and its first commit clears the leftovers."""
    ranks, ref = phases["fenced"], phases["ref"][0]
    assert [r["raised"] for r in ranks] == [("RuntimeError", "lease lost: commit refused")] * 2
    assert ranks[0]["listing_after_fence"] == {"step-000002": True, "step-000004": False}
    for r in ranks:
        assert r["info"]["start_step"] == 2
        _assert_curve(r, ref)
    assert ranks[0]["listing"] == {f"step-{STEPS:06d}": True}
