"""Torch's thread count in a process that trains: the default for `reslab train`, and setting it."""

from __future__ import annotations

import os


def default_threads() -> int:
    """Torch threads for `reslab train` when `--threads` is not given: half the CPUs this process
    may use, at most 4, at least 1.

    Torch's own default (one thread per core) collapses when anything else uses a core: its
    OpenMP threads wait at every barrier for the one that lost its core: beside one busy process
    on 2 cores, 2 threads ran 17x slower than alone, 1 thread 1.23x (bench/RESULTS.md). Half the
    cores leaves room for the rest of the machine, and past 4 threads the small CPU presets gain
    little; `--threads` overrides it on a machine of one's own.
    """
    return max(1, min(4, len(os.sched_getaffinity(0)) // 2))


def set_threads(n: int) -> int:
    """Set torch's intra-op threads, returning the previous count.

    The only torch call outside models/: a Ray worker process is reused across tasks and may
    have imported torch already, so OMP_NUM_THREADS alone would not take effect.
    """
    import torch

    previous = torch.get_num_threads()
    if previous != n:
        torch.set_num_threads(n)
    return previous
