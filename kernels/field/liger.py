"""liger-kernel 0.8.5's AttnRes read (`liger_kernel/ops/attn_res.py`) as reslab's depth read
(`residual.impl: liger`).

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
