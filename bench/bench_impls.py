"""One conformance and overhead matrix: every implementation of Full and Block AttnRes (and mHC where one
maps it: liger) held to reslab's reference (issue 53 item 5). mHC runs 5 Sinkhorn iterations here (20 by
default) to keep the interpreter's runs short; the mapping does not depend on the count.

Conformance (any device): per variant and implementation, each check's pass or fail and worst error
(`bench/_impl_checks.py`: a tiny model's loss, logits and every gradient against the float64 reference, in
float64, float32 and bfloat16, tolerances stated there). Implementations: `reference`, `triton` (reslab's
kernels), `fla`, `liger`, `flash_attn_res` (the field's, kernels/field). On the CPU the Triton kernels run in
Triton's interpreter (TRITON_INTERPRET=1, set here before triton is imported), fla's fused kernel refuses
CPU tensors so its adapter runs fla's own PyTorch reference (`naive_attnres`); an implementation that
cannot run here gets one failed "available" check saying why.

Overhead (`--time`, CUDA only): per variant and implementation that passed its float32 and bfloat16 checks,
the paired training-step time ratio against prenorm at `--preset` (bf16 autocast, eager, AdamW): `--seeds`
seeds, each building both models from the seed and timing `--rounds` rounds of one step of each, which goes
first alternating; the ratio is the median over all pairs of variant / prenorm step seconds with its 95%
order-statistic interval (`models.serving.paired_ratio`); the peak memory of a step (above what was resident
before it) over prenorm's; and the greedy decode time per layer and token (batch 1, eval, bf16).

    python bench/bench_impls.py                                   # the conformance half, on the CPU
    python bench/bench_impls.py --device cuda --time              # both halves on a GPU
    python bench/bench_impls.py --json out.json                   # also write the results
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

if not torch.cuda.is_available():  # before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench._args import at_least  # noqa: E402
from bench._impl_checks import CHECK_NAMES, CheckResult, run_checks  # noqa: E402

VARIANTS = {"attnres": {}, "block_attnres": {"block_size": 3}, "mhc": {"sinkhorn_iters": 5}}
IMPLS = ("reference", "triton", "fla", "liger", "flash_attn_res")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, from: " + ", ".join(VARIANTS))
    p.add_argument("--impls", default=",".join(IMPLS), help="comma-separated, from: " + ", ".join(IMPLS))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    p.add_argument("--time", action="store_true", help="the overhead half (CUDA only)")
    p.add_argument("--preset", default="gpt2-124m")
    p.add_argument("--batch", type=at_least(1), default=4)
    p.add_argument("--seq", type=at_least(8), default=512)
    p.add_argument("--seeds", type=at_least(1), default=2)
    p.add_argument("--rounds", type=at_least(1), default=3)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    for flag, allowed in (("variants", VARIANTS), ("impls", IMPLS)):
        bad = [x for x in getattr(args, flag).split(",") if x not in allowed]
        if bad:
            p.error(f"--{flag}: {', '.join(bad)} not allowed; allowed: {', '.join(allowed)}")
    if args.time and args.device != "cuda":
        p.error("--time: the overhead half times CUDA steps; allowed with --device cuda only")
    return args


def cell(result: CheckResult) -> str:
    if result.passed is None:
        return "n/a"
    mark = "pass" if result.passed else "FAIL"
    return mark if math.isnan(result.worst_error) else f"{mark} {result.worst_error:.1e}"


def conformance(args: argparse.Namespace) -> dict[tuple[str, str], list[CheckResult]]:
    """Print the conformance table, a row as each finishes; the results by (variant, impl)."""
    results: dict[tuple[str, str], list[CheckResult]] = {}
    print(f"\n### conformance against the float64 reference, {args.device}, torch {torch.__version__}\n")
    print("| variant | impl | " + " | ".join(CHECK_NAMES) + " | note |")
    print("|---|---|" + "---|" * len(CHECK_NAMES) + "---|", flush=True)
    for variant in args.variants.split(","):
        for impl in args.impls.split(","):
            checks = run_checks(variant, impl, args.device, VARIANTS[variant])
            results[(variant, impl)] = checks
            if checks[0].name == "available":
                dashes = " | ".join("-" for _ in CHECK_NAMES)
                print(f"| {variant} | {impl} | {dashes} | not run: {checks[0].detail} |", flush=True)
                continue
            by_name = {c.name: c for c in checks}
            cells = " | ".join(cell(by_name[n]) if n in by_name else "-" for n in CHECK_NAMES)
            noted = [c for c in checks if c.passed is not True or c.name not in CHECK_NAMES]
            notes = "; ".join(f"{c.name}: {c.detail}" for c in noted)
            print(f"| {variant} | {impl} | {cells} | {notes} |", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = conformance(args)
    timed = {}
    if args.time:
        from bench._impl_timing import overhead

        timed = overhead(args, results, VARIANTS)
    if args.json:
        rows = [{"variant": v, "impl": i, "checks": [c.__dict__ for c in checks]} | timed.get((v, i), {})
                for (v, i), checks in results.items()]
        args.json.write_text(json.dumps(rows, indent=1, default=str))
    failed = [k for k, checks in results.items() if any(c.passed is False for c in checks)]
    print(f"\n{len(results) - len(failed)} of {len(results)} implementations pass every check that applies")
    return 0


if __name__ == "__main__":
    sys.exit(main())
