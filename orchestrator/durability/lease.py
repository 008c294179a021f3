"""Leases: who holds a run directory or a study, and whether that holder is still alive.

A lease is the JSON a holder writes and renews (`lease_for`): host, pid and the process's start
time, its submission, the time of its last heartbeat, its heartbeat interval and a fencing token.
`lease_state` judges one: gone when its process is (checked directly when it ran on this host: pid
plus process start time, so a recycled pid does not look alive), stale when its heartbeat is older
than the timeout, and never sooner than three of the holder's own heartbeat intervals (any host).

A leaf below `workspace` (a run directory's `lease` file, `RunDir.claim`) and `storage` (a study's
driver marker on run storage, `storage.hold_study`): both judge holders the same way, and neither
imports the other for it.
"""

from __future__ import annotations

import math
import os
import socket
import time
from pathlib import Path
from typing import Any

HEARTBEAT_S = 10.0


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (state first); None off Linux or when gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def proc_start(pid: int) -> str | None:
    """The process start time in clock ticks since boot (Linux), to tell a pid from its reuse."""
    fields = _stat(pid)
    return fields[19] if fields else None


def _pid_alive(pid: int) -> bool:
    """A zombie counts as gone: it can write nothing more, and in a container whose PID 1 does
    not reap, a killed lease holder would otherwise look alive until its heartbeat times out."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    fields = _stat(pid)
    return fields is None or fields[0] not in ("Z", "X")


def process_alive(host: str | None, pid: int | None, pid_start: str | None = None) -> bool | None:
    """True/False for a process on this host; None when it ran elsewhere (cannot tell)."""
    if host != socket.gethostname() or pid is None:
        return None
    if not _pid_alive(int(pid)):
        return False
    return pid_start is None or proc_start(int(pid)) in (None, pid_start)


def lease_for(submission: str, token: int = 0, heartbeat_s: float = HEARTBEAT_S) -> dict[str, Any]:
    pid = os.getpid()
    return {
        "host": socket.gethostname(), "pid": pid, "pid_start": proc_start(pid), "submission": submission,
        "heartbeat": time.time(), "heartbeat_s": heartbeat_s, "token": token,
    }


def lease_state(lease: dict[str, Any] | None, timeout: float, now: float | None = None) -> tuple[bool, str]:
    """(live, why) for a lease file's content.

    Stale after `timeout` without a heartbeat, but never before three of the holder's own
    heartbeat intervals: a driver with a shorter timeout cannot judge a holder by its own clock.
    """
    if not isinstance(lease, dict) or not lease:
        return False, "no lease"
    now = time.time() if now is None else now
    heartbeat: Any = lease.get("heartbeat")
    age = now - float(heartbeat) if is_number(heartbeat) else math.inf
    pid = lease.get("pid") if isinstance(lease.get("pid"), int) else None
    holder = f"pid {pid} on {lease.get('host')}"
    if process_alive(lease.get("host"), pid, lease.get("pid_start")) is False:
        return False, f"{holder} is gone"
    interval: Any = lease.get("heartbeat_s")
    limit = max(timeout, 3 * float(interval)) if is_number(interval) else timeout
    if age > limit:
        return False, f"{holder}: no heartbeat for {age:.0f}s (timeout {limit:.0f}s)"
    return True, f"{holder}, heartbeat {age:.0f}s ago"


__all__ = ["HEARTBEAT_S", "lease_for", "lease_state", "proc_start", "process_alive"]
