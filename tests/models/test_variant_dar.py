"""DAR (`dar`; arXiv 2607.18730, reconstruction in variants.md 3): exact 2x2 write, addressing,
block form, the symmetric reduction to AttnRes, parameter count."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from variant_testing import SMALL, VOCAB, tokens, train_on
from variant_testing import make_model as make

from reslab.models.config import ModelConfig
from reslab.models.presets import resolve_model
from reslab.models.residual.dar import DAR, mixing_matrix

pytestmark = pytest.mark.usefixtures("one_thread")

D, L = SMALL["d_model"], SMALL["n_layers"]
ALL_KNOBS = {"mix": "learned", "write_gate_shape": "channel", "cross_mix": "channel", "value_proj": "matrix"}


def backbone_state(model: torch.nn.Module) -> dict:
    return {k: v for k, v in model.state_dict().items() if not k.startswith("pathway.")}


def train(model: torch.nn.Module, steps: int, lr: float = 3e-3) -> list[float]:
    idx = tokens(b=4, t=16, seed=3)
    return train_on(model, idx, idx, steps, lr)


@pytest.mark.parametrize("block_size,n_sources", [(0, 2 * L + 1), (1, 2 * L + 1), (2, L + 1), (4, 3)])
def test_shapes_and_histories(block_size, n_sources):
    model = make("dar", {"block_size": block_size})
    idx = tokens()
    out = model(idx, idx)
    assert out.logits.shape == (2, 16, VOCAB) and torch.isfinite(out.loss)
    state = model.layer_states(idx)[-1]
    for hist in state.streams:
        assert len(hist.sources()) == len(hist.key_states()) == n_sources
        assert hist.state.shape == (2, 16, D)
    assert len(model.layer_streams(idx)) == L


def test_block_size_one_is_per_sublayer(float64):
    idx = tokens()
    a, b = make("dar", {"block_size": 0}), make("dar", {"block_size": 1})
    b.load_state_dict(a.state_dict())
    assert torch.equal(a(idx).logits, b(idx).logits)


def test_mixing_matrix_is_doubly_stochastic(float64):
    theta = torch.cat([torch.linspace(-60, 60, 241), torch.randn(100) * 5, torch.tensor([0.0, 4.0, -4.0])])
    for t in (theta, theta.view(-1, 4)):
        mixing = mixing_matrix(t)
        assert mixing.shape == (*t.shape, 2, 2)
        assert ((mixing >= 0) & (mixing <= 1)).all()
        assert torch.allclose(mixing.sum(-1), torch.ones(()), atol=1e-15)
        assert torch.allclose(mixing.sum(-2), torch.ones(()), atol=1e-15)
        assert torch.equal(mixing, mixing.transpose(-1, -2))
    assert abs(mixing_matrix(torch.tensor(4.0))[0, 0].item() - 0.98201379) < 1e-8


@pytest.mark.parametrize("options", [{}, {"cross_mix": "channel", "write_gate_shape": "channel"},
                                     {"write_gate": "fixed"}])
def test_write_is_the_doubly_stochastic_mix(float64, options):
    shape = resolve_model(ModelConfig(**SMALL), vocab_size=VOCAB)
    pathway = DAR(DAR.Config(**options), shape)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        pathway.cross_logits.copy_(torch.randn(pathway.cross_logits.shape, generator=gen))
        if pathway.gate_logits is not None:
            pathway.gate_logits.copy_(torch.randn(pathway.gate_logits.shape, generator=gen))
    state = pathway.start(torch.randn(2, 5, D, generator=gen))
    r_a, r_b = torch.randn(2, 2, 5, D, generator=gen)
    u = torch.randn(2, 5, D, generator=gen)
    state = dataclasses.replace(state, reads=(r_a, r_b))  # the reads prepare(state, 0) would hold
    new = pathway.update(state, 0, u)
    beta = torch.ones(2) if pathway.gate_logits is None else torch.sigmoid(pathway.gate_logits[0])
    y = torch.stack([r_a + beta[0] * u, r_b + beta[1] * u])                          # [2, B, T, D]
    p = mixing_matrix(pathway.cross_logits[0])                                       # [(D,) 2, 2]
    x = torch.einsum("...st,tbnd->sbnd", p, y) if p.dim() == 2 else torch.einsum("dst,tbnd->sbnd", p, y)
    x_a, x_b = new.streams[0].state, new.streams[1].state
    assert torch.allclose(x_a, x[0], atol=1e-12) and torch.allclose(x_b, x[1], atol=1e-12)
    assert torch.allclose(x_a + x_b, y.sum(0), atol=1e-12)
    # the value written is the state minus the read; the state is paired with it as a key
    assert torch.allclose(new.streams[0].values[-1], x_a - r_a, atol=1e-12)
    assert new.streams[1].states[-1] is x_b


@pytest.mark.parametrize("addressing", ["cross", "self", "independent"])
@pytest.mark.parametrize("parent,options", [("attnres", {}), ("block_attnres", {"block_size": 2})])
def test_symmetric_dar_is_attnres(float64, parent, options, addressing):
    # identical queries for both streams, value keys and fixed gates: the streams are the same
    # stream, each write adds exactly u, and every read is the parent's read
    idx = tokens()
    base = make(parent, options)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        base.pathway.queries.copy_(0.5 * torch.randn(base.pathway.queries.shape, generator=gen))
        base.pathway.key_gains.copy_(1 + 0.3 * torch.randn(base.pathway.key_gains.shape, generator=gen))
    dar = make("dar", {**options, "query_init": "zero", "key_source": "value", "write_gate": "fixed",
                       "addressing": addressing})
    dar.load_state_dict(backbone_state(base), strict=False)
    with torch.no_grad():
        dar.pathway.queries.copy_(base.pathway.queries[:, None].expand(-1, 2, -1))
        dar.pathway.key_gains.copy_(base.pathway.key_gains[:, None].expand(-1, 2, -1))
    diff = (dar(idx).logits - base(idx).logits).abs().max().item()
    assert diff <= 1e-12, diff


def test_zero_queries_keep_the_streams_identical(float64):
    # the literal reconstruction (zero queries) is symmetric under a <-> b: training never
    # separates the streams, and cross addressing is self addressing
    idx = tokens()
    zero = make("dar", {"query_init": "zero"})
    train(zero, 8)
    state = zero.layer_states(idx)[-1]
    assert (state.streams[0].state - state.streams[1].state).abs().max().item() < 1e-12
    assert zero.pathway.cross_stream_similarity(state) == pytest.approx(1.0, abs=1e-12)
    selfkv = make("dar", {"query_init": "zero", "addressing": "self"})
    selfkv.load_state_dict(zero.state_dict())
    assert (selfkv(idx).logits - zero(idx).logits).abs().max().item() < 1e-12

    default = make("dar")
    train(default, 8)
    state = default.layer_states(idx)[-1]
    assert default.pathway.cross_stream_similarity(state) < 1 - 1e-6


def test_self_addressing_differs_from_cross(float64):
    idx = tokens()
    cross = make("dar")
    train(cross, 5)
    state = cross.layer_states(idx)[-1]
    assert (state.streams[0].state - state.streams[1].state).abs().max().item() > 1e-4
    selfkv = make("dar", {"addressing": "self"})
    selfkv.load_state_dict(cross.state_dict())
    assert (selfkv(idx).logits - cross(idx).logits).abs().max().item() > 1e-6
    # state keys and value keys are different addresses too
    values = make("dar", {"key_source": "value"})
    values.load_state_dict(cross.state_dict())
    assert (values(idx).logits - cross(idx).logits).abs().max().item() > 1e-6


def test_cross_stream_similarity_and_stream():
    model = make("dar")
    idx = tokens()
    start = model.pathway.start(model.embed(idx))
    assert model.pathway.cross_stream_similarity(start) == pytest.approx(1.0, abs=1e-6)
    assert torch.equal(model.pathway.stream(start), model.embed(idx))
    state = model.layer_states(idx)[-1]
    sim = model.pathway.cross_stream_similarity(state)
    assert isinstance(sim, float) and -1.0 <= sim < 1.0
    mean = 0.5 * (state.streams[0].state + state.streams[1].state)
    assert torch.equal(model.pathway.stream(state), mean)


def test_routes_recorded_per_stream():
    model = make("dar", {"block_size": 2})
    rec = model.routing_stats(tokens())
    assert sorted(rec.sites) == [(s, r) for s in range(2 * L + 1) for r in ("a", "b")]
    assert rec.sites[(2 * L, "a")].weights.shape == (L + 1,)
    assert not torch.allclose(rec.sites[(2 * L, "a")].weights, rec.sites[(2 * L, "b")].weights)


def expected_params(cfg: DAR.Config, d: int, n_layers: int) -> int:
    n_sites = 2 * n_layers
    n_routes = n_sites + (1 if cfg.readout else 0)
    value_proj = {"none": 0, "channel": 2 * d, "matrix": 2 * d * d}[cfg.value_proj]
    gates = 0 if cfg.write_gate == "fixed" else (2 if cfg.write_gate_shape == "scalar" else 2 * d)
    cross = 0 if cfg.addressing == "independent" else (1 if cfg.cross_mix == "scalar" else d)
    mix = 1 if cfg.mix == "learned" else 0
    return n_routes * (4 * d + value_proj) + n_sites * (gates + cross + mix)


@pytest.mark.parametrize("options", [
    {}, {"block_size": 2}, {"readout": False}, {"write_gate": "fixed"}, {"addressing": "independent"},
    ALL_KNOBS, {"value_proj": "channel", "cross_mix": "channel"},
])
def test_extra_params(options):
    pathway = make("dar", options).pathway
    n = pathway.extra_params()
    assert n == expected_params(pathway.config, D, L)
    assert n >= 8 * D * L
    if not options:
        assert n == L * (8 * D + 6) + 4 * D


def test_query_init_leaves_the_backbone_init_alone():
    prenorm, dar = make("prenorm", seed=3), make("dar", seed=3)
    assert all(torch.equal(v, dar.state_dict()[k]) for k, v in prenorm.state_dict().items())
    # the private generator follows the run seed: same seed, same queries; another seed, others
    assert torch.equal(make("dar", seed=3).pathway.queries, dar.pathway.queries)
    assert not torch.equal(make("dar", seed=4).pathway.queries, dar.pathway.queries)
    q = dar.pathway.queries
    assert not torch.equal(q[:, 0], q[:, 1]) and 0.01 < q.std().item() < 0.03


@pytest.mark.parametrize("options", [{}, {"block_size": 2}])
def test_training_lowers_the_loss(options):
    losses = train(make("dar", options), 30)
    assert losses[-1] < losses[0] - 0.5, (losses[0], losses[-1])
