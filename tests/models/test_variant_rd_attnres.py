"""RD-AttnRes (`rd_attnres`; arXiv 2608.01075): tied routes are the parent, the V route matters."""

from __future__ import annotations

import math

import pytest
import torch
from variant_testing import SMALL, tokens, train_on
from variant_testing import make_model as make

from reslab.kernels.depth_read import depth_read_reference
from reslab.models.residual.rd_attnres import jensen_shannon, js_divergence

pytestmark = pytest.mark.usefixtures("one_thread")

D, L = SMALL["d_model"], SMALL["n_layers"]


def randomise(param: torch.nn.Parameter, seed: int, std: float = 0.5, mean: float = 0.0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        param.copy_(mean + std * torch.randn(param.shape, generator=gen, dtype=torch.float64).to(param.dtype))


def random_parent(parent: str, options: dict) -> torch.nn.Module:
    base = make(parent, options)
    randomise(base.pathway.queries, 5)
    randomise(base.pathway.key_gains, 6, std=0.3, mean=1.0)
    return base


PARENTS = [
    ("block_attnres", {"block_size": 2}, {"block_size": 2}),
    ("block_attnres", {"block_size": 4}, {"block_size": 4}),
    ("attnres", {}, {"parent": "full"}),
]


@pytest.mark.parametrize("parent,parent_opts,rd_opts", PARENTS)
def test_tied_route_is_the_parent_exactly(float64, parent, parent_opts, rd_opts):
    idx = tokens()
    base = random_parent(parent, parent_opts)
    rd = make("rd_attnres", {**rd_opts, "value_route": "tied"})
    rd.load_state_dict(base.state_dict())
    assert torch.equal(rd(idx).logits, base(idx).logits)


@pytest.mark.parametrize("value_key_norm", ["shared", "separate"])
@pytest.mark.parametrize("parent,parent_opts,rd_opts", PARENTS)
def test_learned_route_with_the_qk_query_is_the_parent(float64, parent, parent_opts, rd_opts, value_key_norm):
    idx = tokens()
    base = random_parent(parent, parent_opts)
    rd = make("rd_attnres", {**rd_opts, "value_key_norm": value_key_norm})
    missing, unexpected = rd.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"pathway.value_queries", "pathway.value_key_gains"}
    with torch.no_grad():
        rd.pathway.value_queries.copy_(base.pathway.queries[0 : 2 * L : 2])
        if value_key_norm == "separate":
            rd.pathway.value_key_gains.copy_(base.pathway.key_gains[0 : 2 * L : 2])
    diff = (rd(idx).logits - base(idx).logits).abs().max().item()
    assert diff <= 1e-12, diff
    # a different V query changes the function: the V route really feeds the value projection
    randomise(rd.pathway.value_queries, 9)
    assert (rd(idx).logits - base(idx).logits).abs().max().item() > 1e-4


def test_fixed_route_differs_from_the_parent(float64):
    idx = tokens()
    base = random_parent("block_attnres", {"block_size": 2})
    rd = make("rd_attnres", {"block_size": 2, "value_route": "fixed"})
    rd.load_state_dict(base.state_dict())
    assert (rd(idx).logits - base(idx).logits).abs().max().item() > 1e-4


def test_zero_queries_start_as_the_parent(float64):
    idx = tokens()
    base = make("block_attnres")
    rd = make("rd_attnres")
    rd.load_state_dict(base.state_dict(), strict=False)
    assert (rd(idx).logits - base(idx).logits).abs().max().item() <= 1e-12


@pytest.mark.parametrize("options,extra_per_layer", [
    ({}, 1), ({"value_key_norm": "separate"}, 2), ({"value_route": "tied"}, 0),
    ({"value_route": "fixed"}, 0), ({"parent": "full"}, 1), ({"block_size": 2, "readout": False}, 1),
])
def test_extra_params(options, extra_per_layer):
    parent_opts = {k: v for k, v in options.items() if k in ("block_size", "readout")}
    parent = make("block_attnres", parent_opts).pathway.extra_params()
    assert parent == 4 * D * L + (2 * D if options.get("readout", True) else 0)
    assert make("rd_attnres", options).pathway.extra_params() == parent + extra_per_layer * D * L


def test_value_input_is_the_v_route():
    model = make("rd_attnres", {"block_size": 4, "query_init": "normal", "query_init_std": 0.5})
    randomise(model.pathway.value_queries, 3)
    pathway = model.pathway
    gen = torch.Generator().manual_seed(2)
    state = pathway.start(torch.randn(2, 5, D, generator=gen))
    for site in (0, 1):
        state = pathway.update(pathway.prepare(state, site), site, torch.randn(2, 5, D, generator=gen))
    state = pathway.prepare(state, 2)
    x = pathway.sublayer_input(state, 2)
    xv = pathway.value_input(state, 2)
    sources = torch.stack(state.sources())                                              # [2, B, T, D]
    eps = pathway.shape.norm_eps
    expected_x, _ = depth_read_reference(sources, pathway.queries[2], pathway.key_gains[2], eps=eps)
    expected_v, _ = depth_read_reference(sources, pathway.value_queries[1], pathway.key_gains[2], eps=eps)
    # stream_scale: both routes are multiplied by the number of sources
    assert torch.allclose(x, 2 * expected_x) and torch.allclose(xv, 2 * expected_v)
    assert not torch.allclose(x, xv)
    assert pathway.value_input(pathway.prepare(state, 3), 3) is None


def test_routes_recorded_and_js_divergence():
    idx = tokens()
    tied = make("rd_attnres", {"value_route": "tied", "query_init": "normal", "query_init_std": 0.5})
    rec = tied.routing_stats(idx)
    attention_sites = list(range(0, 2 * L, 2))
    assert sorted(k for k in rec.sites if k[1] == "qk") == [(s, "qk") for s in attention_sites]
    assert sorted(k for k in rec.sites if k[1] == "v") == [(s, "v") for s in attention_sites]
    assert sorted(k for k in rec.sites if k[1] == "") == [(s, "") for s in range(1, 2 * L, 2)] + [(2 * L, "")]
    assert all(v == 0.0 for v in js_divergence(rec).values())

    learned = make("rd_attnres", {"query_init": "normal", "query_init_std": 0.5})
    randomise(learned.pathway.value_queries, 4, std=2.0)
    div = js_divergence(learned.routing_stats(idx))
    assert sorted(div) == attention_sites
    # site 0 reads a single source (the embedding): both routes are the point mass
    assert div[0] == 0.0 and all(0 < div[s] <= math.log(2) for s in attention_sites[1:])

    fixed = make("rd_attnres", {"value_route": "fixed", "query_init": "normal", "query_init_std": 0.5})
    rec = fixed.routing_stats(idx)
    assert torch.allclose(rec.sites[(2, "v")].weights, torch.full((2,), 0.5))


def test_jensen_shannon_bounds():
    p = torch.tensor([1.0, 0.0, 0.0])
    q = torch.tensor([0.0, 0.5, 0.5])
    assert math.isclose(float(jensen_shannon(p, q)), math.log(2), rel_tol=1e-6)
    assert float(jensen_shannon(p, p)) == 0.0
    w = torch.softmax(torch.randn(4, 3, 5), 0)
    assert jensen_shannon(w, w.flip(1), dim=0).shape == (3, 5)


def test_zero_value_query_gets_a_gradient():
    model = make("rd_attnres")
    idx = tokens()
    model(idx, idx).loss.backward()
    assert model.pathway.value_queries.grad[1:].abs().sum() > 0


def test_training_lowers_the_loss():
    model = make("rd_attnres", {"block_size": 2})
    idx = tokens(b=4, t=16, seed=3)
    losses = train_on(model, idx, idx, 30, lr=3e-3)
    assert losses[-1] < losses[0] - 0.5, (losses[0], losses[-1])
    # the V queries left the QK queries: the routes decoupled during training
    assert not torch.allclose(model.pathway.value_queries, model.pathway.queries[0 : 2 * L : 2])
