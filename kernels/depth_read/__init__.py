"""The depth read of the AttnRes family: a reference in PyTorch and a fused Triton kernel.

`depth_read(sources, query, key_gain, ...)` is what variants call, and `depth_read2` the two-route
read of RD-AttnRes; `impl` picks the implementation explicitly (see `kernels.select_impl`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from reslab.kernels.depth_read.reference import depth_read2_reference, depth_read_reference
from reslab.kernels.field import FIELD_IMPLS, check_read

__all__ = ["depth_read", "depth_read2", "depth_read2_reference", "depth_read_reference"]


def depth_read(
    sources: Sequence[Tensor],
    query: Tensor,
    key_gain: Tensor,
    *,
    heads: int = 1,
    eps: float = 1e-6,
    keys: Sequence[Tensor] | None = None,
    residual: Tensor | None = None,
    impl: str = "reference",
    need_weights: bool = True,
) -> tuple[Tensor, Tensor]:
    """Route over `sources` (N tensors [B, T, D]); see `depth_read_reference` for the math.

    Returns out [B, T, D] and the depth weights [N, B, T, H]. The field's implementations
    (`impl` fla, liger, flash_attn_res: `kernels/field`) read one head without keys or residual and
    return an empty tensor for the weights unless `need_weights`.
    """
    if impl == "reference":
        stacked_keys = None if keys is None else torch.stack(list(keys))
        return depth_read_reference(
            torch.stack(list(sources)), query, key_gain,
            heads=heads, eps=eps, keys=stacked_keys, residual=residual,
        )
    if impl == "triton":
        from reslab.kernels.depth_read.triton import depth_read_triton

        return depth_read_triton(
            sources, query, key_gain, heads=heads, eps=eps, keys=keys, residual=residual
        )
    if impl in FIELD_IMPLS:
        from reslab.kernels.field.read import field_read

        check_read(impl, heads, keys, residual)
        return field_read(impl, list(sources), query, key_gain, eps, need_weights)
    raise ValueError(f"depth_read: unknown impl {impl!r}; allowed: 'reference', 'triton', {', '.join(FIELD_IMPLS)}")


def depth_read2(
    sources: Sequence[Tensor],
    query: Tensor,
    key_gain: Tensor,
    query_v: Tensor,
    key_gain_v: Tensor,
    *,
    heads: int = 1,
    eps: float = 1e-6,
    keys: Sequence[Tensor] | None = None,
    residual: Tensor | None = None,
    impl: str = "reference",
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Query-key and value routes over the same `sources`; see `depth_read2_reference`.

    Returns out, out_v [B, T, D] and weights, weights_v [N, B, T, H].
    """
    if impl == "reference":
        stacked_keys = None if keys is None else torch.stack(list(keys))
        return depth_read2_reference(
            torch.stack(list(sources)), query, key_gain, query_v, key_gain_v,
            heads=heads, eps=eps, keys=stacked_keys, residual=residual,
        )
    if impl == "triton":
        from reslab.kernels.depth_read.triton import depth_read2_triton

        return depth_read2_triton(
            sources, query, key_gain, query_v, key_gain_v,
            heads=heads, eps=eps, keys=keys, residual=residual,
        )
    raise ValueError(f"depth_read2: unknown impl {impl!r}; allowed: 'reference', 'triton'")
