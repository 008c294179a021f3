"""`field_read`: the depth read through one of the field's libraries (the adapters beside this module)."""

from __future__ import annotations

import torch
from torch import Tensor

from reslab.kernels.field import FIELD_IMPLS, depth_weights


def field_read(impl: str, sources: list[Tensor], query: Tensor, key_gain: Tensor, eps: float,
               need_weights: bool = True) -> tuple[Tensor, Tensor]:
    """The depth read of `sources` (N tensors [B, T, D]) through `impl`'s library: out [B, T, D] in the
    sources' dtype and the depth weights [N, B, T, 1] (an empty tensor unless `need_weights`)."""
    if impl == "fla":
        from reslab.kernels.field.fla import depth_read_fla as read
    elif impl == "liger":
        from reslab.kernels.field.liger import depth_read_liger as read
    elif impl == "flash_attn_res":
        from reslab.kernels.field.flash_attn_res import depth_read_far as read
    else:
        raise ValueError(f"field_read: unknown impl {impl!r}; allowed: {', '.join(FIELD_IMPLS)}")
    out = read(list(sources), query, key_gain, eps)
    if not need_weights:
        return out, out.new_empty(0)
    return out, depth_weights(torch.stack(list(sources)), query * key_gain, eps)
