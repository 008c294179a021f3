"""Fixtures shared by the tests in tests/models."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def float64():
    """Run one test with float64 as torch's default dtype, restoring the old default after."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a whole module (opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`).

    Tiny ops: intra-op threads only add spin-waiting, which dominates on a loaded 2-core box.
    """
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
