"""Results: `compare`, `export` and `report`."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from reslab.orchestrator.cli.args import add_study_args, probability
from reslab.orchestrator.cli.common import add_tune_args, load, read_workspace


def _compare(args: argparse.Namespace) -> Any:
    from reslab.orchestrator.readout import compare_study

    study, runs = load(args)
    workspace = read_workspace(args, study, runs)
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
    from reslab.orchestrator.report import sequential_lines

    print(sequential_lines(study, result), end="")
    if args.format == "text" and sys.stdout.isatty():
        from rich.console import Console

        from reslab.results.export import rich_renderables

        Console().print(*rich_renderables(result.table), sep="\n")
    else:  # piped: the plain format, byte for byte
        print(format_table(result.table, args.format), end="")
    if result.ladder is not None:
        from reslab.results.ladder import ladder_text

        print(ladder_text(result.ladder, args.alpha), end="")
    if result.contrasts is not None:
        from reslab.results.contrasts import contrast_text

        print(contrast_text(result.contrasts, args.alpha), end="")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """CSV and Parquet carry every column, the per-seed run ids of both arms included; Markdown
    and LaTeX show the paper-style table and, below it, one row per seed with both run ids."""
    from reslab.results import export_table

    _, result = _compare(args)
    out = export_table(result.table, args.output, args.format, pairs=result.pairs)
    print(f"wrote {out} ({args.format}, {len(result.table)} comparison rows)")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from reslab.common.errors import ConfigError
    from reslab.orchestrator.report import build_report

    out = Path(args.output)
    if not out.parent.is_dir():
        raise ConfigError(f"-o/--output: directory {out.parent} does not exist; give a path in an existing directory")
    study, runs = load(args)
    workspace = read_workspace(args, study, runs)
    page = build_report(study, runs, workspace, workspace.tracking_uri(args.tracking_uri), alpha=args.alpha,
                        cached=args.cached)
    out.write_text(page, encoding="utf-8")
    print(f"wrote {out} ({len(page) // 1024} KiB, self-contained HTML)")
    return 0


def register(sub: Any) -> None:
    for name, helptext in (("compare", "print the paired-comparison table of a study"),
                           ("export", "write the paired-comparison table with per-seed run ids"),
                           ("report", "write a study's one-page HTML report: what ran, the paired table, plots")):
        p = sub.add_parser(name, help=helptext)
        add_study_args(p)
        add_tune_args(p)
        p.add_argument("--alpha", type=probability, default=0.05,
                       help="the family-wise level of the tests and verdicts; intervals are 1-alpha (default 0.05)")
        p.add_argument("--cached", action="store_true",
                       help="use the Parquet cache of the last collect instead of reading MLflow")
        if name == "compare":
            p.add_argument("--format", choices=["text", "md"], default="text",
                           help="text: the terminal table with its notes (default); md: a Markdown table")
            p.set_defaults(func=cmd_compare)
        elif name == "export":
            p.add_argument("--format", choices=["md", "csv", "parquet", "latex"], required=True,
                           help="md, csv, parquet (one row per comparison row, both arms' run ids per seed) or "
                                "latex (booktabs)")
            p.add_argument("-o", "--output", required=True, help="output file")
            p.set_defaults(func=cmd_export)
        else:
            p.add_argument("-o", "--output", required=True, help="the HTML file to write, e.g. report.html")
            p.set_defaults(func=cmd_report)
