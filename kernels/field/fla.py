"""fla-core 0.6's AttnRes read (`fla.ops.attnres`) as reslab's depth read (`residual.impl: fla`).

Mapping (fla's `fused_attnres(query, residuals, rms_weight, output_rms_weight, rms_eps, scale)`):
query = the site's pseudo-query q, rms_weight = its key gain g, rms_eps = the model's `norm_eps`,
scale = 1.0 (AttnRes has no temperature), output_rms_weight = None (the sublayer's own pre-norm follows,
unfused), residuals = the sources in order. fla's RMSNorm is `F.rms_norm(v, (D,), g, eps)`, reslab's
`v * rsqrt(mean(v^2) + eps) * g`: the same function. fla computes in float32 whatever the dtype (a
float64 model gets float32-accurate reads). On CUDA the fused Triton kernel runs; elsewhere fla's
kernel refuses CPU tensors, so the adapter runs fla's own PyTorch reference, `naive_attnres`.
"""

from __future__ import annotations

from torch import Tensor

from reslab.kernels.field import library


def depth_read_fla(sources: list[Tensor], query: Tensor, key_gain: Tensor, eps: float) -> Tensor:
    """out [B, T, D] of the read over `sources` (N tensors [B, T, D]) with `query` and `key_gain` [D]."""
    attnres = library("fla", "fla.ops.attnres")
    read = attnres.fused_attnres if sources[0].is_cuda else attnres.naive_attnres
    return read(query, list(sources), key_gain, None, rms_eps=eps, scale=1.0)
