"""`impl: auto` never silently wrong (models/impl_check.py, issue 53 item 4), on the CPU: `kernels.AUTO` names
an implementation for the CPU that this test registers, a run with `impl: auto` checks it on its device before
using it, and

- a DELIBERATELY BROKEN one (its depth reads 1% too large: a wrong loss, no crash) falls back to the reference
  with one warning line naming the failed check, and the verdict is cached: the next run does not check again
  and warns again;
- a correct one (the reference's math under another name) passes and trains.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch import Tensor

from reslab import kernels
from reslab.models import conformance
from reslab.models.impl_check import cache_path
from reslab.models.residual import REGISTRY, register
from reslab.models.residual.attnres import AttnRes
from reslab.models.training import train

pytestmark = pytest.mark.usefixtures("one_thread")


class PlantedImpls(AttnRes):
    """AttnRes with two test-only implementations: "good" (the reference's reads) and "broken", DELIBERATELY
    WRONG: every depth read 1% too large."""

    identities = AttnRes.identities

    def __init__(self, config: Any, shape: Any, impl: str = "reference"):
        super().__init__(config, shape, "reference")
        self.impl, self.broken = impl, impl == "broken"

    def route(self, sources: list[Tensor], site: int) -> Tensor:
        impl, self.impl = self.impl, "reference"  # the reads underneath are the reference's
        try:
            out = super().route(sources, site)
        finally:
            self.impl = impl
        return out * 1.01 if self.broken else out


@pytest.fixture
def cpu_auto(monkeypatch, tmp_path):
    """`impl: auto` tries `cpu_auto(impl)` on the CPU; the variant registered, the cache in tmp_path."""
    monkeypatch.setenv("RESLAB_CACHE", str(tmp_path / "cache"))
    register("test_impls")(PlantedImpls)

    def use(impl: str) -> None:
        monkeypatch.setitem(kernels.AUTO, "cpu", [impl])

    yield use
    REGISTRY.pop("test_impls", None)


def _run(tmp_path, name: str):
    import dataclasses

    from test_training import tiny_run

    cfg = tiny_run("test_impls", steps=2)
    cfg = dataclasses.replace(cfg, residual=dataclasses.replace(cfg.residual, impl="auto"),
                              train=dataclasses.replace(cfg.train, device="cpu", eval_every=2, diagnostics=False))
    lines: list[str] = []
    result = train(cfg, tmp_path / name, log=lines.append)
    return result, lines


def test_a_broken_implementation_falls_back_to_the_reference_with_one_warning(cpu_auto, tmp_path, monkeypatch):
    cpu_auto("broken")
    result, lines = _run(tmp_path, "first")
    warnings = [line for line in lines if "warning" in line]
    assert len(warnings) == 1, lines
    assert warnings[0].startswith("warning: residual.impl auto: broken failed `reslab check test_impls:broken` on "
                                  "cpu (float64: "), warnings[0]
    assert "differs from the reference by" in warnings[0] and "the first sublayer input that differs is site 0" \
        in warnings[0]
    assert warnings[0].endswith("; training with the reference") and "\n" not in warnings[0]
    assert result.info["impl"] == "reference"
    cached = json.loads(cache_path().read_text())
    (key, verdict), = cached.items()
    assert json.loads(key)["impl"] == "broken" and json.loads(key)["device"] == "cpu"
    assert verdict.startswith("float64: ") and verdict in warnings[0]

    def no_checks(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the cached verdict should have been used")

    monkeypatch.setattr(conformance, "run_checks", no_checks)
    again, lines = _run(tmp_path, "second")
    assert again.info["impl"] == "reference"
    assert [line for line in lines if "warning" in line] == warnings


def test_a_correct_implementation_is_checked_and_used(cpu_auto, tmp_path):
    cpu_auto("good")
    result, lines = _run(tmp_path, "good")
    assert result.info["impl"] == "good"
    assert not [line for line in lines if "warning" in line], lines
    assert json.loads(cache_path().read_text()) and list(json.loads(cache_path().read_text()).values()) == [""]
    # what the broken one computes differs from it, little at init (the norms absorb most of a scale) but far past
    # the float64 tolerance: the check had something to catch that a loss curve would not show
    ref = conformance.build(conformance.Case("test_impls", {}, "good"), torch.float64)
    bad = conformance.build(conformance.Case("test_impls", {}, "broken"), torch.float64)
    idx = conformance.tokens(1, 5)
    with torch.no_grad(), conformance.default_dtype(torch.float64):
        assert conformance.rel(bad(idx).logits, ref(idx).logits) > 1e4 * conformance.DTYPE_RTOL["float64"]
