"""Run experiments/communication.yaml (issue 38) on a CPU machine and print its loss rows and bytes rows.

A 2-stage run asks Ray for 2 GPUs; a CPU machine has none, so this starts a local Ray instance that declares
`--gpus` GPUs (the ranks hold them in Ray's count and train on gloo), as tests/orchestrator/test_multi_rank.py
does, and submits the study as `reslab run` would. Then the study's report: `reslab report` on the workspace.

    .venv/bin/python bench/run_communication.py --workspace /tmp/comm-ws
    .venv/bin/reslab report communication --workspace /tmp/comm-ws
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from reslab.experiments import expand, load_study
from reslab.orchestrator.dispatch.ray_backend import RayBackend
from reslab.orchestrator.driving.submit import ExecutionOptions, submit
from reslab.orchestrator.durability.workspace import Workspace
from reslab.orchestrator.tracking.guarded import GuardedTracker


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default=str(Path(__file__).parent.parent / "experiments" / "communication.yaml"))
    parser.add_argument("--workspace", required=True)
    parser.add_argument("--cpus", type=int, default=4)
    parser.add_argument("--gpus", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    study = load_study(args.spec)
    runs = expand(study)
    ws = Workspace(Path(args.workspace))
    ws.root.mkdir(parents=True, exist_ok=True)
    backend = RayBackend("local", workspace=ws.root, num_cpus=args.cpus, num_gpus=args.gpus)
    backend.start()
    try:
        options = ExecutionOptions(cpus_per_run=2).with_resources(study.resources)
        result = submit(study, runs, ws, backend, GuardedTracker(ws.default_tracking_uri(), ws), options,
                        stream=sys.stdout)
    finally:
        backend.shutdown()
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
