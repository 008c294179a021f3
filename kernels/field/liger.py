"""liger-kernel 0.8.5's AttnRes read (`liger_kernel/ops/attn_res.py`) as reslab's depth read, and its fused
mHC (`liger_kernel/ops/mhc.py`, the ops under `LigerMHC`) as reslab's mHC (`residual.impl: liger`).

Mapping (`LigerAttnResFunction.apply(V_stacked, w_query, w_norm, eps)`): V_stacked = the sources
stacked [N, B, T, D], w_query = the site's pseudo-query q, w_norm = its key gain g, eps = the model's
`norm_eps`. Liger's kernel computes `k = v * rsqrt(mean(v^2) + eps) * g`, `score = q . k` (no
temperature), a softmax over the N sources and `sum alpha_n v_n`: reslab's read, in float32 inside the
kernel (a float64 model gets float32-accurate reads). It is a Triton kernel on every device: off CUDA it
runs under the Triton interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
from torch import Tensor

from reslab.kernels.field import library


def depth_read_liger(sources: list[Tensor], query: Tensor, key_gain: Tensor, eps: float) -> Tensor:
    """out [B, T, D] of the read over `sources` (N tensors [B, T, D]) with `query` and `key_gain` [D]."""
    attn_res = library("liger", "liger_kernel.ops.attn_res")
    return attn_res.LigerAttnResFunction.apply(torch.stack(list(sources)), query, key_gain, float(eps))


def mhc_coefficients(streams: Tensor, weight: Tensor, alpha: Tensor, bias: Tensor, iters: int,
                     eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """reslab's mHC coefficients (H_pre, H_post [B, T, n], H_res [B, T, n, n]) through liger's
    `liger_mhc_coeffs`, from reslab's parameters of one site: `weight` [2n + n^2, nC] (phi as an
    nn.Linear's weight), `alpha` [3] (a_pre, a_post, a_res), `bias` [2n + n^2].

    Mapping: phi = weight^T, pre_eps = 0, post_mult = 2, rms_eps = the model's `norm_eps`, tmax = sinkhorn_iters,
    sinkhorn_eps = 0. Liger's Sinkhorn normalises rows first and ends on columns (reslab's, mHC Eq. 9: columns
    first, ending on rows), so it is handed the transposed residual logits (the n x n block of phi's columns and
    of the bias permuted (i, j) -> (j, i)) and its H_res transposed back: with sinkhorn_eps = 0,
    liger(L^T)^T = reslab's Sinkhorn of L exactly. Liger's coefficients take bfloat16, float16 or float32: a
    float64 model's streams are read in float32 (its kernels compute in float32 anyway).
    """
    functional = library("liger", "liger_kernel.transformers.functional")
    n = streams.shape[-2]
    res = 2 * n + torch.arange(n * n, device=weight.device).view(n, n).t().flatten()
    order = torch.cat([torch.arange(2 * n, device=weight.device), res])
    x = streams.float() if streams.dtype == torch.float64 else streams
    phi = weight.t()[:, order].to(x.dtype)
    h_pre, h_post, h_res = functional.liger_mhc_coeffs(
        x.contiguous(), phi, bias[order].float(), alpha[0], alpha[1], alpha[2], allow_fp32=True, tmax=iters,
        rms_eps=float(eps), pre_eps=0.0, sinkhorn_eps=0.0, post_mult=2.0)
    return h_pre.to(streams.dtype), h_post.to(streams.dtype), h_res.transpose(-1, -2).to(streams.dtype)


def mhc_read(streams: Tensor, h_pre: Tensor) -> Tensor:
    """sum_i H_pre[i] x_i [B, T, C] through liger's `liger_mhc_pre` (reslab's `stream_scale` divides outside)."""
    functional = library("liger", "liger_kernel.transformers.functional")
    return functional.liger_mhc_pre(streams.contiguous(), h_pre.contiguous()).to(streams.dtype)


def mhc_write(streams: Tensor, output: Tensor, h_post: Tensor, h_res: Tensor) -> Tensor:
    """x'_i = sum_j H_res[i, j] x_j + H_post[i] u [B, T, n, C] through liger's `liger_mhc_post_res`
    (its h_res is [out, in], reslab's H_res as it is)."""
    functional = library("liger", "liger_kernel.transformers.functional")
    out = functional.liger_mhc_post_res(streams.contiguous(), output.contiguous(), h_post.contiguous(),
                                        h_res.contiguous())
    return out.to(streams.dtype)
