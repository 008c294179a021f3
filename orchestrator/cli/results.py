"""Results: `compare`, `verdict`, `export` and `report`."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from reslab.orchestrator.cli.args import add_study_args, probability
from reslab.orchestrator.cli.common import add_tune_args, load, read_workspace
from reslab.orchestrator.cli.jsonout import add_json_arg, emit


def _gather(args: argparse.Namespace, workers: int = 1) -> Any:
    """The study's readouts (`orchestrator.gathering.gather`) from the workspace the flags name; first, a note
    naming finished runs of the study under other `--set` flags, when there are such (`driving.overrides`)."""
    from reslab.orchestrator.driving.overrides import other_overrides_hint
    from reslab.orchestrator.gathering.gather import gather

    study, runs = load(args)
    workspace = read_workspace(args, study, runs)
    hint = other_overrides_hint(study, runs, workspace)
    if hint:
        print(hint)
    return gather(study, runs, workspace, workspace.tracking_uri(args.tracking_uri), cached=args.cached,
                  alpha=args.alpha, workers=workers)


def cmd_compare(args: argparse.Namespace) -> int:
    readout = _gather(args)
    if args.json:
        emit("compare", compare_payload(readout))
        return 0
    print(readout.status_lines(), end="")  # and why a pair is incomplete: what each unfinished run recorded
    style = "md" if args.format == "md" else "rich" if sys.stdout.isatty() else "plain"
    readout.print(sys.stdout, style)
    return 0


def cmd_verdict(args: argparse.Namespace) -> int:
    """One line per verdict (`orchestrator.gathering.verdicts`), or with `--json` the verdicts as data."""
    from reslab.orchestrator.gathering.verdicts import study_verdicts

    study, runs = load(args)
    workspace = read_workspace(args, study, runs)
    report = study_verdicts(study, workspace, workspace.tracking_uri(args.tracking_uri), runs=runs,
                            alpha=args.alpha, cached=args.cached)
    if args.json:
        emit("verdict", report.to_dict())
    else:
        print("\n".join(report.lines()))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """CSV and Parquet carry every column, the per-seed run ids of both arms included; Markdown
    and LaTeX show the paper-style table and, below it, one row per seed with both run ids."""
    readout = _gather(args)
    out = readout.export(args.output, args.format)
    if args.json:  # the rows themselves are `compare --json`'s
        emit("export", {"study": readout.data.name, "format": args.format, "path": str(out.resolve()),
                        "comparison_rows": len(readout.table)})
        return 0
    print(f"wrote {out} ({args.format}, {len(readout.table)} comparison rows)")
    return 0


def compare_payload(readout: Any) -> dict[str, Any]:
    """`reslab.compare/1`: the runs finished (`StudyReadout.unfinished`, what `status_lines` prints) and every
    readout's `--json` form (`StudyReadout.json`), at the level the readouts were computed at."""
    unfinished = readout.unfinished()
    total = len(readout.runs)
    return {"study": readout.data.name, "alpha": readout.data.alpha,
            "runs": {"total": total, "finished": total - len(unfinished), "unfinished": unfinished},
            "readouts": readout.json()}


def _fork_workers() -> int:
    """The processes `report` reads the run folders and draws the figures on (`common.forks`): every core, when
    this process may fork, i.e. runs on Linux (macOS's system libraries are not fork-safe) and has no Ray in it
    (the `reslab` command has none; an in-process caller that started Ray, a test, gets 1: a fork would copy
    Ray's threads mid-call)."""
    ray = sys.modules.get("ray")
    if not sys.platform.startswith("linux") or (ray is not None and ray.is_initialized()):
        return 1
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cmd_report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from reslab.common.errors import ConfigError

    out = Path(args.output)
    if not out.parent.is_dir():
        raise ConfigError(f"-o/--output: directory {out.parent} does not exist; give a path in an existing directory")
    workers = _fork_workers()
    page = _gather(args, workers=workers).report(workers=workers)
    out.write_text(page, encoding="utf-8")
    print(f"wrote {out} ({len(page) // 1024} KiB, self-contained HTML)")
    return 0


def register(sub: Any) -> None:
    for name, helptext in (("compare", "print the paired-comparison table of a study"),
                           ("verdict", "each comparison's decision, estimate, seeds, compute and what would decide "
                                       "it, held to the analysis plan frozen at the study's first submission"),
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
            add_json_arg(p, "compare")
            p.set_defaults(func=cmd_compare, reads_study=True)
        elif name == "verdict":
            add_json_arg(p, "verdict")
            p.set_defaults(func=cmd_verdict, reads_study=True)
        elif name == "export":
            p.add_argument("--format", choices=["md", "csv", "parquet", "latex"], required=True,
                           help="md, csv, parquet (one row per comparison row, both arms' run ids per seed) or "
                                "latex (booktabs)")
            p.add_argument("-o", "--output", required=True, help="output file")
            add_json_arg(p, "export")
            p.set_defaults(func=cmd_export, reads_study=True)
        else:
            p.add_argument("-o", "--output", required=True, help="the HTML file to write, e.g. report.html")
            p.set_defaults(func=cmd_report, reads_study=True)
