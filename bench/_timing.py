"""Timing helpers shared by the benchmarks: warmup, device events, median and spread.

On CUDA each repetition is bracketed by CUDA events (optionally after overwriting a buffer
larger than the L2 cache, outside the timed region, so repeated runs do not read a warm cache);
on the CPU a synchronous `perf_counter` is used, which is what the `--smoke` modes need.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

# larger than the L2 of any current GPU (H100/H200: 50 MB)
_L2_FLUSH_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class Timing:
    """Milliseconds per call over `reps` timed calls."""

    median_ms: float
    q20_ms: float
    q80_ms: float
    reps: int


def _summary(times_ms: list[float]) -> Timing:
    times_ms = sorted(times_ms)
    n = len(times_ms)
    return Timing(
        median_ms=statistics.median(times_ms),
        q20_ms=times_ms[int(0.2 * (n - 1))],
        q80_ms=times_ms[int(0.8 * (n - 1))],
        reps=n,
    )


def time_fn(
    fn: Callable[[], object],
    *,
    device: torch.device | str,
    warmup: int = 3,
    reps: int = 20,
    flush_l2: bool = True,
) -> Timing:
    """Median time of `fn()` after `warmup` untimed calls.

    Args:
        device: where `fn` runs; CUDA uses events, anything else `perf_counter`.
        flush_l2: on CUDA, overwrite a 256 MB buffer before each timed call. Default: True.
    """
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))
        return _summary(times)

    flush = torch.empty(_L2_FLUSH_BYTES, dtype=torch.uint8, device=device) if flush_l2 else None
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    torch.cuda.synchronize(device)
    for start, end in zip(starts, ends, strict=True):
        if flush is not None:
            flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return _summary([s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)])


def copy_bandwidth_gbs(device: torch.device | str, nbytes: int = 2 * 1024**3, reps: int = 10) -> float:
    """Measured device-to-device copy bandwidth in GB/s (bytes read plus bytes written)."""
    device = torch.device(device)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    timing = time_fn(lambda: dst.copy_(src), device=device, warmup=2, reps=reps, flush_l2=False)
    return 2 * nbytes / (timing.median_ms * 1e-3) / 1e9
