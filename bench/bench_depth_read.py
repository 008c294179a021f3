"""Time the depth read alone (forward + backward) as Full AttnRes calls it, against the byte floor.

At the gpt2-124m shape (d=768, 24 sublayers, B=16, T=1024, bf16) sublayer l reads N = l+1
sources (the embedding and every earlier sublayer output) and the final readout reads N = 25, so
one training step makes one call for each N = 1..25. For each N this times, as median of CUDA
events with the L2 flushed between calls:

- `eager`:   the reference (`torch.stack` + float32 math) in eager mode;
- `compile`: the same under `torch.compile` (one graph per N, so only `--compile-ns` are
             compiled and the rest interpolated, marked `~`);
- `triton`:  the fused kernels (forward alone too);
- `fla`:     `fla.ops.attnres.fused_attnres` when importable (H=1 only).

Bytes: the floor reads each source once and writes each gradient once, (3N+2)*M*D*E for
M = B*T rows of E-byte elements; the kernel's design re-reads the sources in its second
backward pass, (4N+2)*M*D*E plus the float32 weights and RMS. `copy BW` is a measured
device-to-device copy, the ceiling both are compared with.

The `--step` table times the routing of one whole training step of Full AttnRes (sites reading
N = 1..25 sources, forward and backward, the sources as leaves): the list-of-tensors kernels
(`triton`) against the depth-history kernels (`history`, kernels/depth_history) and the floor
of bench/traffic_model.py at the measured copy bandwidth; it is printed first in every run.

    python bench/bench_depth_read.py                 # on a GPU
    python bench/bench_depth_read.py --step          # only the whole-step table
    python bench/bench_depth_read.py --smoke         # tiny shapes on the CPU (Triton interpreter)
"""

import os
import sys

# the interpreter must be chosen before triton is first imported
if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import importlib.util
import json
from pathlib import Path

import numpy as np
import torch

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from bench._timing import copy_bandwidth_gbs, time_fn  # noqa: E402
from bench.traffic_model import Shape, design_bytes, floor_bytes  # noqa: E402
from reslab.kernels.depth_read import depth_read  # noqa: E402

EPS = 1e-6


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU through TRITON_INTERPRET=1")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--sublayers", type=int, default=24, help="N runs over 1..sublayers+1")
    p.add_argument("--heads", type=_ints, default=[1, 8], help="comma-separated H values, one table each")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--impls", default="eager,compile,triton,fla")
    p.add_argument("--compile-ns", type=_ints, default=None, help="N values to compile (default 1,13,25)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--sweep-rows", type=_ints, default=[], help="also time triton at N=13 for these BT values")
    p.add_argument("--json", type=Path, default=None, help="write all numbers here")
    p.add_argument("--step", action="store_true", help="only the whole-step table (list kernels vs history)")
    args = p.parse_args(argv)
    if args.smoke:
        args.batch, args.seq, args.dim, args.sublayers = 2, 8, 48, 3
        args.heads, args.dtype, args.warmup, args.reps = [1, 4], "float32", 1, 2
    if args.compile_ns is None:
        n_max = args.sublayers + 1
        args.compile_ns = sorted({1, (n_max + 1) // 2, n_max})
    return args


def _step(impl: str, sources, query, gain, dout, heads: int, compiled=None):
    """One forward + backward of the routing op over `sources`, as the model would run it."""
    inputs = [*sources, query, gain]

    def run():
        if impl == "fla":
            from fla.ops.attnres import fused_attnres

            out = fused_attnres(query, list(sources), gain, rms_eps=EPS)
        elif impl == "compile":
            out, _ = compiled(list(sources), query, gain)
        else:
            kernel = "reference" if impl == "eager" else impl
            out, _ = depth_read(list(sources), query, gain, heads=heads, eps=EPS, impl=kernel)
        torch.autograd.grad(out, inputs, dout)

    return run


def _forward(sources, query, gain, heads: int):
    def run():
        with torch.no_grad():
            depth_read(list(sources), query, gain, heads=heads, eps=EPS, impl="triton")

    return run


def _bytes(n: int, rows: int, dim: int, heads: int, elem: int) -> tuple[int, int]:
    """(floor, design) bytes of forward + backward for one route without keys or residual."""
    plane = rows * dim * elem
    floor = (3 * n + 2) * plane
    small = 4 * rows * (n * heads + n)  # float32 weights and inverse RMS
    design = (4 * n + 2) * plane + 3 * small  # written in forward, read in both backward passes
    return floor, design


def _compiled_reference(heads: int, backend: str):
    def route(sources, query, gain):
        return depth_read(sources, query, gain, heads=heads, eps=EPS, impl="reference")

    return torch.compile(route, backend=backend, dynamic=False)


def bench_heads(args, heads: int, device: torch.device, copy_gbs: float | None) -> list[dict]:
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (args.batch, args.seq, args.dim)
    n_max = args.sublayers + 1
    sources = [
        torch.randn(shape, generator=gen, device=device, dtype=dtype).requires_grad_() for _ in range(n_max)
    ]
    query = (0.02 * torch.randn(args.dim, generator=gen, device=device)).requires_grad_()
    gain = torch.ones(args.dim, device=device).requires_grad_()
    dout = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    impls = [i for i in args.impls.split(",") if i]
    if "fla" in impls and (heads != 1 or importlib.util.find_spec("fla") is None or device.type != "cuda"):
        impls.remove("fla")
    backend = "aot_eager" if args.smoke else "inductor"
    compiled = _compiled_reference(heads, backend) if "compile" in impls else None
    timing = dict(device=device, warmup=args.warmup, reps=args.reps)
    elem = torch.finfo(dtype).bits // 8

    rows = []
    for n in range(1, n_max + 1):
        src = sources[:n]
        row = {"N": n}
        for impl in impls:
            if impl == "compile" and n not in args.compile_ns:
                continue
            row[impl] = time_fn(_step(impl, src, query, gain, dout, heads, compiled), **timing).median_ms
        if "triton" in impls:
            row["triton_fwd"] = time_fn(_forward(src, query, gain, heads), **timing).median_ms
        row["floor_bytes"], row["design_bytes"] = _bytes(n, args.batch * args.seq, args.dim, heads, elem)
        rows.append(row)
        done = ", ".join(f"{k} {v:.3f} ms" for k, v in row.items() if k in impls)
        print(f"  H={heads} N={n}: {done}", file=sys.stderr)
    if "compile" in impls:
        measured = [r["N"] for r in rows if "compile" in r]
        values = [r["compile"] for r in rows if "compile" in r]
        for r in rows:
            if "compile" not in r:
                r["compile~"] = float(np.interp(r["N"], measured, values))
    _print_table(args, heads, impls, rows, copy_gbs)
    return rows


def _print_table(args, heads: int, impls: list[str], rows: list[dict], copy_gbs: float | None) -> None:
    cols = [i for i in ("eager", "compile", "triton", "fla") if i in impls]
    print(f"\n### depth read fwd+bwd, B={args.batch} T={args.seq} D={args.dim} H={heads} {args.dtype}"
          f"{'' if copy_gbs is None else f', copy BW {copy_gbs:.0f} GB/s'}\n")
    head = ["N", *(f"{c} ms" for c in cols)]
    if "triton" in impls:
        head += ["triton fwd ms", "triton GB/s (design bytes)", "floor GB/s (floor bytes / time)"]
        if copy_gbs is not None:
            head += ["floor ms at copy BW", "triton / floor"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))

    def ms(r, c):
        if c in r:
            return f"{r[c]:.3f}"
        return f"~{r[c + '~']:.3f}" if c + "~" in r else "-"

    for r in rows:
        cells = [str(r["N"]), *(ms(r, c) for c in cols)]
        if "triton" in impls:
            t = r["triton"] * 1e-3
            cells += [f"{r['triton_fwd']:.3f}", f"{r['design_bytes'] / t / 1e9:.4g}",
                      f"{r['floor_bytes'] / t / 1e9:.4g}"]
            if copy_gbs is not None:
                floor_ms = r["floor_bytes"] / (copy_gbs * 1e9) * 1e3
                cells += [f"{floor_ms:.3f}", f"{r['triton'] / floor_ms:.2f}"]
        print("| " + " | ".join(cells) + " |")

    # one call per N = 1..sublayers+1 is one training step's routing, as the model makes them
    def total(c):
        vals = [r.get(c, r.get(c + "~")) for r in rows]
        return None if any(v is None for v in vals) else sum(vals)

    cells = ["sum (one step)"]
    for c in cols:
        s = total(c)
        approx = "~" if any(c + "~" in r for r in rows) else ""
        cells.append("-" if s is None else f"{approx}{s:.3f}")
    if "triton" in impls:
        fwd = sum(r["triton_fwd"] for r in rows)
        t = sum(r["triton"] for r in rows) * 1e-3
        cells += [f"{fwd:.3f}", f"{sum(r['design_bytes'] for r in rows) / t / 1e9:.4g}",
                  f"{sum(r['floor_bytes'] for r in rows) / t / 1e9:.4g}"]
        if copy_gbs is not None:
            floor_ms = sum(r["floor_bytes"] for r in rows) / (copy_gbs * 1e9) * 1e3
            cells += [f"{floor_ms:.3f}", f"{sum(r['triton'] for r in rows) / floor_ms:.2f}"]
    print("| " + " | ".join(cells) + " |")
    mean = [f"mean per call ({len(rows)} calls)"]
    for c in cols:
        s = total(c)
        mean.append("-" if s is None else f"{s / len(rows):.3f}")
    print("| " + " | ".join(mean + [""] * (len(head) - len(mean))) + " |")


def sweep_rows(args, device: torch.device) -> list[dict]:
    """Triton fwd+bwd at N=13 for each rows-per-program value (the BT heuristic's tuning data)."""
    from reslab.kernels.depth_read import triton as kernel_module

    dtype = getattr(torch, args.dtype)
    shape = (args.batch, args.seq, args.dim)
    n = min(13, args.sublayers + 1)
    sources = [torch.randn(shape, device=device, dtype=dtype).requires_grad_() for _ in range(n)]
    query = (0.02 * torch.randn(args.dim, device=device)).requires_grad_()
    gain = torch.ones(args.dim, device=device).requires_grad_()
    dout = torch.randn(shape, device=device, dtype=dtype)
    out = []
    print(f"\n### rows per program (BT) at N={n}\n\n| H | BT | fwd+bwd ms | fwd ms |\n|---|---|---|---|")
    for heads in args.heads:
        for bt in [None, *args.sweep_rows]:
            kernel_module.ROWS_PER_PROGRAM = bt
            timing = dict(device=device, warmup=args.warmup, reps=args.reps)
            both = time_fn(_step("triton", sources, query, gain, dout, heads), **timing).median_ms
            fwd = time_fn(_forward(sources, query, gain, heads), **timing).median_ms
            label = "heuristic" if bt is None else str(bt)
            print(f"| {heads} | {label} | {both:.3f} | {fwd:.3f} |")
            out.append({"H": heads, "BT": label, "fwd_bwd_ms": both, "fwd_ms": fwd})
    kernel_module.ROWS_PER_PROGRAM = None
    return out


def _routing_step(impl: str, sources, queries, gains, douts, heads: int):
    """Forward and backward of every Full AttnRes routing site of one step (site s reads s+1 sources)."""
    from reslab.kernels.depth_history import DepthHistory

    def run():
        outs = []
        if impl == "history":
            history = DepthHistory(len(sources), len(sources), sources[0], heads=heads, eps=EPS)
            for site, x in enumerate(sources):
                history.write(site, x, (site, len(sources) - 1))
                outs.append(history.read(site, site + 1, queries[site], gains[site])[0])
        else:
            for site in range(len(sources)):
                outs.append(depth_read(sources[: site + 1], queries[site], gains[site], heads=heads, eps=EPS,
                                       impl=impl)[0])
        torch.autograd.backward(outs, douts)

    return run


def bench_step(args, heads: int, device: torch.device, copy_gbs: float | None) -> list[dict]:
    """The whole-step table: ms per step and its ratio to the floor at the copy bandwidth."""
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (args.batch, args.seq, args.dim)
    n = args.sublayers + 1
    sources = [torch.randn(shape, generator=gen, device=device, dtype=dtype).requires_grad_() for _ in range(n)]
    queries = (0.02 * torch.randn(n, args.dim, generator=gen, device=device)).requires_grad_()
    gains = torch.ones(n, args.dim, device=device, requires_grad=True)
    douts = [torch.randn(shape, generator=gen, device=device, dtype=dtype) for _ in range(n)]
    ns = list(range(1, n + 1))
    model = Shape(args.batch * args.seq, args.dim, heads, torch.finfo(dtype).bits // 8)
    floor = floor_bytes(ns, model)
    print(f"\n### routing of one training step (Full AttnRes, {n} sites), B={args.batch} T={args.seq} "
          f"D={args.dim} H={heads} {args.dtype}\n")
    print("| kernels | ms / step | modelled bytes / floor | floor ms at copy BW | ms / floor ms |")
    print("|---|---|---|---|---|")
    rows = []
    for impl, design in (("triton", "today"), ("history", "pull")):
        ms = time_fn(_routing_step(impl, sources, queries, gains, douts, heads), device=device,
                     warmup=args.warmup, reps=args.reps).median_ms
        modelled = design_bytes(design, ns, model, n)
        floor_ms = float("nan") if copy_gbs is None else floor / (copy_gbs * 1e9) * 1e3
        print(f"| {impl} | {ms:.3f} | {modelled / floor:.2f} | {floor_ms:.3f} | {ms / floor_ms:.2f} |")
        rows.append({"impl": impl, "ms": ms, "modelled_bytes": modelled, "floor_bytes": floor, "floor_ms": floor_ms})
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.smoke:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    elif torch.cuda.is_available():
        device = torch.device("cuda")
        torch.backends.cuda.matmul.allow_tf32 = False
        dynamo = torch._dynamo.config
        # one graph per N: without this, dynamo falls back to eager after 8 recompiles
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo, name):
                setattr(dynamo, name, max(64, getattr(dynamo, name)))
    else:
        raise SystemExit("bench_depth_read needs a CUDA device; use --smoke for the CPU check")
    copy_gbs = None if args.smoke else copy_bandwidth_gbs(device)
    env = f"torch {torch.__version__}, device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}"
    print(f"# depth_read benchmark ({env}{', SMOKE: interpreter, compile=aot_eager' if args.smoke else ''})")
    results = {"args": {k: str(v) for k, v in vars(args).items()}, "copy_gbs": copy_gbs, "tables": {}}
    results["step"] = {heads: bench_step(args, heads, device, copy_gbs) for heads in args.heads}
    for heads in [] if args.step else args.heads:
        results["tables"][heads] = bench_heads(args, heads, device, copy_gbs)
    if args.sweep_rows:
        results["sweep_rows"] = sweep_rows(args, device)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
