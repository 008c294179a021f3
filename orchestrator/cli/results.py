"""Results: `compare` and `export`."""

from __future__ import annotations

import argparse
from typing import Any

from reslab.orchestrator.cli.args import add_study_args, probability
from reslab.orchestrator.cli.study import load, read_workspace


def _compare(args: argparse.Namespace) -> Any:
    from reslab.orchestrator.readout import compare_study

    study, runs = load(args)
    workspace = read_workspace(args)
    return study, compare_study(study, runs, workspace, workspace.tracking_uri(args.tracking_uri),
                                cached=args.cached, alpha=args.alpha)


def cmd_compare(args: argparse.Namespace) -> int:
    from reslab.results import format_table

    study, result = _compare(args)
    print(f"{study.name}: {result.finished}/{len(result.runs)} runs finished")
    # why a pair is incomplete: the runs that ended without a result, with what they recorded
    for run in result.runs[result.runs["status"] != "FINISHED"].itertuples():
        error = getattr(run, "error", None)  # absent from a cache written by an older version
        why = f": {error}" if isinstance(error, str) else ""
        print(f"  {run.status} {run.arm}/{run.grid_key or '-'}/s{run.seed} {run.run_id}{why}")
    print(format_table(result.table, args.format), end="")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """CSV and Parquet carry every column, the per-seed run ids of both arms included; Markdown
    and LaTeX show the paper-style table and, below it, one row per seed with both run ids."""
    from reslab.results import export_table

    _, result = _compare(args)
    out = export_table(result.table, args.output, args.format, pairs=result.pairs)
    print(f"wrote {out} ({args.format}, {len(result.table)} comparison rows)")
    return 0


def register(sub: Any) -> None:
    for name, helptext in (("compare", "print the paired-comparison table of a study"),
                           ("export", "write the paired-comparison table with per-seed run ids")):
        p = sub.add_parser(name, help=helptext)
        add_study_args(p)
        p.add_argument("--alpha", type=probability, default=0.05, help="CI level is 1-alpha (default 0.05)")
        p.add_argument("--cached", action="store_true",
                       help="use the Parquet cache of the last collect instead of reading MLflow")
        if name == "compare":
            p.add_argument("--format", choices=["text", "md"], default="text")
            p.set_defaults(func=cmd_compare)
        else:
            p.add_argument("--format", choices=["md", "csv", "parquet", "latex"], required=True)
            p.add_argument("-o", "--output", required=True, help="output file")
            p.set_defaults(func=cmd_export)
