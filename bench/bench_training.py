"""Whole-model training speed and memory, printed as a markdown table.

Two modes:

  python bench/bench_training.py throughput [--preset gpt2-124m --batch 16 --steps 10]
      One AdamW training step (forward, backward, optimizer) per variant and implementation at a
      model shape, bf16 autocast on CUDA: tokens/s relative to compiled prenorm and peak memory
      (the table of issue 5). `--smoke` runs tiny shapes on the CPU (Triton through
      TRITON_INTERPRET=1) to check the script before spending GPU time.

  python bench/bench_training.py cpu-train [--preset tiny --steps 200]
      Real `reslab train` runs (stdlib corpus, evaluation included) of each variant on this machine,
      with their wall time: the "200 tiny steps under a minute" check of issue 2.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from reslab.models.backbone import build_model
from reslab.models.config import ModelConfig, OptimConfig, ResidualConfig, RunConfig, TrainConfig


@dataclass(frozen=True)
class Case:
    label: str
    residual: str
    options: tuple[tuple[str, object], ...]
    impl: str
    compile: bool
    mode: str = "default"  # torch.compile's mode; "reduce-overhead" adds CUDA graphs


def throughput_cases(block_size: int) -> list[Case]:
    """The table's rows, most telling first (rows print as they finish, so a timeout keeps them)."""
    families = [
        ("Full AttnRes", "attnres", ()),
        ("Block AttnRes", "block_attnres", (("block_size", block_size),)),
        ("MHAR H=8", "mhar", (("heads", 8),)),
    ]
    fla = importlib.util.find_spec("fla") is not None
    # (label, impl, compiled): reslab's kernels take the depth-history path (kernels/depth_history)
    kinds = [("Triton compiled", "triton", True), ("Triton eager", "triton", False),
             ("PyTorch compiled", "reference", True), ("fla-core compiled", "fla", True),
             ("PyTorch eager", "reference", False)]
    cases = [Case("prenorm, torch.compile", "prenorm", (), "reference", True)]
    for kind, impl, compiled in kinds:
        for title, name, options in families:
            if impl == "fla" and (not fla or name == "mhar"):  # fla's fused AttnRes has one head
                continue
            cases.append(Case(f"{title}, {kind}", name, options, impl, compiled))
        if kind == "Triton compiled":
            cases.append(Case("Full AttnRes, Triton compiled + CUDA graphs", "attnres", (), "triton", True,
                              "reduce-overhead"))
    return cases + [Case("prenorm, eager", "prenorm", (), "reference", False)]


def use_fla(model: torch.nn.Module) -> None:
    """Route the model's AttnRes reads through fla-core's fused AttnRes (a benchmark comparison only:
    no routing weights are recorded)."""
    from fla.ops.attnres import fused_attnres

    pathway = model.pathway

    def route(sources: list[torch.Tensor], site: int) -> torch.Tensor:
        return fused_attnres(pathway.queries[site], list(sources), pathway.key_gains[site],
                             rms_eps=pathway.shape.norm_eps)

    pathway.route = route


def measure(case: Case, args, device: torch.device) -> tuple[float, float]:
    """(tokens/s, peak memory GiB) of `args.steps` timed steps after `args.warmup` untimed ones."""
    torch.manual_seed(0)
    model_cfg = ModelConfig(preset=args.preset, **({"seq_len": args.seq_len} if args.seq_len else {}))
    model = build_model(model_cfg, ResidualConfig(name=case.residual, options=dict(case.options)),
                        vocab_size=args.vocab, impl="reference" if case.impl == "fla" else case.impl).to(device)
    if case.impl == "fla":
        use_fla(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    step_fn = torch.compile(model, mode=case.mode) if case.compile else model
    seq = model.shape.seq_len
    x = torch.randint(0, args.vocab, (args.batch, seq), device=device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def step():
        with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
            loss = step_fn(x, x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return args.batch * seq * args.steps / elapsed, peak


def cmd_throughput(args) -> None:
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.preset, args.batch, args.steps, args.warmup, args.seq_len = "tiny", 2, 1, 1, 16
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    cases = throughput_cases(args.block_size)
    if args.only:
        cases = [c for c in cases if any(o in c.label for o in args.only.split(","))]
    if args.smoke:  # inductor compiles for minutes on a CPU; the smoke run checks the eager paths
        cases = [c for c in cases if not c.compile]
    print(f"\n### training step, {args.preset}, batch {args.batch}, {name}, torch {torch.__version__}\n")
    print("| training step | tokens/s | vs prenorm (compiled if run) | peak memory GiB | vs prenorm memory | note |")
    print("|---|---|---|---|---|---|", flush=True)
    base = base_peak = None
    for case in cases:
        note = ""
        try:
            tps, peak = measure(case, args, device)
        except Exception as exc:  # a failing case is reported in the table, the rest still run
            tps, peak, note = float("nan"), float("nan"), f"failed: {type(exc).__name__}: {exc}"[:120]
        finally:  # the case's model and optimizer state are garbage now; free them before the next
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if case.label.startswith("prenorm") and base is None and not note:
            base, base_peak = tps, peak
        ratio = tps / base if base else float("nan")
        mem = peak / base_peak if base_peak else float("nan")
        print(f"| {case.label} | {tps / 1e3:,.1f}k | {ratio:.2f} | {peak:.1f} | {mem:.2f} | {note} |", flush=True)


def cmd_cpu_train(args) -> None:
    from reslab.models.training import train

    torch.set_num_threads(args.threads)
    print(f"\n### reslab train, preset {args.preset}, {args.steps} steps, CPU x{args.threads} thread(s)\n")
    print("| variant | wall s (incl. data, evals) | train s | tokens/s | final val loss |")
    print("|---|---|---|---|---|")
    for name in args.variants.split(","):
        cfg = RunConfig(model=ModelConfig(preset=args.preset), residual=ResidualConfig(name=name),
                        optim=OptimConfig(), train=TrainConfig(steps=args.steps, seed=1, device="cpu"))
        start = time.perf_counter()
        result = train(cfg)
        wall = time.perf_counter() - start
        s = result.summary
        print(f"| {name} | {wall:.1f} | {s['train_time_s']:.1f} | {s['tokens_per_s']:,.0f} | {s['val_loss']:.4f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("throughput")
    p.add_argument("--preset", default="gpt2-124m")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--block-size", type=int, default=3, help="sublayers per block (24 sublayers / 8 blocks)")
    p.add_argument("--only", help="comma-separated substrings of case labels to run")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU to check the script")
    p.set_defaults(func=cmd_throughput)
    p = sub.add_parser("cpu-train")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--variants", default="prenorm,attnres,block_attnres")
    p.set_defaults(func=cmd_cpu_train)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
