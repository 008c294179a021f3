"""Shared by the kernel tests: imported as `from kernel_testing import ...` (tests/kernels has no
__init__.py, so pytest puts this folder on sys.path). It imports torch only, never triton: the interpreter
worker imports test modules before it sets TRITON_INTERPRET=1."""

from contextlib import contextmanager

import torch


@contextmanager
def nan_empty():
    """`torch.empty` returns NaN-filled floating tensors inside the block, so a kernel that leaves part of
    an output unwritten shows NaN instead of passing on whatever the allocator had."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = poisoned
    try:
        yield
    finally:
        torch.empty = real_empty
