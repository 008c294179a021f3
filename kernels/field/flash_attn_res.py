"""flash-attn-res 0.1.12's two-phase kernels as reslab's depth read (`residual.impl: flash_attn_res`).

Mapping. Phase 1 (`phase_1_batched_attention_triton_op(values [N, B, T, D], queries [S, D], eps)`) reads
N sources for S queries and returns each read and its log-sum-exp; phase 2
(`phase_2_online_softmax_merge_triton_op(partial, query, phase1_out, phase1_lse, eps)`) merges one more
source into a phase-1 read by the online softmax. The adapter reads every source but the last in phase 1
and merges the last in phase 2 (for Block AttnRes, the completed blocks and then the partial block, as
Kimi serves it; at a block's first site, with no partial yet, the last completed block is the one merged;
one source: phase 1 alone). The library's key RMSNorm has no gain:
`q . (g * v / rms(v)) = (q * g) . (v / rms(v))`, so the query passed is q * g (the gradients of q and g
follow by autograd through the product). eps = the model's `norm_eps` (the library's default is float32's
machine epsilon, 1.19e-7). Both phases write their read in bfloat16 whatever the input dtype: the adapter
casts the result back to the sources' dtype, but a float32 or float64 model reads bfloat16-accurate values.
The kernels index the width with `tl.arange(0, D)`: d_model must be a power of two. flash-attn-res 0.1.12
does not import with the triton 3.9 installed here (its phase-2 autotune keys name parameters the kernel
does not have; a triton that checks autotune keys refuses the decorator);
`library` then says so in one line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from reslab.common.errors import ConfigError
from reslab.kernels.field import library

Phase = Callable[..., Any]


def phases() -> tuple[Phase, Phase]:
    """The library's phase-1 and phase-2 ops."""
    library("flash_attn_res")
    from flash_attn_res.ops.phase_1 import phase_1_batched_attention_triton_op
    from flash_attn_res.ops.phase_2 import phase_2_online_softmax_merge_triton_op

    return phase_1_batched_attention_triton_op, phase_2_online_softmax_merge_triton_op


def depth_read_far(sources: list[Tensor], query: Tensor, key_gain: Tensor, eps: float,
                   ops: tuple[Phase, Phase] | None = None) -> Tensor:
    """out [B, T, D] of the read over `sources` (N tensors [B, T, D]) with `query` and `key_gain` [D];
    `ops` (phase 1, phase 2) default to the library's kernels."""
    d = sources[0].shape[-1]
    if d & (d - 1):
        raise ConfigError(f"model.d_model: {d} is not a power of two, which flash-attn-res's kernels need "
                          "(tl.arange over the width); allowed: a power of two, or another residual.impl")
    phase_1, phase_2 = ops or phases()
    qg = (query * key_gain).unsqueeze(0).contiguous()                                # [1, D]
    head = torch.stack(list(sources[:-1] if len(sources) > 1 else sources)).contiguous()
    out, lse = phase_1(head, qg, float(eps))                                         # [1, B, T, D], [1, B, T]
    if len(sources) > 1:
        return phase_2(sources[-1].contiguous(), qg[0], out[0], lse[0], float(eps)).to(sources[0].dtype)
    return out[0].to(sources[0].dtype)
