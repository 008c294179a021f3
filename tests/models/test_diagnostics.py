"""Diagnostics (`models.diagnostics`): CKA and effective-depth identities (variants.md 10), routing
heatmaps, and `collect_diagnostics` on real variants."""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest
import torch
from variant_testing import SMALL, VOCAB
from variant_testing import make_model as make

from reslab.models.cka import linear_cka_matrix
from reslab.models.diagnostics import (
    DPI,
    collect_diagnostics,
    effective_depth,
    effective_depth_of_model,
    heatmap_figsize,
    plot_entropy,
    render_routing_heatmap,
    routing_diagnostics,
    routing_matrix,
)
from reslab.models.residual.rd_attnres import js_divergence

L = SMALL["n_layers"]
pytestmark = pytest.mark.usefixtures("one_thread")


def val_batches(n_batches: int = 2, batch: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(n_batches):
        x = torch.randint(0, VOCAB, (batch, SMALL["seq_len"] + 1), generator=gen)
        out.append((x[:, :-1], x[:, 1:]))
    return out


def naive_cka(features: list[torch.Tensor]) -> torch.Tensor:
    hs = [f.double() - f.double().mean(0) for f in features]
    out = torch.empty(len(hs), len(hs), dtype=torch.float64)
    for i, a in enumerate(hs):
        for j, b in enumerate(hs):
            cross = torch.linalg.matrix_norm(a.T @ b) ** 2
            out[i, j] = cross / (torch.linalg.matrix_norm(a.T @ a) * torch.linalg.matrix_norm(b.T @ b))
    return out


def exactly_orthogonal_updates(num_layers: int, n: int = 240, d: int = 3) -> torch.Tensor:
    """[L, N, d] updates whose centred columns are exactly orthogonal across the N passages, within
    and between layers, each with squared norm N (equal norm, isotropic, no persistent h_0)."""
    x = torch.randn(n, num_layers * d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    q, _ = torch.linalg.qr(x - x.mean(0))                                      # [N, L*d]
    return (q * math.sqrt(n)).T.reshape(num_layers, d, n).transpose(1, 2)


def min_over_max(num_layers: int) -> torch.Tensor:
    i = torch.arange(1, num_layers + 1, dtype=torch.float64)
    return torch.minimum(i[:, None], i[None]) / torch.maximum(i[:, None], i[None])


# ----------------------------------------------------------------------------- CKA and D_eff


@pytest.mark.parametrize("n, d", [(12, 40), (50, 6)], ids=["gram-form-d>N", "cov-form-d<N"])
def test_cka_matches_naive_symmetric_unit_diagonal(n, d):
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(n, d, generator=gen, dtype=torch.float64)
    features = [base + 0.5 * k * torch.randn(n, d, generator=gen, dtype=torch.float64) for k in range(5)]
    cka = linear_cka_matrix(features, debiased=False)
    torch.testing.assert_close(cka, naive_cka(features), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(cka, cka.T, rtol=0, atol=0)
    torch.testing.assert_close(cka.diagonal(), torch.ones(5, dtype=torch.float64), rtol=0, atol=1e-12)
    assert cka.dtype == torch.float64 and (cka <= 1 + 1e-12).all() and (cka >= 0).all()


def test_cka_invariant_to_column_shift_and_scale():
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(30, 8, generator=gen), torch.randn(30, 8, generator=gen)
    c1 = linear_cka_matrix([a, b])
    c2 = linear_cka_matrix([3.0 * a + 5.0, b - 2.0])
    torch.testing.assert_close(c1, c2, rtol=1e-6, atol=1e-6)


def test_deff_full_lag_is_participation_ratio():
    gen = torch.Generator().manual_seed(3)
    for num_layers in (1, 2, 5, 9):
        features = [torch.randn(20, 7, generator=gen).cumsum(1) + k * torch.randn(20, 7, generator=gen)
                    for k in range(num_layers)]
        cka = linear_cka_matrix(features)
        out = effective_depth(cka)
        assert out["d_eff"] == pytest.approx(num_layers**2 / float(cka.sum()), rel=1e-12)
        assert out["layers"] == num_layers and len(out["lag_profile"]) == num_layers
        assert out["lag_profile"][0] == pytest.approx(1.0)
        assert out["gap"] == pytest.approx(1 - out["d_eff"] / (2 * num_layers / (num_layers + 1)))


def test_deff_lag_truncation_drops_far_lags():
    cka = torch.tensor([[1.0, 0.5, 0.2], [0.5, 1.0, 0.5], [0.2, 0.5, 1.0]], dtype=torch.float64)
    assert effective_depth(cka, lag=0)["d_eff"] == pytest.approx(3.0)
    assert effective_depth(cka, lag=1)["d_eff"] == pytest.approx(3 / (1 + 2 * (2 / 3) * 0.5))
    assert effective_depth(cka, lag=10)["d_eff"] == effective_depth(cka)["d_eff"]


def test_identical_layers_have_depth_one():
    h = torch.randn(16, 10, generator=torch.Generator().manual_seed(4))
    out = effective_depth(linear_cka_matrix([h] * 6))
    assert out["d_eff"] == pytest.approx(1.0, abs=1e-12)
    assert out["gap"] == pytest.approx(1 - 7 / 12)


@pytest.mark.parametrize("num_layers", [1, 4, 12, 36])
def test_exactly_orthogonal_updates_give_the_closed_form(num_layers):
    # variants.md 10.2: C_ij = min(i,j)/max(i,j), sum_ij C_ij = L(L+1)/2, D_eff = F_L, gap 0 (the
    # plug-in estimator is exact on sample-orthogonal updates; the debiased one is not built for them)
    cka = linear_cka_matrix(list(exactly_orthogonal_updates(num_layers).cumsum(0)), debiased=False)
    torch.testing.assert_close(cka, min_over_max(num_layers), rtol=0, atol=1e-10)
    out = effective_depth(cka)
    assert out["f_l"] == pytest.approx(2 * num_layers / (num_layers + 1), rel=1e-12)
    assert out["d_eff"] == pytest.approx(out["f_l"], rel=1e-10)
    assert out["gap"] == pytest.approx(0.0, abs=1e-10)


@pytest.mark.parametrize("num_layers, expected", [(4, 1.6), (12, 24 / 13)])
def test_random_isotropic_updates_approach_the_closed_form(num_layers, expected):
    # independent Gaussian updates in one shared space (orthogonal in expectation); N >> d keeps
    # the sample-covariance bias of linear CKA small (variants.md reports 1.598 / 1.836)
    gen = torch.Generator().manual_seed(0)
    updates = torch.randn(num_layers, 16000, 32, generator=gen, dtype=torch.float64)    # [L, N, d]
    cka = linear_cka_matrix(list(updates.cumsum(0)))
    assert (cka - min_over_max(num_layers)).abs().max() < 0.01
    assert effective_depth(cka)["d_eff"] == pytest.approx(expected, abs=1e-2)


def test_updates_in_disjoint_subspaces_give_sqrt_min_over_max():
    # the closed form needs updates that share the feature space; updates confined to their own
    # coordinate blocks give sqrt(min/max) and a lower D_eff (1.29 at L=4, not 1.6)
    num_layers, d = 4, 3
    updates = exactly_orthogonal_updates(num_layers, d=d)
    blocks = torch.zeros(num_layers, updates.shape[1], num_layers * d, dtype=torch.float64)
    for k in range(num_layers):
        blocks[k, :, k * d: (k + 1) * d] = updates[k]
    cka = linear_cka_matrix(list(blocks.cumsum(0)), debiased=False)
    torch.testing.assert_close(cka, min_over_max(num_layers).sqrt(), rtol=0, atol=1e-10)


# ----------------------------------------------------------------------------- models


def test_effective_depth_of_model_uses_every_layer_and_passage():
    model = make("prenorm")
    batches = [x for x, _ in val_batches(3, 4)]
    out = effective_depth_of_model(model, batches)
    assert out["layers"] == L and out["passages"] == 12
    assert 1.0 <= out["d_eff"] <= L
    cka = torch.tensor(out["cka"])
    torch.testing.assert_close(cka, cka.T)
    # batch boundaries do not matter: the pooled features are per passage
    again = effective_depth_of_model(model, [torch.cat(batches)])
    assert again["d_eff"] == pytest.approx(out["d_eff"], rel=1e-9)
    assert model.training


@pytest.mark.parametrize("name", ["prenorm", "attnres", "block_attnres", "dar", "rd_attnres", "mhar"])
def test_collect_diagnostics(name):
    model = make(name)
    diagnostics, scalars = collect_diagnostics(model, val_batches(), deff_passages=6)
    json.dumps(diagnostics)
    assert diagnostics["effective_depth"]["passages"] == 6
    assert diagnostics["effective_depth"]["layers"] == L
    assert all(isinstance(v, float) and math.isfinite(v) for v in scalars.values()), scalars
    assert 0.5 < scalars["d_eff"] <= L
    routes = name != "prenorm"
    assert ("routing_entropy" in scalars) == routes and ("routing_max_weight" in scalars) == routes
    assert ("cross_stream_similarity" in scalars) == (name == "dar")
    assert ("rd_js_mean" in scalars) == (name == "rd_attnres")
    if routes:
        assert diagnostics["routing"]["n_layers"] == L


def test_collect_diagnostics_is_side_effect_free():
    model = make("attnres")
    model.train()
    batches = val_batches()
    rng = torch.get_rng_state()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    diagnostics, _ = collect_diagnostics(model, batches, deff_passages=8)
    assert torch.equal(torch.get_rng_state(), rng) and model.training
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert model.pathway.recorder is None
    # the routing summary is the first eval batch's
    assert diagnostics["routing"] == routing_diagnostics(model, batches[0][0])


def test_dar_reports_its_cross_stream_similarity_through_the_hook():
    model = make("dar")
    batches = val_batches(1)
    diagnostics, scalars = collect_diagnostics(model, batches, deff_passages=4)
    profile = diagnostics["cross_stream_similarity_layers"]
    assert len(profile) == L and all(-1.0 <= v <= 1.0 for v in profile)
    assert scalars["cross_stream_similarity"] == diagnostics["cross_stream_similarity"] == profile[-1]
    states = model.layer_states(batches[0][0])
    assert profile == [model.pathway.cross_stream_similarity(state) for state in states]


def test_a_pathway_without_the_hook_reports_nothing_of_its_own():
    model = make("prenorm")
    idx = val_batches(1)[0][0]
    assert model.pathway.diagnostics(model.layer_states(idx), model.routing_stats(idx)) == {}
    diagnostics, scalars = collect_diagnostics(model, val_batches(1), deff_passages=4)
    assert "cross_stream_similarity" not in diagnostics and "rd_js_mean" not in scalars


def test_js_divergence_matches_the_recorder():
    model = make("rd_attnres")
    with torch.no_grad():
        model.pathway.value_queries.normal_(0, 1.0, generator=torch.Generator().manual_seed(5))
    batches = val_batches()
    diagnostics, scalars = collect_diagnostics(model, batches, deff_passages=4)
    expected = js_divergence(model.routing_stats(batches[0][0]))
    assert set(diagnostics["js_divergence"]) == {str(s) for s in expected}
    for site, value in expected.items():
        assert diagnostics["js_divergence"][str(site)] == pytest.approx(value, rel=1e-5, abs=1e-9)
    assert scalars["rd_js_mean"] == pytest.approx(sum(expected.values()) / len(expected), rel=1e-5)
    assert scalars["rd_js_mean"] > 0


# ----------------------------------------------------------------------------- routing matrices and plots


def png_size(path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def test_routing_matrix_rows_labels_and_padding():
    diagnostics, _ = collect_diagnostics(make("attnres"), val_batches(), deff_passages=4)
    matrix, labels = routing_matrix(diagnostics)
    assert matrix.shape == (2 * L + 1, 2 * L + 1)
    assert labels == ["attn 1", "mlp 1", "attn 2", "mlp 2", "attn 3", "mlp 3", "readout"]
    for r in range(2 * L + 1):
        assert np.isnan(matrix[r, r + 1:]).all()
        assert matrix[r, : r + 1].sum() == pytest.approx(1.0, abs=1e-5)
    # without "n_layers" the readout is inferred from the even top site
    bare = {k: v for k, v in diagnostics["routing"].items() if k != "n_layers"}
    assert routing_matrix(bare)[1] == labels
    with pytest.raises(ValueError, match="no sites for route 'qk'"):
        routing_matrix(diagnostics, "qk")


def test_heatmap_png_per_route(tmp_path):
    diagnostics, _ = collect_diagnostics(make("attnres"), val_batches(), deff_passages=4)
    paths = render_routing_heatmap(diagnostics, tmp_path / "routing.png", "attnres step 0")
    assert paths == [tmp_path / "routing.png"]
    width, height = heatmap_figsize(2 * L + 1, 2 * L + 1)
    assert png_size(paths[0]) == (round(width * DPI), round(height * DPI))
    assert paths[0].stat().st_size > 1024
    entropy = plot_entropy(diagnostics, tmp_path / "entropy.png", "attnres")
    assert entropy.stat().st_size > 1024
    assert render_routing_heatmap({}, tmp_path / "none.png", "prenorm") == []


def test_heatmap_named_routes(tmp_path):
    diagnostics, _ = collect_diagnostics(make("rd_attnres", {"block_size": 2}), val_batches(), deff_passages=4)
    paths = render_routing_heatmap(diagnostics, tmp_path / "rd.png", "rd")
    assert [p.name for p in paths] == ["rd.png", "rd_qk.png", "rd_v.png"]
    v_rows = routing_matrix(diagnostics, "v")[1]
    assert v_rows == ["attn 1", "attn 2", "attn 3"]
    assert all(p.stat().st_size > 1024 for p in paths)
