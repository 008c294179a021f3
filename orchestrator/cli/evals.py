"""`reslab eval`: evaluate a study's finished runs on downstream tasks (lm-evaluation-harness), then print
its readouts, the task rows among them. The tasks are the study's `evals:` unless `--tasks` names them (a study
that did not declare evals)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from reslab.orchestrator.cli.args import add_study_args, non_negative_int, positive_int
from reslab.orchestrator.cli.common import load, read_workspace


def cmd_eval(args: argparse.Namespace) -> int:
    from reslab.common.errors import ConfigError
    from reslab.experiments.evals import parse_evals
    from reslab.orchestrator.driving.evaluations import check_evals, evaluate_study
    from reslab.orchestrator.gathering.gather import gather

    study, runs = load(args)
    if args.tasks:
        spec = parse_evals({"tasks": args.tasks, "num_fewshot": args.num_fewshot, "limit": args.limit})
    elif study.evals is not None:
        spec = study.evals
    else:
        raise ConfigError(f"--tasks: {study.path} declares no `evals:`; name the tasks, e.g. --tasks reslab_next_line")
    check_evals(spec)
    workspace = read_workspace(args, study, runs)
    evaluate_study(study, runs, workspace, spec, device=args.device, batch_size=args.batch_size)
    if study.comparisons:
        readout = gather(study, runs, workspace, workspace.tracking_uri(args.tracking_uri))
        readout.print(sys.stdout, "rich" if sys.stdout.isatty() else "plain")
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("eval", help="evaluate a study's finished runs on downstream tasks (lm-evaluation-harness)")
    add_study_args(p)
    p.add_argument("--tasks", nargs="+", metavar="TASK",
                   help="harness task names, or reslab_next_line (default: the study's `evals.tasks`)")
    p.add_argument("--num-fewshot", type=non_negative_int, help="few-shot examples per item (with --tasks)")
    p.add_argument("--limit", type=positive_int, help="the first N items of each task (with --tasks)")
    p.add_argument("--device", help="where to evaluate: auto, cpu, cuda, cuda:1 ... (default: the runs' train.device)")
    p.add_argument("--batch-size", type=positive_int, default=16, help="requests scored per forward (default 16)")
    p.set_defaults(func=cmd_eval)
