"""Pipeline stages (`models.pipeline`, issue 38): the backbone split into S stages on S gloo ranks.

The reference is the one-process forward and backward of the same model (`Decoder.forward`, no stages):
for every registered variant (defaults, plus the knobs that change what its state holds at a layer
boundary), with the pathway's parameters moved off their init so an identity at init cannot make the
comparison vacuous, a 2-stage run under GPipe and 1F1B gives the reference loss and the reference
gradient of every parameter its stage uses, in float32, within 1e-5 relative (per parameter, in norm,
plus 1e-7 of the whole model's gradient norm: a gradient that cancels to ~1e-8 of its terms, as DAR's
cross-mixing logits at init, differs by float32 roundoff of those terms when micro-batches sum it). Each
rank checks its own parameters against a reference it computes itself. The bytes sent across each
boundary, counted at the send calls, equal the pathway's declaration (`stage_state_elems`) forward and
backward. Three 2-stage cases run in the fast tier; the others, and the 4-stage run (one layer a stage),
are marked slow.

Virtual stages (2 ranks x 2 stages, interleaved) with and without Kimi's cross-stage caching are held to the
same one-process reference over two SGD steps (losses, gradients, final weights), their bytes to the cached
declaration; three cases in the fast tier, the rest of Full/Block AttnRes and prenorm x both schedules x cache
on/off marked slow.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from variant_testing import make_model, perturb_pathway, reference_step, tokens, trace

from reslab.common.errors import ConfigError
from reslab.models.pipeline import PipelineOptions, boundaries, check_pipeline, declared_bytes, stage_sites
from reslab.models.residual import variants
from reslab.models.residual.base import flatten_state

pytestmark = pytest.mark.usefixtures("one_thread")

RTOL, FLOOR = 1e-5, 1e-7
LR = 0.5  # SGD: the weights move by the gradient itself, so they agree as closely as it does
LAYERS, BATCH, SEQ = 4, 4, 16

# (variant, knobs): every variant's defaults, then knobs that change what crosses a layer boundary
CASES: list[tuple[str, dict[str, Any]]] = [(name, {}) for name in variants()] + [
    ("block_attnres", {"block_size": 3}),            # a partial block at the boundary (site 4)
    ("block_attnres", {"block_size": 1}),
    ("rd_attnres", {"parent": "full"}),
    ("dar", {"block_size": 3}), ("dar", {"key_source": "value"}),
    ("dar", {"addressing": "independent", "write_gate": "fixed"}),
    ("delta_attnres", {"sources": "cumulative"}), ("delta_attnres", {"entropy_bonus": 0.01}),
    ("delta_block", {"block_delta": "intended", "num_blocks": 4}),
    ("denseformer", {"period": 2}), ("denseformer", {"period": 2, "dilation": 2}),
    ("mgr", {"per": "layer"}), ("hyper_connections", {"dynamic": True}),
    ("attnres", {"query_form": "input"}),
]
FOUR_STAGES = ["prenorm", "block_attnres", "mgr", "dar"]


def _build(name: str, options: dict[str, Any]) -> torch.nn.Module:
    model = make_model(name, options, seed=3, n_layers=LAYERS)
    perturb_pathway(model, 0.3)
    return model


def _compare(model: torch.nn.Module, ref: dict[str, torch.Tensor], mine: set[int]) -> float:
    """The largest ||g - g_ref|| / (RTOL ||g_ref|| + FLOOR ||G_ref||) over the parameters of this stage, G_ref
    the whole model's reference gradient (<= 1 passes)."""
    worst, total = 0.0, torch.cat([g.flatten() for g in ref.values()]).norm().item()
    for name, p in model.named_parameters():
        if id(p) not in mine:
            continue
        g = torch.zeros_like(p) if p.grad is None else p.grad
        r = ref.get(name, torch.zeros_like(p))
        worst = max(worst, ((g - r).norm() / (RTOL * r.norm() + FLOOR * total)).item())
    return worst


def _case(name: str, options: dict[str, Any], schedule: str, stages: int) -> dict[str, Any]:
    """One case on this rank: the one-process reference, then the pipelined step on the same batch."""
    from reslab.models.pipeline import Pipeline, declared_bytes

    model = _build(name, options)
    idx, targets = tokens(BATCH, SEQ, seed=1), tokens(BATCH, SEQ, seed=2)
    out, ref = reference_step(model, idx, targets)
    opts = PipelineOptions(stages=stages, schedule=schedule, microbatches=stages)  # type: ignore[arg-type]
    pipe = Pipeline(model, opts)
    result = pipe.step(idx, targets)
    # the loss a step reports is the LM loss alone (the auxiliary term is trained on, not reported)
    return {"case": f"{name} {options} {schedule}", "loss": result.loss, "ref_loss": out.loss.item(),
            "grad": _compare(model, ref, {id(p) for p in pipe.parameters()}), "fwd": result.bytes_fwd,
            "bwd": result.bytes_bwd, "declared": declared_bytes(model, opts, (BATCH, SEQ))}


def _rank(rank: int, world: int, root: str, jobs: list[tuple[Any, tuple]]) -> None:
    """This rank of a gloo group of `world`: each job `fn(*args, world)` in turn, its results to rank-<r>.json."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    out = []
    try:
        for fn, args in jobs:
            try:
                out.append(fn(*args, world))
            except Exception as err:  # name the case: the spawn reports only the traceback
                raise RuntimeError(f"rank {rank}, {fn.__name__}{args}: {err}") from err
    finally:
        dist.destroy_process_group()
    Path(f"{root}/rank-{rank}.json").write_text(json.dumps(out))


def _on_ranks(tmp_path: Path, world: int, jobs: list[tuple[Any, tuple]]) -> list[list[dict[str, Any]]]:
    torch.multiprocessing.spawn(_rank, args=(world, str(tmp_path), jobs), nprocs=world, join=True)
    return [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(world)]


def _spawn(tmp_path: Path, world: int, cases: list[tuple[str, dict[str, Any]]]) -> list[list[dict[str, Any]]]:
    """Each case under GPipe and 1F1B on `world` stages."""
    return _on_ranks(tmp_path, world, [(_case, (name, options, schedule)) for name, options in cases
                                       for schedule in ("gpipe", "1f1b")])


def _check(ranks: list[list[dict[str, Any]]]) -> None:
    for per_rank in zip(*ranks, strict=True):
        last = per_rank[-1]
        assert last["loss"] == pytest.approx(last["ref_loss"], rel=RTOL), last["case"]
        for r, res in enumerate(per_rank):
            assert res["grad"] <= 1.0, f"{res['case']}: stage {r}'s gradients off by {res['grad']} x tolerance"
        assert last["fwd"] == last["declared"], f"{last['case']}: sent forward {last['fwd']}, declared " \
                                                f"{last['declared']}"
        assert last["bwd"] == last["declared"], f"{last['case']}: sent backward {last['bwd']}"


FAST = [("prenorm", {}), ("block_attnres", {"block_size": 3}), ("mgr", {})]


def test_two_stages_equal_one_process_fast_tier(tmp_path):
    """Three cases in the fast tier: one stream, blocks with a partial block at the boundary, a state the
    receiver rebuilds (MGR's pooled read)."""
    _check(_spawn(tmp_path, 2, FAST))


@pytest.mark.slow
def test_two_stages_equal_one_process_and_bytes_equal_declarations(tmp_path):
    cases = [case for case in CASES if case not in FAST]
    ranks = _spawn(tmp_path, 2, cases)
    assert len(ranks[0]) == 2 * len(cases)
    _check(ranks)


@pytest.mark.slow
def test_four_stages_equal_one_process(tmp_path):
    _check(_spawn(tmp_path, 4, [(name, {}) for name in FOUR_STAGES]))


def _virtual_case(name: str, schedule: str, cache: bool, ranks: int) -> dict[str, Any]:
    """Two SGD steps of `ranks` ranks x 2 virtual stages against two one-process SGD steps of an identical model:
    the losses, the first step's gradients and the final weights of this rank's parameters, and the bytes."""
    from reslab.models.pipeline import Pipeline

    model, ref_model = _build(name, {}), _build(name, {})
    idx, targets = tokens(BATCH, SEQ, seed=1), tokens(BATCH, SEQ, seed=2)
    ref_opt, ref_losses, ref = torch.optim.SGD(ref_model.parameters(), lr=LR), [], {}
    for step in range(2):
        out = ref_model(idx, targets)
        loss = out.loss if out.aux_loss is None else out.loss + out.aux_loss
        loss.backward()
        if step == 0:
            ref = {n: p.grad.clone() for n, p in ref_model.named_parameters() if p.grad is not None}
        ref_losses.append(loss.item())
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    opts = PipelineOptions(stages=ranks, schedule=schedule, microbatches=BATCH,  # type: ignore[arg-type]
                           virtual_stages=2, cross_stage_cache=cache)
    pipe = Pipeline(model, opts)
    mine = {id(p) for p in pipe.parameters()}
    opt, results, grad = torch.optim.SGD(pipe.parameters(), lr=LR), [], 0.0
    for step in range(2):
        results.append(pipe.step(idx, targets))
        if step == 0:
            grad = _compare(model, ref, mine)
        opt.step()
        opt.zero_grad(set_to_none=True)
    weights = max(((p - r).norm() / (RTOL * r.norm())).item() for p, r in
                  zip(model.parameters(), ref_model.parameters(), strict=True) if id(p) in mine)
    return {"case": f"{name} V=2 {schedule} cache={cache}", "losses": [r.loss for r in results],
            "ref_losses": ref_losses, "grad": grad, "weights": weights, "fwd": results[0].bytes_fwd,
            "bwd": results[0].bytes_bwd, "declared": declared_bytes(model, opts, (BATCH, SEQ)),
            "uncached": declared_bytes(model, dataclasses.replace(opts, cross_stage_cache=False), (BATCH, SEQ))}


VIRTUAL = [(name, schedule, cache) for name in ("prenorm", "attnres", "block_attnres")
           for schedule in ("1f1b", "gpipe") for cache in (False, True)]
VIRTUAL_FAST = [("block_attnres", "1f1b", True), ("attnres", "gpipe", True), ("prenorm", "1f1b", True)]


def _check_virtual(ranks: list[list[dict[str, Any]]]) -> None:
    for per_rank in zip(*ranks, strict=True):
        last = per_rank[-1]
        assert last["losses"] == pytest.approx(last["ref_losses"], rel=RTOL), last["case"]
        for r, res in enumerate(per_rank):
            assert res["grad"] <= 1.0, f"{res['case']}: rank {r}'s gradients off by {res['grad']} x tolerance"
            assert res["weights"] <= 1.0, f"{res['case']}: rank {r}'s weights off by {res['weights']} x tolerance"
        assert last["fwd"] == last["declared"], f"{last['case']}: sent {last['fwd']}, declared {last['declared']}"
        assert last["bwd"] == last["declared"], f"{last['case']}: sent backward {last['bwd']}"
        cached, whole = sum(last["fwd"]), sum(last["uncached"])
        if "cache=True" in last["case"] and "prenorm" not in last["case"]:
            assert cached < whole, f"{last['case']}: the cache saved nothing ({cached} bytes of {whole})"
        else:
            assert cached == whole, last["case"]


@pytest.mark.parametrize("cases", [
    pytest.param(VIRTUAL_FAST, id="fast"),
    pytest.param([c for c in VIRTUAL if c not in VIRTUAL_FAST], id="rest", marks=pytest.mark.slow),
])
def test_virtual_stages_with_and_without_cache_equal_one_process(tmp_path, cases):
    """2 ranks x 2 virtual stages (one layer each; Interleaved 1F1B and LoopedBFS, 4 micro-batches), Kimi's
    cross-stage caching off and on: the losses of two SGD steps, the first step's gradients and the final
    weights equal two one-process steps within 1e-5 relative (float32), and the bytes counted at the send calls
    equal the declaration both ways, less than without the cache for Full and Block AttnRes (blocks of 4
    sublayers: a block completes on every other stage, the partial sum crosses the others), the same for
    prenorm (its state is rewritten at every site: nothing is held, the cache is a no-op)."""
    _check_virtual(_on_ranks(tmp_path, 2, [(_virtual_case, case) for case in cases]))


def test_declared_bytes_grow_with_what_the_variant_keeps():
    """The declarations at the gpt2-like split of 4 layers into 2 stages, by hand: prenorm one stream, Full
    AttnRes the 5 sources before site 4, Block AttnRes (blocks of 4) e and one block, MGR its 4 streams."""
    d = 32
    expect = {"prenorm": d, "attnres": 5 * d, "block_attnres": 2 * d, "mgr": 4 * d, "mhc": 4 * d}
    for name, elems in expect.items():
        assert _build(name, {}).pathway.stage_state_elems(4) == (elems, 0), name


def test_stage_split_is_by_layers():
    assert [list(r) for r in stage_sites(5, 2)] == [list(range(6)), list(range(6, 10))]
    assert boundaries(4, 4) == [2, 4, 6]


@pytest.mark.parametrize(("options", "batch", "field"), [
    (PipelineOptions(stages=5), None, "pipeline.stages"),
    (PipelineOptions(stages=0), None, "pipeline.stages"),
    (PipelineOptions(stages=2, microbatches=3), 4, "pipeline.microbatches"),
    (PipelineOptions(stages=2, schedule="zb"), None, "pipeline.schedule"),  # type: ignore[arg-type]
])
def test_bad_split_is_one_line(options, batch, field):
    with pytest.raises(ConfigError) as err:
        check_pipeline(_build("prenorm", {}), options, batch)
    assert str(err.value).startswith(field) and "\n" not in str(err.value)


def test_a_state_that_cannot_cross_says_why():
    """The kernels' depth history is one buffer written in place: refused, naming the field."""
    model = make_model("attnres", seed=0, n_layers=LAYERS)
    model.pathway.impl = "triton"
    with pytest.raises(ConfigError, match=r"^residual\.impl: 'triton' .*allowed: 'reference'") as err:
        check_pipeline(model, PipelineOptions(stages=2))
    assert "\n" not in str(err.value)


def test_moe_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^model\.moe: ") as err:
        check_pipeline(make_model("prenorm", preset="tiny-moe", n_layers=LAYERS), PipelineOptions(stages=2))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("name", "options"), [
    ("attnres", {}), ("block_attnres", {}), ("block_attnres", {"block_size": 3}), ("mhar", {}),
    ("rd_attnres", {"parent": "full"}), ("rd_attnres", {}), ("depth_swa", {}),
])
def test_cached_declaration_is_what_the_receiver_does_not_hold(name, options):
    """Kimi's cross-stage caching, brute force over the real states of one forward (no stages): at every pair
    held < site of layer boundaries, what crosses with caching is every tensor of the state before `site` that
    the state before `held` (what the receiving rank kept) does not hold, the same tensor object."""
    model = make_model(name, options, seed=0, n_layers=6)
    steps = trace(model, tokens(2, 8))
    d, n_sites = model.shape.d_model, model.shape.n_sites
    per_token = 2 * 8
    for held in range(2, n_sites, 2):
        kept = {id(t) for t in flatten_state(steps[held - 1][3])}
        for site in range(held + 2, n_sites, 2):
            new = [t for t in flatten_state(steps[site - 1][3]) if id(t) not in kept]
            assert all(t.shape[-1] == d for t in new)
            elems = sum(t.numel() for t in new) // per_token
            assert model.pathway.stage_state_elems(site, held) == (elems, 0), (name, options, held, site)


def test_caching_changes_only_what_only_appends():
    """A variant whose state is rewritten at every site (one stream, several streams) sends it whole."""
    for name in ("prenorm", "mgr", "mhc", "dar", "denseformer"):
        pathway = _build(name, {}).pathway
        assert pathway.stage_state_elems(6, held=2) == pathway.stage_state_elems(6), name


def test_declared_cached_bytes_on_an_interleaved_layout():
    """Block AttnRes (blocks of 4 sublayers = 2 layers) at 8 layers in 4 stages on 2 ranks (2 virtual stages
    each, stage k on rank k mod 2), by hand: boundaries before sites 4, 8, 12; uncached they carry e + 1, 2, 3
    blocks; cached, the rank entering stage 2 (site 8) kept e and block 1 from stage 0 (held = site 4) and
    needs block 2 only; entering stage 3 (site 12) it kept e, blocks 1-2 (held = site 8), and needs block 3."""
    model = make_model("block_attnres", {"block_size": 4}, seed=0, n_layers=8)
    opts = PipelineOptions(stages=2, microbatches=2, virtual_stages=2)
    tokens_bytes = 4 * 8 * 4 * model.shape.d_model          # batch 4 x seq 8 tokens, float32
    assert declared_bytes(model, opts, (4, 8)) == [2 * tokens_bytes, 3 * tokens_bytes, 4 * tokens_bytes]
    assert declared_bytes(model, PipelineOptions(stages=4, microbatches=2), (4, 8)) == declared_bytes(
        model, opts, (4, 8))
    cached = dataclasses.replace(opts, cross_stage_cache=True)
    assert declared_bytes(model, cached, (4, 8)) == [2 * tokens_bytes, tokens_bytes, tokens_bytes]


@pytest.mark.parametrize(("options", "field"), [
    (PipelineOptions(stages=2, virtual_stages=3), "pipeline.virtual_stages: 2 stages x 3"),
    (PipelineOptions(stages=1, virtual_stages=2), "pipeline.virtual_stages: 2 virtual stages on 1 rank"),
    (PipelineOptions(stages=2, cross_stage_cache=True), "pipeline.cross_stage_cache: caching needs"),
    (PipelineOptions(stages=2, virtual_stages=2, schedule="1f1b", microbatches=5), "pipeline.microbatches: 5"),
])
def test_bad_virtual_stages_are_one_line(options, field):
    with pytest.raises(ConfigError) as err:
        check_pipeline(_build("block_attnres", {}), options)
    assert str(err.value).startswith(field) and "\n" not in str(err.value)


def test_cache_is_refused_for_a_state_declared_whole():
    """DAR's state shares the embedding across every site (a rank would hold it), but DAR declares its state
    whole at every boundary: caching would send less than declared, so it is refused, naming the variant.
    Interleaved 1F1B takes 4 micro-batches on 2 ranks (2 rounds of 2); LoopedBFS any."""
    opts = PipelineOptions(stages=2, virtual_stages=2, cross_stage_cache=True, microbatches=4, schedule="1f1b")
    with pytest.raises(ConfigError, match=r"^pipeline\.cross_stage_cache: dar's state") as err:
        check_pipeline(_build("dar", {}), opts)
    assert "\n" not in str(err.value)
    for name in ("prenorm", "attnres", "block_attnres", "mgr"):
        check_pipeline(_build(name, {}), opts)
    check_pipeline(_build("prenorm", {}), dataclasses.replace(opts, schedule="gpipe", microbatches=5))
