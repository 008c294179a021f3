"""`common.forks`: work done by forked copies of this process comes back as if it had run here: the same
values in order, the work's own exception, and, when a copy dies (the OOM killer) or no copy can start, the
work done here instead."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from reslab.common.errors import ConfigError
from reslab.common.forks import Forked, fork_map


def test_the_values_come_back_in_order_from_the_copies():
    here = os.getpid()
    table = {i: i * i for i in range(23)}  # inherited, never pickled
    assert fork_map(lambda i: (table[i], os.getpid() != here), 23, workers=2, chunksize=2) == \
        [(i * i, True) for i in range(23)]
    assert Forked(lambda: (sum(table.values()), os.getpid() != here)).value() == (sum(i * i for i in range(23)), True)


def test_the_works_exception_is_raised_here():
    def bad():
        raise ConfigError("study s: the runs' folders are gone")

    with pytest.raises(ConfigError, match="folders are gone"):
        Forked(bad).value()
    with pytest.raises(ConfigError, match="folders are gone"):
        fork_map(lambda i: bad(), 4, workers=2)


def test_a_copy_that_dies_leaves_the_work_to_this_process():
    here = os.getpid()

    def dies_in_a_copy(i: int = 0) -> int:
        if os.getpid() != here:
            os._exit(1)  # as the OOM killer would end it
        return i + 1

    assert fork_map(dies_in_a_copy, 5, workers=2) == [1, 2, 3, 4, 5]
    assert Forked(dies_in_a_copy).value() == 1


def test_no_copy_can_start_and_the_work_runs_here(monkeypatch):
    def no_fork():
        raise OSError(11, "Resource temporarily unavailable")  # fork's EAGAIN at the process limit

    monkeypatch.setattr(os, "fork", no_fork)
    here = os.getpid()
    assert fork_map(lambda i: (i, os.getpid() == here), 3, workers=2) == [(0, True), (1, True), (2, True)]
    assert Forked(lambda: os.getpid() == here).value() is True


def test_a_cancelled_copy_ends_at_once():
    """Even when this process handles SIGTERM (a driver does; CI's pytest had such a handler left by an earlier
    test, and the copy slept on)."""
    import signal

    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        forked = Forked(lambda: time.sleep(60))
    finally:
        signal.signal(signal.SIGTERM, previous)
    began = time.monotonic()
    forked.cancel()
    assert time.monotonic() - began < 10


def test_what_this_process_printed_before_a_fork_comes_out_once(tmp_path):
    """A copy flushes the standard streams as it ends: a pipe's unwritten buffer would come out twice, had
    multiprocessing not flushed them before it forked."""
    script = ("from reslab.common.forks import Forked, fork_map\n"
              "print('before', flush=False)\n"
              "assert Forked(lambda: 1).value() == 1 and fork_map(lambda i: i, 3, workers=2) == [0, 1, 2]\n"
              "print('after')\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout == "before\nafter\n"
