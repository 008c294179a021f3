"""The parity checks of `bench/bench_impls.py`: an implementation of a variant against reslab's reference.

`run_checks(variant, impl)` returns one `CheckResult` per check. A minimal stand-in for the contract's
check library (issue 53 item 2, `reslab check`): only the parity checks the matrix needs. A whole tiny model
(d_model 32, 3 layers, batch 3 x 7 tokens, random non-zero pseudo-queries and perturbed key gains, so every
read weighs its sources unequally; for mHC a random phi and gating factors 1) runs forward and backward
through the implementation in a dtype (bfloat16: float32 parameters under bf16 autocast, as training runs
it); its loss, logits and every parameter gradient are compared with the same model on the reference in
float64 on the CPU. worst_error = max over those of |impl - ref64| / max(1, |ref64|); the check passes when
each error is <= 2 x the reference's own error in that dtype on that device + ATOL[dtype] x max(1, |ref64|).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from reslab.common.errors import ConfigError
from reslab.kernels import select_impl
from reslab.models.backbone import Decoder, build_model
from reslab.models.config import ModelConfig, ResidualConfig

DTYPES = ("float64", "float32", "bfloat16")
CHECK_NAMES = tuple(f"fwd+bwd {d}" for d in DTYPES)  # the matrix's columns, in order
ATOL = {"float64": 1e-10, "float32": 1e-5, "bfloat16": 5e-2}
# dtypes an implementation does not take (reslab's Triton kernels: float32, bfloat16, float16)
UNSUPPORTED = {"triton": {"float64": "reslab's Triton kernels take float32, bfloat16 and float16"}}
# what a library computes in whatever the model's dtype (their module docstrings in kernels/field)
COMPUTES = {"fla": "float32", "liger": "float32", "flash_attn_res": "bfloat16"}
SHAPE = ModelConfig(preset="tiny", d_model=32, n_layers=3, n_heads=2, ffn_hidden=40, seq_len=7)
VOCAB = 32


@dataclass(frozen=True)
class CheckResult:
    name: str
    passed: bool | None  # None: not applicable (said in `detail`)
    worst_error: float
    detail: str = ""


def tiny_model(variant: str, options: dict, impl: str, device: torch.device, dtype: torch.dtype) -> Decoder:
    """The checks' model: seed 0, pseudo-queries N(0, 0.5^2), key gains 1 + 0.3 N(0, 1) where the variant has them."""
    torch.manual_seed(0)
    knobs = dict(options)
    if variant != "mhc":
        knobs |= {"query_init": "normal", "query_init_std": 0.5}
    model = build_model(SHAPE, ResidualConfig(name=variant, options=knobs), vocab_size=VOCAB, impl=impl)
    gains = getattr(model.pathway, "key_gains", None)
    with torch.no_grad():
        if gains is not None:
            gains.mul_(1 + 0.3 * torch.randn(gains.shape))
        if variant == "mhc":  # phi N(0, 0.05^2), gating 1: input-dependent, non-symmetric H_res (zero phi is not)
            for linear in model.pathway.phi:
                linear.weight.normal_(0, 0.05)
            model.pathway.alpha.fill_(1.0)
    return model.to(device=device, dtype=dtype)


def outputs(variant: str, options: dict, impl: str, device: torch.device, dtype: torch.dtype) -> dict:
    """Loss, logits and every parameter gradient of one forward and backward, as float64 on the CPU."""
    autocast = dtype == torch.bfloat16  # as training runs bfloat16: float32 parameters under autocast
    model = tiny_model(variant, options, impl, device, torch.float32 if autocast else dtype)
    idx = torch.randint(0, VOCAB, (3, SHAPE.seq_len), generator=torch.Generator().manual_seed(3)).to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        out = model(idx, idx.roll(-1, 1))
    out.loss.backward()
    found = {"loss": out.loss.detach(), "logits": out.logits.detach()}
    found |= {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return {k: v.double().cpu() for k, v in found.items()}


def parity(variant: str, options: dict, impl: str, dtype_name: str, device: torch.device) -> CheckResult:
    """The implementation against the float64 reference in one dtype (module docstring)."""
    name = f"fwd+bwd {dtype_name}"
    why = UNSUPPORTED.get(impl, {}).get(dtype_name)
    if why:
        return CheckResult(name, None, math.nan, f"n/a: {why}")
    dtype = getattr(torch, dtype_name)
    try:
        ref = outputs(variant, options, "reference", torch.device("cpu"), torch.float64)
        lowp = outputs(variant, options, "reference", device, dtype)
        got = outputs(variant, options, impl, device, dtype)
    except Exception as exc:  # a failing implementation is a failed check, said in one line
        return CheckResult(name, False, math.nan, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
    worst, where, ok = 0.0, "", True
    for key, r in ref.items():
        scale = max(1.0, r.abs().max().item())
        err = (got[key] - r).abs().max().item()
        ok &= math.isfinite(err) and err <= 2 * (lowp[key] - r).abs().max().item() + ATOL[dtype_name] * scale
        if not math.isfinite(err) or err / scale > worst:
            worst, where = err / scale, key
    computes = COMPUTES.get(impl)
    why = f"; {impl} computes in {computes}" if not ok and computes and computes != dtype_name else ""
    return CheckResult(name, ok, worst, f"worst at {where}{why}")


def run_checks(variant: str, impl: str, device: torch.device | str = "cpu",
               options: dict | None = None) -> list[CheckResult]:
    """Every parity check of `impl` on `variant`; one failed "available" check when `impl` cannot run here."""
    device = torch.device(device)
    try:
        select_impl(impl, device.type)
        tiny_model(variant, options or {}, impl, torch.device("cpu"), torch.float32)
    except ConfigError as exc:
        return [CheckResult("available", False, math.nan, str(exc))]
    return [parity(variant, options or {}, impl, d, device) for d in DTYPES]
