"""The backbone and the first three pathways: Block AttnRes against Full AttnRes and prenorm, the depth read's
gradcheck and softmax, parameter counts, routing records, knob errors, one history dtype under autocast.
Causality, gradient reach, backbone init and each variant's identities are test_variant_contract.py."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from variant_testing import SMALL, tokens
from variant_testing import make_model as make

from reslab.kernels.depth_read import depth_read_reference


def test_block_size_one_is_full_attnres(float64):
    idx = tokens()
    full = make("attnres", options={"query_init": "normal", "query_init_std": 0.5})
    block = make("block_attnres", options={"block_size": 1})
    block.load_state_dict(full.state_dict())
    assert torch.equal(full(idx).logits, block(idx).logits)


def test_zero_query_gradient_flows_to_query():
    model = make("attnres")
    idx = tokens()
    model(idx, idx).loss.backward()
    assert model.pathway.queries.grad.abs().sum() > 0


@pytest.mark.parametrize("heads", [1, 2, 4])
def test_depth_read_gradcheck(heads):
    g = torch.Generator().manual_seed(0)
    n, b, t, d = 3, 2, 3, 8
    values = torch.randn(n, b, t, d, dtype=torch.float64, generator=g, requires_grad=True)
    keys = torch.randn(n, b, t, d, dtype=torch.float64, generator=g, requires_grad=True)
    query = torch.randn(d, dtype=torch.float64, generator=g, requires_grad=True)
    gain = (1 + 0.1 * torch.randn(d, dtype=torch.float64, generator=g)).requires_grad_()
    residual = torch.randn(b, t, d, dtype=torch.float64, generator=g, requires_grad=True)

    def fn(values, query, gain, keys, residual):
        return depth_read_reference(values, query, gain, heads=heads, keys=keys, residual=residual)

    assert torch.autograd.gradcheck(fn, (values, query, gain, keys, residual))
    assert torch.autograd.gradcheck(lambda v, q, g_: depth_read_reference(v, q, g_, heads=heads), (values, query, gain))


def test_depth_read_weights_are_a_softmax_over_depth():
    values = torch.randn(5, 2, 3, 8)
    out, w = depth_read_reference(values, torch.randn(8), torch.ones(8), heads=2)
    assert w.shape == (5, 2, 3, 2)
    torch.testing.assert_close(w.sum(0), torch.ones(2, 3, 2))
    zero_q_out, _ = depth_read_reference(values, torch.zeros(8), torch.ones(8))
    torch.testing.assert_close(zero_q_out, values.mean(0))


def test_attnres_parameter_count_matches_paper():
    # Kimi: a query and a key gain per sublayer, 4d per layer, plus 2d for the readout
    for name in ("attnres", "block_attnres"):
        model = make(name)
        d, layers = SMALL["d_model"], SMALL["n_layers"]
        assert model.pathway.extra_params() == 4 * d * layers + 2 * d
        assert model.param_counts()["residual"] == 4 * d * layers + 2 * d
    assert make("prenorm").pathway.extra_params() == 0


def test_block_sources_partition_the_stream(float64):
    # completed blocks + partial sum to e + sum f_i; with zero queries the f_i are prenorm's, so the
    # per-layer streams must equal prenorm's running stream
    idx = tokens()
    prenorm = make("prenorm", norm_eps=1e-30)
    block = make("block_attnres", options={"block_size": 3}, norm_eps=1e-30)
    block.load_state_dict(prenorm.state_dict(), strict=False)
    for a, b in zip(block.layer_streams(idx), prenorm.layer_streams(idx), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_routing_diagnostics_shape():
    model = make("block_attnres", options={"block_size": 2})
    rec = model.routing_stats(tokens())
    sites = sorted(site for site, _ in rec.sites)
    assert sites == list(range(2 * SMALL["n_layers"] + 1))
    for stats in rec.sites.values():
        assert abs(stats.weights.sum().item() - 1) < 1e-5
        assert 0 <= stats.entropy <= torch.log(torch.tensor(float(len(stats.weights)))).item() + 1e-6


def test_unknown_variant_and_knob_errors():
    from reslab.models.config import ConfigError

    with pytest.raises(ConfigError, match="unknown residual variant 'nope'.*allowed: .*attnres"):
        make("nope")
    with pytest.raises(ConfigError, match="unknown key.*'blocksize' \\(did you mean 'block_size'\\?\\).*allowed: "):
        make("block_attnres", options={"blocksize": 2})
    with pytest.raises(ConfigError, match="unknown residual variant 'blok_attnres' \\(did you mean 'block_attnres'"):
        make("blok_attnres")
    from reslab.models.config import RunConfig, load

    with pytest.raises(ConfigError, match="config.train: unknown key\\(s\\) 'stepz' \\(did you mean 'steps'\\?\\)"):
        load(RunConfig, {"train": {"stepz": 2}})
    with pytest.raises(ConfigError, match="block_size must be >= 1"):
        make("block_attnres", options={"block_size": 0})


@pytest.mark.parametrize("name", ["attnres", "block_attnres", "rd_attnres", "delta_attnres"])
def test_depth_history_has_one_dtype_under_autocast(name):
    # the fused kernel reads one dtype; under autocast the embedding joins the bf16 history
    model = make(name)
    seen: list[set] = []
    real = model.pathway.sublayer_input

    def spy(state, site):
        sources = getattr(state, "sources", None)
        sources = sources() if callable(sources) else sources if sources is not None else state
        seen.append({s.dtype for s in sources})
        return real(state, site)

    model.pathway.sublayer_input = spy
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(tokens(), tokens())
    assert torch.isfinite(out.loss)
    assert seen and all(dtypes == {torch.bfloat16} for dtypes in seen[1:]), seen


def _reslab_imports(module: str) -> set[str]:
    """Every reslab module `models/<module>.py` imports, at any depth of the file."""
    tree = ast.parse((Path(__file__).resolve().parents[2] / "models" / f"{module}.py").read_text())
    names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    return {name for name in names if name.startswith("reslab")}


def test_config_is_a_leaf_and_diagnostics_import_no_variant():
    # the loader's field rules are a leaf of their own that config reads
    assert _reslab_imports("config") == {"reslab.common.errors", "reslab.models.typed_load"}
    assert _reslab_imports("typed_load") == {"reslab.common.errors"}
    # a variant's own measures reach the diagnostics through `ResidualPathway.diagnostics`; the CKA matrix
    # is a leaf (torch only) that the diagnostics and DAR share
    assert _reslab_imports("diagnostics") <= {"reslab.models.residual.base", "reslab.models.cka",
                                              "reslab.common.errors"}
    assert _reslab_imports("cka") == set()
