"""Issue 10 item 3: effective depth from the debiased CKA, and routing concentration over
multi-source sites (`models.diagnostics`)."""

from __future__ import annotations

import math

import pytest
import torch

from reslab.models.backbone import build_model
from reslab.models.cka import linear_cka_matrix
from reslab.models.config import ConfigError, ModelConfig, ResidualConfig, RunConfig, TrainConfig
from reslab.models.diagnostics import (
    collect_diagnostics,
    concentration,
    effective_depth,
    effective_depth_of_model,
    routing_diagnostics,
)
from reslab.models.resolve import validate_run_config

VOCAB = 64
SMALL = dict(preset="tiny", d_model=32, n_layers=3, n_heads=2, ffn_hidden=64, seq_len=16)


def hsic_unbiased(x: torch.Tensor, y: torch.Tensor) -> float:
    """Song et al. (2012), eq. (5), on the UNcentred linear Grams, written from the paper."""
    n = x.shape[0]
    k, l_ = x @ x.T, y @ y.T
    k = k - torch.diag(k.diagonal())
    l_ = l_ - torch.diag(l_.diagonal())
    ones = torch.ones(n, dtype=torch.float64)
    term = torch.trace(k @ l_) + (ones @ k @ ones) * (ones @ l_ @ ones) / ((n - 1) * (n - 2))
    term = term - 2.0 / (n - 2) * (ones @ k @ l_ @ ones)
    return float(term / (n * (n - 3)))


def orthogonal_updates(num_layers: int, n: int, d: int, seed: int) -> torch.Tensor:
    """[L, N, d] isotropic Gaussian updates made exactly orthogonal to each other (Frobenius inner
    product 0 after column centring) and of equal norm: the setting of F_L (variants.md 10.2)."""
    x = torch.randn(num_layers, n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    x = x - x.mean(1, keepdim=True)
    q, _ = torch.linalg.qr(x.reshape(num_layers, n * d).T)                        # [N*d, L]
    return (q.T * math.sqrt(n * d)).reshape(num_layers, n, d)


@pytest.mark.parametrize("n, d", [(9, 40), (40, 5)], ids=["gram-form-d>N", "cov-form-d<N"])
def test_debiased_cka_is_the_unbiased_hsic_ratio(n, d):
    gen = torch.Generator().manual_seed(11)
    base = torch.randn(n, d, generator=gen, dtype=torch.float64)
    # a column shift on some layers: HSIC_1 is shift invariant, the implementation centres first
    features = [base * (k + 1) + k * torch.randn(n, d, generator=gen, dtype=torch.float64) + 3.0 * k
                for k in range(4)]
    cka = linear_cka_matrix(features)
    for i, a in enumerate(features):
        for j, b in enumerate(features):
            want = hsic_unbiased(a, b) / math.sqrt(hsic_unbiased(a, a) * hsic_unbiased(b, b))
            assert float(cka[i, j]) == pytest.approx(want, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_orthogonal_updates_at_the_default_passage_count_give_f_l(seed):
    # the case: the default passage count at d=768, L=12; the plug-in estimator reads
    # ~1.04 here (the D_eff "gap" of every smoke run was this bias), the debiased one F_L within 5%
    num_layers, d = 12, 768
    passages = TrainConfig().deff_passages
    layers = list(orthogonal_updates(num_layers, passages, d, seed).cumsum(0))
    f_l = 2 * num_layers / (num_layers + 1)
    debiased = effective_depth(linear_cka_matrix(layers))
    assert debiased["d_eff"] == pytest.approx(f_l, rel=0.05)
    biased = effective_depth(linear_cka_matrix(layers, debiased=False))
    assert biased["d_eff"] < 1.1


def test_debiased_cka_of_identical_layers_is_one_and_needs_four_rows():
    h = torch.randn(8, 20, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    assert effective_depth(linear_cka_matrix([h] * 5))["d_eff"] == pytest.approx(1.0, abs=1e-12)
    with pytest.raises(ValueError, match="at least 4 rows"):
        linear_cka_matrix([h[:3], h[:3]])
    assert linear_cka_matrix([h[:3], h[:3]], debiased=False).shape == (2, 2)


def make(name: str, options: dict | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig(**SMALL), ResidualConfig(name=name, options=options or {}), vocab_size=VOCAB)


def tokens(batch: int = 4) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SMALL["seq_len"]), generator=torch.Generator().manual_seed(5))


def test_effective_depth_of_model_logs_its_estimator():
    model = make("prenorm")
    out = effective_depth_of_model(model, [tokens(6)])
    assert out["cka_estimator"] == "debiased" and out["passages"] == 6
    plug_in = effective_depth_of_model(model, [tokens(6)], debiased=False)
    assert plug_in["cka_estimator"] == "biased" and plug_in["d_eff"] != out["d_eff"]


def test_concentration_is_normalised_entropy():
    assert concentration(math.log(5), 5) == pytest.approx(0.0)
    assert concentration(0.0, 5) == pytest.approx(1.0)
    assert concentration(0.5 * math.log(3), 3) == pytest.approx(0.5)
    assert concentration(0.0, 1) is None


def test_routing_summary_excludes_one_source_sites():
    # attnres site 0 reads the embedding alone (weight 1): the old mean max weight counted it as
    # a perfectly concentrated site. Zero queries read every multi-source site uniformly.
    routing = routing_diagnostics(make("attnres"), tokens())
    first = routing["sites"][0]
    assert first["site"] == 0 and first["sources"] == 1 and first["concentration"] is None
    multi = [s for s in routing["sites"] if s["sources"] > 1]
    assert len(multi) == len(routing["sites"]) - 1
    assert routing["concentration_mean"] == pytest.approx(0.0, abs=1e-6)
    assert routing["max_weight_mean"] == pytest.approx(sum(1 / s["sources"] for s in multi) / len(multi), rel=1e-5)
    profile = routing["concentration_by_layer"]
    assert len(profile) == SMALL["n_layers"] + 1 and all(v == pytest.approx(0.0, abs=1e-6) for v in profile)


def test_routing_concentration_sees_a_sharpened_router():
    model = make("attnres", {"query_init": "normal", "query_init_std": 3.0})
    routing = routing_diagnostics(model, tokens())
    by_site = {s["site"]: s for s in routing["sites"]}
    for s in by_site.values():
        if s["sources"] > 1:
            assert s["concentration"] == pytest.approx(1 - s["entropy"] / math.log(s["sources"]))
            assert 0.0 < s["concentration"] <= 1.0
    assert routing["concentration_mean"] > 0.05
    _, scalars = collect_diagnostics(model, [(tokens(), tokens())], deff_passages=4)
    assert scalars["routing_concentration"] == pytest.approx(routing["concentration_mean"], rel=1e-9)


def test_deff_passages_is_validated():
    with pytest.raises(ConfigError, match=r"train\.deff_passages: must be >= 4"):
        validate_run_config(RunConfig(train=TrainConfig(deff_passages=3)))
