"""Kernel tests: make the repository importable; nothing here touches TRITON_INTERPRET.

The Triton interpreter must be chosen before `triton` is imported and then holds for the whole
process, so `test_kernels_depth_read.py` runs its CPU kernel calls in a spawned worker process
that sets TRITON_INTERPRET=1 itself, and this pytest process stays as it was.
"""

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
