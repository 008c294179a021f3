"""The field's AttnRes and mHC kernels as implementations (`residual.impl: fla | liger | flash_attn_res`).

One adapter module per library maps the library's math onto reslab's reference exactly, or refuses the
knob it cannot map with a one-line `ConfigError` naming the knob and the library:

- `fla.py`: fla-core 0.6's `fla.ops.attnres` (`fused_attnres`, Triton, CUDA only; `naive_attnres`, its
  own PyTorch reference, elsewhere), the depth read of Full and Block AttnRes;
- `liger.py`: liger-kernel 0.8.5's `ops/attn_res.py` (`LigerAttnResFunction`, Triton), the same read;
- `flash_attn_res.py`: flash-attn-res 0.1.12's two-phase kernels (phase 1, a batched read over the
  completed sources; phase 2, the online-softmax merge of the last one), the same read.

The libraries are the optional extra `kernels` (`pip install 'reslab[kernels]'`); each is imported only
when its implementation is chosen. The depth read they serve (reference: `kernels/depth_read/reference.py`):

    out = sum_n softmax_n(q . (g * v_n / sqrt(mean(v_n^2) + eps))) v_n       one head, no temperature
"""

from __future__ import annotations

import importlib
import importlib.metadata
from types import ModuleType

import torch
from torch import Tensor

from reslab.common.errors import ConfigError

# impl -> (distribution, top-level module)
LIBRARIES: dict[str, tuple[str, str]] = {
    "fla": ("fla-core", "fla"),
    "liger": ("liger-kernel", "liger_kernel"),
    "flash_attn_res": ("flash-attn-res", "flash_attn_res"),
}
FIELD_IMPLS = tuple(LIBRARIES)
# the implementations that run Triton kernels off CUDA only under TRITON_INTERPRET=1 (fla's fused
# kernel refuses CPU tensors; off CUDA its adapter runs fla's own PyTorch reference instead)
NEEDS_TRITON_DEVICE = ("liger", "flash_attn_res")


def version(impl: str) -> str:
    """The installed version of `impl`'s library, "" when it is not installed."""
    try:
        return importlib.metadata.version(LIBRARIES[impl][0])
    except importlib.metadata.PackageNotFoundError:
        return ""


def library(impl: str, module: str = "") -> ModuleType:
    """Import `module` of `impl`'s library (its top level by default), or raise one line: not installed
    (naming the extra), or installed but failing to import here (naming the version and the error)."""
    dist, top = LIBRARIES[impl]
    name = module or top
    if not version(impl):
        raise ConfigError(f"residual.impl: {impl} needs the {dist} package, which is not installed; "
                          f"pip install 'reslab[kernels]', or use auto, reference or triton")
    try:
        return importlib.import_module(name)
    except Exception as exc:  # a library that breaks on this torch/triton: said in one line, not a traceback
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ConfigError(f"residual.impl: {impl}: {dist} {version(impl)} does not import here "
                          f"({type(exc).__name__}: {first[:200]}); use auto, reference or triton") from exc


def check_read(impl: str, heads: int, keys: object, residual: object) -> None:
    """The field's reads are one head over the sources themselves, replacement routing: refuse the rest."""
    if heads != 1:
        raise ConfigError(f"heads: {heads} is not supported by residual.impl {impl} ({LIBRARIES[impl][0]} reads "
                          "one head); allowed: 1, or impl reference or triton")
    if keys is not None or residual is not None:
        what = "separate keys" if keys is not None else "an additive residual"
        raise ConfigError(f"residual.impl: {impl} ({LIBRARIES[impl][0]}) reads no {what}; allowed for this "
                          "variant: reference or triton")


def depth_weights(values: Tensor, qg: Tensor, eps: float) -> Tensor:
    """The depth weights [N, B, T, 1] of the read, without gradient, in float32 (float64 stays float64):
    what the routing diagnostics record (the libraries return none, or only a log-sum-exp)."""
    with torch.no_grad():
        compute = torch.float64 if values.dtype == torch.float64 else torch.float32
        v = values.to(compute)
        logits = (v @ qg.to(compute)) * torch.rsqrt(v.pow(2).mean(-1) + eps)
        return torch.softmax(logits, 0).unsqueeze(-1)
