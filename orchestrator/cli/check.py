"""`reslab check VARIANT[:IMPL]`: the variant contract (`models.conformance`) as a user's command."""

from __future__ import annotations

import argparse
from typing import Any

from reslab.orchestrator.cli.args import parse_assignment, positive_int
from reslab.orchestrator.cli.jsonout import add_json_arg, emit


def cmd_check(args: argparse.Namespace) -> int:
    """One line per check, then a table; exit 1 when a check fails."""
    from reslab.models.conformance import parse_target, run_checks

    variant, impl = parse_target(args.target)
    if args.impl is not None:
        impl = args.impl
    options: dict[str, Any] = dict(args.opt)
    only = [c.strip() for c in args.only.split(",") if c.strip()] if args.only else None
    report = run_checks(variant, impl, options, args.device, only, args.layers)
    if args.json:
        emit("check", check_payload(report))
        return 0 if report.passed else 1
    for c in report.checks:
        print(f"{c.status:<4}  {c.name}: {c.detail}")
    print()
    print(_table(report))
    verdict = "passed" if report.passed else f"FAILED ({', '.join(c.name for c in report.failed())})"
    print(f"\n{variant}:{impl} on {args.device}: {verdict}")
    return 0 if report.passed else 1


def check_payload(report: Any) -> dict[str, Any]:
    """`reslab.check/1`: the report's variant, implementation, device, knobs and verdict, and each check as the
    text's line and table have it (`worst` null when none was measured or it was not finite)."""
    checks = [{"name": c.name, "status": c.status, "passed": c.passed, "detail": c.detail, "worst": c.worst,
               "tolerance": c.tolerance} for c in report.checks]
    return {"variant": report.variant, "impl": report.impl, "device": report.device, "options": report.options,
            "passed": report.passed, "failed": [c.name for c in report.failed()], "checks": checks}


def _table(report: Any) -> str:
    rows = [("check", "status", "worst error", "tolerance")]
    for c in report.checks:
        rows.append((c.name, c.status, "" if c.worst is None else f"{c.worst:.2e}",
                     "" if c.tolerance is None else f"{c.tolerance:g}"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def register(sub: Any) -> None:
    p = sub.add_parser("check", help="hold a variant (in-tree, external or third-party) and an implementation "
                       "to the variant contract: identities, gradcheck, the reference in float64/32 and bfloat16, "
                       "decoding, declared bytes, seeding, checkpoints")
    p.add_argument("target", metavar="VARIANT[:IMPL]",
                   help="a registered variant (`reslab variants`), an entry point of the reslab.variants group or "
                        "a path pkg.module:Class; IMPL: reference (default), triton, or another implementation")
    p.add_argument("--impl", default=None, help="the implementation (instead of :IMPL)")
    p.add_argument("--opt", action="append", type=parse_assignment, default=[], metavar="KNOB=VALUE",
                   help="a knob of the variant (repeatable)")
    p.add_argument("--layers", type=positive_int, default=None, metavar="N",
                   help="build every model N layers deep (default 4; 3 for decoding), for knobs that need depth")
    p.add_argument("--device", default="cpu", help="the device the checks run on (cpu, cuda, cuda:1)")
    p.add_argument("--only", default=None, metavar="CHECK,...",
                   help="run only these checks (identity, gradcheck, float64, float32, bfloat16, decode, "
                        "'decode bytes', 'stage bytes', seed, checkpoint, 'from prenorm')")
    add_json_arg(p, "check")
    p.set_defaults(func=cmd_check)
