"""MHAR (`mhar`, `block_mhar`; arXiv 2607.27230): H=1 is AttnRes, same parameters, heads matter."""

from __future__ import annotations

import pytest
import torch

from models.backbone import build_model
from models.config import ConfigError, ModelConfig, ResidualConfig

VOCAB = 64
SMALL = dict(preset="tiny", d_model=32, n_layers=3, n_heads=2, ffn_hidden=64, seq_len=16)
PAIRS = [("mhar", "attnres", {}), ("block_mhar", "block_attnres", {"block_size": 2})]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # tiny ops: intra-op threads only add spin-waiting, which dominates on a loaded 2-core box
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture
def float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def make(name: str, options: dict | None = None, seed: int = 0, **model) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(ModelConfig(**{**SMALL, **model}), ResidualConfig(name=name, options=options or {}),
                       vocab_size=VOCAB)


def tokens(b: int = 2, t: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def randomise_queries(model: torch.nn.Module, seed: int = 5, std: float = 0.5) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        q = model.pathway.queries
        q.copy_(torch.randn(q.shape, generator=gen, dtype=torch.float64).to(q.dtype) * std)
        g = model.pathway.key_gains
        g.copy_(1 + 0.3 * torch.randn(g.shape, generator=gen, dtype=torch.float64).to(g.dtype))


@pytest.mark.parametrize("name,parent,options", PAIRS)
def test_one_head_is_the_parent_exactly(float64, name, parent, options):
    idx = tokens()
    base = make(parent, options)
    randomise_queries(base)
    mh = make(name, {**options, "heads": 1})
    mh.load_state_dict(base.state_dict())
    assert torch.equal(mh(idx).logits, base(idx).logits)


@pytest.mark.parametrize("name,parent,options", PAIRS)
def test_heads_change_the_function(float64, name, parent, options):
    idx = tokens()
    outs = []
    for heads in (1, 2, 4):
        model = make(name, {**options, "heads": heads})
        randomise_queries(model)
        outs.append(model(idx).logits)
    assert not torch.allclose(outs[0], outs[1], atol=1e-6)
    assert not torch.allclose(outs[1], outs[2], atol=1e-6)


@pytest.mark.parametrize("name,parent,options", PAIRS)
def test_extra_params_equal_attnres(name, parent, options):
    d, n_layers = SMALL["d_model"], SMALL["n_layers"]
    for heads in (1, 4, 8):
        model = make(name, {**options, "heads": heads})
        assert model.pathway.extra_params() == make(parent, options).pathway.extra_params()
        assert model.pathway.extra_params() == 4 * d * n_layers + 2 * d
        assert model.pathway.queries.shape == (2 * n_layers + 1, d)


@pytest.mark.parametrize("name", ["mhar", "block_mhar"])
def test_heads_must_divide_width(name):
    with pytest.raises(ConfigError, match="not divisible by heads=5"):
        make(name, {"heads": 5})
    with pytest.raises(ConfigError, match="heads must be >= 1"):
        make(name, {"heads": 0})


@pytest.mark.parametrize("name,options", [("mhar", {}), ("block_mhar", {"block_size": 2}),
                                          ("block_mhar", {"block_size": 4})])
def test_zero_queries_compute_prenorm(float64, name, options):
    # every head's read is uniform, i.e. the stream / N on its slice; RMSNorm is scale-invariant
    idx = tokens()
    base = make("prenorm", norm_eps=1e-30)
    model = make(name, {**options, "heads": 8}, norm_eps=1e-30)
    model.load_state_dict(base.state_dict(), strict=False)
    diff = (model(idx).logits - base(idx).logits).abs().max().item()
    assert diff < 1e-10, diff


@pytest.mark.parametrize("name", ["mhar", "block_mhar"])
def test_causal_and_gradients(name):
    model = make(name, {"heads": 4})
    randomise_queries(model)
    idx = tokens(t=12)
    for t in (0, 5, 10):
        changed = idx.clone()
        changed[:, t + 1] = (changed[:, t + 1] + 7) % VOCAB
        a, b = model(idx).logits, model(changed).logits
        assert torch.allclose(a[:, : t + 1], b[:, : t + 1], atol=1e-6)
        assert not torch.allclose(a[:, t + 1], b[:, t + 1])
    model(idx, idx).loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, pname


def test_routing_weights_are_recorded_per_head():
    model = make("mhar", {"heads": 4})
    randomise_queries(model)
    recorder = model.routing_stats(tokens())
    n_sites = 2 * SMALL["n_layers"]
    assert sorted(site for site, _ in recorder.sites) == list(range(n_sites + 1))
    readout = recorder.sites[(n_sites, "")]
    assert readout.head_weights.shape == (4, n_sites + 1)
    assert torch.allclose(readout.head_weights.sum(-1), torch.ones(4), atol=1e-5)


@pytest.mark.parametrize("name", ["mhar", "block_mhar"])
def test_training_lowers_the_loss(name):
    model = make(name, {"heads": 4})
    idx = tokens(b=4, t=16, seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(30):
        loss = model(idx, idx).loss
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < first - 0.5, (first, loss.item())
