"""Ends the processes a reslab command started within a second of its death, however it died.

Ray's head processes started by `ray.init` outlive a SIGKILLed driver: the GCS, raylet, agents
and workers notice only through their own health checks, about 60 s later; the MLflow server of
`reslab dashboard` would serve on forever. `watch(pids)` starts this file as a script
(`python reaper.py PARENT_PID PID:START ...`, no reslab or ray import, so it costs ~10 MB and
starts in ~50 ms) naming those processes (`RayBackend` right after a local `ray.init`,
`start_dashboard` after starting the server). While the parent lives, the reaper polls it and,
every `REFRESH_S`, records the processes below the named ones (the agents and workers the raylet
spawned: when the driver dies the raylet may die first, and its orphans are no longer below
anything named). Once the parent is gone it SIGKILLs every recorded process. A normal shutdown
stops the reaper (`Popen.terminate`). Each pid is checked against the start time it had when
recorded, so a reused pid is never killed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

POLL_S = 0.2
REFRESH_S = 1.0


def _stat(pid: int) -> tuple[int, int, str] | None:
    """(parent pid, start time in clock ticks, state) of a live process, else None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), int(fields[19]), fields[0]


def start_time(pid: int) -> int | None:
    stat = _stat(pid)
    return None if stat is None else stat[1]


def children_of() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _stat(int(name))
            if stat is not None and stat[2] != "Z":
                out.setdefault(stat[0], []).append(int(name))
    return out


def descendants(pids: list[int]) -> list[int]:
    """`pids` and every process below them, parents first."""
    tree = children_of()
    out, stack = [], list(pids)
    while stack:
        pid = stack.pop()
        out.append(pid)
        stack.extend(tree.get(pid, []))
    return out


def record(known: dict[int, int]) -> None:
    """Add to `known` ({pid: start time}) every live process below those still running as themselves."""
    roots = [pid for pid, start in known.items() if start_time(pid) == start]
    for pid in descendants(roots):
        start = start_time(pid)
        if start is not None:
            known.setdefault(pid, start)


def reap(known: dict[int, int]) -> None:
    """SIGKILL the recorded processes still running as themselves, and their descendants."""
    record(known)
    for pid, start in known.items():
        if start_time(pid) == start:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def watch(pids: list[int]) -> subprocess.Popen | None:
    """Start a reaper for `pids` (children of this process) and everything they start; None when
    none of them is running."""
    named = [f"{pid}:{start}" for pid in pids if (start := start_time(pid)) is not None]
    if not named:
        return None
    return subprocess.Popen([sys.executable, __file__, str(os.getpid()), *named],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main(argv: list[str]) -> int:
    driver = int(argv[0])
    known = {int(pid): int(start) for pid, start in (item.split(":") for item in argv[1:])}
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the driver is the driver's to handle
    last = 0.0
    while os.getppid() == driver:
        if time.monotonic() - last >= REFRESH_S:
            record(known)
            last = time.monotonic()
        time.sleep(POLL_S)
    reap(known)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
