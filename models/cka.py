"""Linear CKA between feature matrices (`linear_cka_matrix`): the layer similarity behind effective depth
(`models.diagnostics`) and DAR's cross-stream CKA (`models.residual.dar`). A leaf: torch only, so the
pathways use it without importing the diagnostics that import them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["linear_cka_matrix"]


def linear_cka_matrix(features: Sequence[Tensor], *, debiased: bool = True) -> Tensor:
    """Linear CKA between L feature matrices [N, d_l] (float64), [L, L].

    `debiased` (the default) uses the unbiased HSIC estimator of Song et al. (2012), the
    "debiased CKA" of Nguyen, Raghu and Kornblith (2021): with K = X X^T, zero-diagonal K~ and n rows,
        HSIC_1(K, L) = [tr(K~ L~) + 1'K~1 1'L~1 / ((n-1)(n-2)) - 2/(n-2) 1'K~L~1] / (n(n-3)),
    CKA = HSIC_1(K, L) / sqrt(HSIC_1(K, K) HSIC_1(L, L)). The plug-in estimator
    (`debiased=False`, column-centred ||H_i^T H_j||_F^2 / (||H_i^T H_i||_F ||H_j^T H_j||_F)) is
    biased towards 1 when d >> N: 64 passages at d=768 read independent isotropic updates as
    near-identical layers (D_eff ~1.04 against F_12 = 1.85). The debiased estimate is unbiased
    for each HSIC term (not exactly for their ratio), can leave [0, 1] by sampling noise, and
    needs N >= 4.

    Uses N x N Gram matrices (||H_i^T H_j||_F^2 = <H_i H_i^T, H_j H_j^T>_F) or d x d
    cross-covariances, whichever needs fewer flops for the shapes given; the debiasing terms need
    only each Gram's diagonal (the rows' squared norms) because the rows are centred first, which
    leaves HSIC_1 unchanged. A layer whose features do not vary over the N rows has no defined
    CKA: its row and column are NaN.
    """
    if not features:
        raise ValueError("linear_cka_matrix: no feature matrices")
    n = features[0].shape[0]
    if any(f.ndim != 2 or f.shape[0] != n for f in features):
        shapes = [tuple(f.shape) for f in features]
        raise ValueError(f"linear_cka_matrix: expected [N, d] matrices with one N, got {shapes}")
    min_rows = 4 if debiased else 2
    if n < min_rows:
        raise ValueError(f"linear_cka_matrix: need at least {min_rows} rows (passages), got {n}")
    hs = [f.detach().to(torch.float64) for f in features]
    hs = [h - h.mean(0, keepdim=True) for h in hs]                                   # [N, d] each
    inner = _gram_inner_products(hs)                                                 # [L, L]
    if debiased:
        # centred rows: K 1 = 0, so 1'K~1 = -tr K and 1'K~L~1 = sum_a K_aa L_aa
        diag = torch.stack([h.square().sum(1) for h in hs])                         # [L, N]
        trace = diag.sum(1)                                                          # [L]
        diag_products = diag @ diag.T                                                # [L, L]
        inner = (inner - diag_products + torch.outer(trace, trace) / ((n - 1) * (n - 2))
                 - 2.0 / (n - 2) * diag_products) / (n * (n - 3))
    self_terms = inner.diagonal()
    scale = torch.outer(self_terms, self_terms).clamp_min(0).sqrt()
    return torch.where(scale > 0, inner / scale, torch.full_like(inner, math.nan))


def _gram_inner_products(hs: list[Tensor]) -> Tensor:
    """<H_i H_i^T, H_j H_j^T>_F = ||H_i^T H_j||_F^2 for every pair, [L, L] float64."""
    n = hs[0].shape[0]
    num_layers, d = len(hs), max(h.shape[1] for h in hs)
    gram_flops = num_layers * n * n * d + num_layers * num_layers * n * n
    cov_flops = num_layers * (num_layers + 1) // 2 * n * d * d
    if gram_flops <= cov_flops:
        grams = torch.stack([(h @ h.T).flatten() for h in hs])                      # [L, N*N]
        inner = grams @ grams.T                                                      # [L, L]
        # BLAS does not promise a symmetric product; the mean of the two halves is exactly symmetric
        return 0.5 * (inner + inner.T)
    inner = torch.empty(num_layers, num_layers, dtype=torch.float64, device=hs[0].device)
    for i in range(num_layers):
        for j in range(i, num_layers):
            inner[i, j] = inner[j, i] = (hs[i].T @ hs[j]).square().sum()
    return inner
