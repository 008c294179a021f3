"""`impl: auto` never silently wrong (issue 53): an implementation `auto` picks is used only after it passes its
checks (`models.conformance`) on the device the run trains on.

`verified_impl` runs `AUTO_CHECKS` of the run's variant and knobs at the checks' small size on that device (the
implementation against the reference in every dtype it runs, incremental decoding, the declared decode bytes)
and returns the implementation, or, when a check fails, "reference" (which `train.compile` compiles as it
would the kernel) with one warning line naming the failed check. The verdict is cached per device (its name),
torch, triton and reslab version, variant, knobs and implementation, in `$RESLAB_CACHE/impl_checks.json`
(`cache_root`), so the checks run once per machine and software, not once per run.

It is device-generic: which implementations `auto` tries on a device type is `kernels.AUTO` (Triton on
CUDA); a test registers a deliberately broken one for the CPU there and sees the fallback.
"""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from reslab.common.errors import ConfigError
from reslab.common.io import cache_root, file_lock, write_atomic
from reslab.models.config import ResidualConfig

AUTO_CHECKS = ("float64", "float32", "bfloat16", "decode", "decode bytes")
CHECK_LAYERS = (None, 8, 16, 32)  # None: the checks' own depth (`conformance.SMALL`)
CACHE_NAME = "impl_checks.json"


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda {torch.cuda.get_device_name(device)}"
    return device.type


def cache_key(residual: ResidualConfig, impl: str, device: torch.device) -> str:
    """What the verdict depends on: the device, torch, triton and reslab, the variant, its knobs, `impl`."""
    return json.dumps({"device": device_name(device), "torch": torch.__version__, "triton": _version("triton"),
                       "reslab": _version("reslab"), "variant": residual.name, "options": residual.options,
                       "impl": impl}, sort_keys=True, default=str)


def cache_path() -> Path:
    return cache_root() / CACHE_NAME


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def check_on_device(residual: ResidualConfig, impl: str, device: torch.device) -> str:
    """'' when `impl` passes `AUTO_CHECKS` for `residual` on `device`, else the first failure in one line."""
    from reslab.models.conformance import run_checks

    problem = ""
    for layers in CHECK_LAYERS:  # the shallowest small model the knobs fit (a block size may need depth)
        try:
            report = run_checks(residual.name, impl, residual.options, str(device), AUTO_CHECKS, layers)
            break
        except ConfigError as exc:
            problem = str(exc).splitlines()[0]
    else:  # knobs that fit none of them: not checked, so not used
        return f"not checked ({problem})"
    failed = report.failed()
    return "" if not failed else " ".join(f"{failed[0].name}: {failed[0].detail}".split())


def verified_impl(residual: ResidualConfig, impl: str, device: torch.device,
                  say: Callable[[str], Any] | None = None) -> str:
    """`impl` when it passed its checks on `device` (cached, see the module doc), else "reference" after one
    warning line to `say`. "reference" is returned unchecked."""
    if impl == "reference":
        return impl
    path, key = cache_path(), cache_key(residual, impl, device)
    failure = _read_cache(path).get(key)
    if failure is None:
        failure = check_on_device(residual, impl, device)
        with file_lock(path.with_suffix(".lock")):
            cache = _read_cache(path)
            cache[key] = failure
            write_atomic(path, json.dumps(cache, indent=1, sort_keys=True) + "\n")
    if not failure:
        return impl
    if say is not None:
        say(f"warning: residual.impl auto: {impl} failed `reslab check {residual.name}:{impl}` on "
            f"{device_name(device)} ({failure}); training with the reference")
    return "reference"
