"""Pure-PyTorch reference of the depth read shared by the AttnRes family.

For each token, a softmax over depth sources with a static pseudo-query and RMSNorm keys
(Kimi AttnRes, arXiv 2603.15031, eq. in variants.md 1.1; MHAR heads, arXiv 2607.27230, 2.1):

    k_n     = RMSNorm_g(key_n)                      RMS over the full width, then sliced per head
    a_n^h   = softmax_n( q_h . k_n[h] )             no 1/sqrt(d) temperature (Kimi's pseudo-code)
    out[h]  = sum_n a_n^h value_n[h]  (+ residual)  replacement routing, or additive with `residual`

Math runs in float32 (float64 stays float64) and the output is cast once to the values' dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor


def depth_read_reference(
    values: Tensor,
    query: Tensor,
    key_gain: Tensor,
    *,
    heads: int = 1,
    eps: float = 1e-6,
    keys: Tensor | None = None,
    residual: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Route over `values` [N, B, T, D] with `query` [D] and key RMSNorm gain `key_gain` [D].

    Args:
        heads: H, the query is split into H contiguous slices of D/H, each its own softmax.
        keys: [N, B, T, D] sources to score when they differ from the values (DAR reads keys
            from the opposite stream). Default: the values themselves.
        residual: [B, T, D] stream added to the routed output (Delta AttnRes, additive routing).

    Returns:
        out [B, T, D] in the values' dtype, and the depth weights [N, B, T, H] in float32.
    """
    n_src, _, _, dim = values.shape
    if n_src < 1:
        raise ValueError("depth_read needs at least one source")
    if dim % heads:
        raise ValueError(f"width {dim} is not divisible by heads={heads}")
    compute = torch.float64 if values.dtype == torch.float64 else torch.float32
    v = values.to(compute)
    k = v if keys is None else keys.to(compute)
    # q . (g * k / rms(k)) == ((q * g) . k) / rms(k): the normalised keys are never materialised
    inv_rms = torch.rsqrt(k.pow(2).mean(-1) + eps)                                  # [N, B, T]
    qg = (query.to(compute) * key_gain.to(compute)).view(heads, dim // heads)
    qg_matrix = torch.block_diag(*qg.unbind(0)).transpose(0, 1)                     # [D, H]
    logits = (k @ qg_matrix) * inv_rms.unsqueeze(-1)                                # [N, B, T, H]
    weights = torch.softmax(logits, dim=0)
    # a weighted sum over depth; as a batched matmul it would be B*T tiny products (slow on CPU)
    head_w = weights.repeat_interleave(dim // heads, dim=-1) if heads > 1 else weights  # [N, B, T, D|1]
    out = (head_w * v).sum(0)
    if residual is not None:
        out = out + residual.to(compute)
    return out.to(values.dtype), weights.to(torch.float32 if compute == torch.float32 else compute)


def depth_read2_reference(
    values: Tensor,
    query: Tensor,
    key_gain: Tensor,
    query_v: Tensor,
    key_gain_v: Tensor,
    *,
    heads: int = 1,
    eps: float = 1e-6,
    keys: Tensor | None = None,
    residual: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Two routes over the same `values` [N, B, T, D] (RD-AttnRes, variants.md 4.1).

    The query-key route uses (`query`, `key_gain`) and the value route (`query_v`, `key_gain_v`),
    each exactly as `depth_read_reference`; tying the two recovers a single route.

    Returns:
        out, out_v [B, T, D] in the values' dtype, and weights, weights_v [N, B, T, H].
    """
    out, weights = depth_read_reference(
        values, query, key_gain, heads=heads, eps=eps, keys=keys, residual=residual
    )
    out_v, weights_v = depth_read_reference(
        values, query_v, key_gain_v, heads=heads, eps=eps, keys=keys, residual=residual
    )
    return out, out_v, weights, weights_v
