"""A `$RESLAB_STEP_HOOK` factory (`orchestrator.attempt.hooks`) that kills one rank of one run once, after a given
step, as a lost process or node would: the fault test_multi_rank.py injects into the ranks Ray Train starts.

Armed when `$RANK_KILL_PLAN` names a file that exists and holds `{"run_id": ..., "rank": R, "step": S}`:
that run's rank R writes its pid to `<file>.pid` as its hooks are built, and the hook returned to its rank 0
(run by `train` after each step) SIGKILLs that process once step S is done. The hook removes the file first,
so it fires once and the ranks Ray Train starts again train on. Every other rank, and every rank of another
run, gets None. Ray's workers import this module from their `PYTHONPATH`, which the test extends.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path

from reslab.common.io import write_atomic
from reslab.orchestrator.tasks import RunTask

PLAN_ENV = "RANK_KILL_PLAN"
HOOK = f"{__name__}:hook"


def hook(task: RunTask, rank: int) -> Callable[[int], None] | None:
    armed = os.environ.get(PLAN_ENV)
    if not armed or not os.path.isfile(armed):
        return None
    plan = json.loads(Path(armed).read_text())
    if plan["run_id"] != task.run_id:
        return None
    pid_file = Path(f"{armed}.pid")
    if rank == plan["rank"]:
        write_atomic(pid_file, str(os.getpid()))
    if rank != 0:
        return None

    def kill(done: int) -> None:
        if done != plan["step"]:
            return
        try:
            os.unlink(armed)
        except FileNotFoundError:  # fired already
            return
        os.kill(int(pid_file.read_text()), signal.SIGKILL)

    return kill
