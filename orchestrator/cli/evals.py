"""`reslab eval`: evaluate a study's finished runs on downstream tasks (lm-evaluation-harness), then print
its readouts, the task rows among them. The tasks are the study's `evals:` unless `--tasks` names them (a study
that did not declare evals). It is a submission that trains nothing (`submit` with `EvalJob.only`): each finished
run's evaluation is a task on Ray like `reslab run`'s (local by default, a cluster by `--address`), each
(run, task) evaluated once; the result goes on the submission's MLflow parent run."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from reslab.orchestrator.cli.args import add_study_args, non_negative_int, positive_int
from reslab.orchestrator.cli.common import (
    add_cluster_args,
    add_execution_args,
    checked_options,
    load,
    ray_backend,
    read_workspace,
    set_up,
)


def cmd_eval(args: argparse.Namespace) -> int:
    from reslab.common.errors import ConfigError
    from reslab.experiments.evals import parse_evals
    from reslab.orchestrator.driving.preflight import check_eval_device, check_eval_inputs
    from reslab.orchestrator.driving.submit import submit
    from reslab.orchestrator.gathering.gather import publish_result, study_result
    from reslab.orchestrator.tasks import EvalJob

    study, runs = load(args)
    if args.tasks:
        spec = parse_evals({"tasks": args.tasks, "num_fewshot": args.num_fewshot, "limit": args.limit})
        study = dataclasses.replace(study, evals=spec)  # the readouts show these tasks
    elif study.evals is not None:
        spec = study.evals
    else:
        raise ConfigError(f"--tasks: {study.path} declares no `evals:`; name the tasks, e.g. --tasks reslab_next_line")
    check_eval_device(args.device, args.address)
    check_eval_inputs(spec, runs)
    workspace = read_workspace(args, study, runs)
    states = [rd.state() for rd in (workspace.run_dir(study.name, r.run_id) for r in runs) if not rd.complete()]
    if len(states) == len(runs):
        raise ConfigError(f"eval: no run of {study.name} has finished in workspace {workspace.root}; allowed: a "
                          "study that `reslab run` trained (pass its --workspace)")
    if states:
        print(f"eval: {unfinished_words(states)} of {study.name}; not evaluated")
    backend = ray_backend(args, workspace)
    try:
        job = EvalJob(spec, device=args.device, batch_size=args.batch_size, only=True)
        options = dataclasses.replace(checked_options(args, study, runs), evaluate=job)
        tracker = set_up(args, workspace, backend, options, prestart=True)

        def publish(result: Any) -> None:
            result.published = publish_result(study, result.runs, workspace, tracker, result.result_key)

        tracker.publisher = publish if study.comparisons else None
        result = submit(study, runs, workspace, backend, tracker, options)
    finally:
        backend.shutdown()
    print(f"{study.name}: {result.evaluated} evaluation(s) in {result.wall_s:.0f}s")
    for run_id, error in result.errors.items():
        print(f"  FAILED {run_id}: {error}")
    if result.interrupted:
        return 130
    if study.comparisons:
        study_result(study, result.runs, workspace, tracker, publish=result.published is not None,
                     readout=result.published)
    return 0 if result.ok else 1


def unfinished_words(states: list[str | None]) -> str:
    """The runs not evaluated, by why: "2 run(s) failed, 1 not finished training" (a failed run is not
    one still to finish)."""
    from reslab.orchestrator.tasks import FAILED

    failed = sum(1 for s in states if s == FAILED)
    parts = [f"{failed} run(s) failed"] if failed else []
    parts += [f"{len(states) - failed} run(s) have not finished training"] if len(states) > failed else []
    return ", ".join(parts)


def register(sub: Any) -> None:
    p = sub.add_parser("eval", help="evaluate a study's finished runs on downstream tasks (lm-evaluation-harness)")
    add_study_args(p)
    add_cluster_args(p)
    add_execution_args(p, study=False)
    p.add_argument("--tasks", nargs="+", metavar="TASK",
                   help="harness task names, or reslab_next_line (default: the study's `evals.tasks`)")
    p.add_argument("--num-fewshot", type=non_negative_int, help="few-shot examples per item (with --tasks)")
    p.add_argument("--limit", type=positive_int, help="the first N items of each task (with --tasks)")
    p.add_argument("--device", help="where to evaluate: auto, cpu, cuda, cuda:1 ... (default: the runs' train.device)")
    p.add_argument("--batch-size", type=positive_int, default=16, help="requests scored per forward (default 16)")
    p.set_defaults(func=cmd_eval)
