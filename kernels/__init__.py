"""Triton kernels, each beside its pure-PyTorch reference.

`select_impl` turns the config's `residual.impl` into the implementation a model uses: the
kernels on CUDA by default, the reference on CPU, and a `ConfigError` (never a silent switch) when a
forced choice cannot run. `fla`, `liger` and `flash_attn_res` are the field's kernels (`kernels/field`,
the optional extra `kernels`), chosen by name only.
"""

from __future__ import annotations

import importlib.util
import os

from reslab.common.errors import ConfigError

# What `impl: auto` picks on each device type before the reference, the first that is installed; the run uses it
# only after it passes its checks there (`models.impl_check.verified_impl`, issue 53)
AUTO: dict[str, list[str]] = {"cuda": ["triton"]}


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def select_impl(requested: str, device_type: str) -> str:
    """Map `auto|reference|triton|fla|liger|flash_attn_res` and the device type to the implementation."""
    from reslab.kernels.field import FIELD_IMPLS, NEEDS_TRITON_DEVICE, library

    if requested not in ("auto", "reference", "triton", *FIELD_IMPLS):
        raise ConfigError(f"residual.impl: {requested!r} is not allowed; expected auto, reference, triton, "
                          f"{', '.join(FIELD_IMPLS)}")
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if requested == "reference":
        return "reference"
    if requested in FIELD_IMPLS:
        library(requested)  # installed and importable here, or one line saying which
        if requested in NEEDS_TRITON_DEVICE and device_type != "cuda" and not interpret:
            raise ConfigError(f"residual.impl: {requested} runs Triton kernels, which need a CUDA device (got "
                              f"{device_type}); set TRITON_INTERPRET=1 to run them in Triton's CPU interpreter, "
                              "or use fla, auto or reference")
        return requested
    if requested == "auto":
        return next((impl for impl in AUTO.get(device_type, []) if impl != "triton" or triton_available()),
                    "reference")
    if not triton_available():
        raise ConfigError("residual.impl: triton, but the triton package is not installed (pip install triton); "
                          "allowed here: auto, reference")
    if device_type != "cuda" and not interpret:
        raise ConfigError(
            f"residual.impl: triton needs a CUDA device (got {device_type}); set TRITON_INTERPRET=1 to "
            "run the kernels in Triton's CPU interpreter, or use auto or reference"
        )
    return "triton"
