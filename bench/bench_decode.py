"""Decode speed and decode state of every residual variant at one model shape, printed as a markdown table.

Every registered variant (`reslab.models.residual.variants()`, default knobs) at the gpt2-124m shape
(d768, L12, 12 heads, vocab 50304), in eval mode, uncompiled, the reference path on the CPU:

- decode tokens/s at each `--batches` size: `--prompt` random prompt tokens per row, prefilled (untimed),
  then `--new` greedy decode steps, the median of `--repeats` rounds after one warm-up (prenorm's timed
  together, `models.serving.decode_seconds`, what a run's own cost times); and the ratio to prenorm's,
  paired step by step: each round prefills both and times their decode steps interleaved, one step of each
  in turn (which goes first alternates), each step in wall time and in the calling thread's CPU time
  (`models.serving.step_seconds`). Each ratio is the median over all step pairs of prenorm's step time over
  the variant's with its 95% order-statistic interval (`models.serving.paired_ratio`). Wall time is what a
  user waits, but on a shared machine a step that waits for a core counts the wait; the thread's CPU time
  does not, so load does not bias it. It counts the calling thread only: exact with one intra-op thread
  (`--threads 1`, which a loaded machine wants anyway: two intra-op threads wait on each other when another
  process holds a core);
- decode state (`Decoder.decode_state_bytes`), by what it grows with: per cached token (the KV cache, the
  one part that grows with the context), and per row whatever the context (the pathway's state of the
  token in flight, gone after its step, and its carry across tokens); then a row at the full context
  (KV x seq_len + per row) over prenorm's. Block AttnRes's row also shows issue 33's bound, (1 + blocks /
  layers) x prenorm's KV per cached token.

Issue 33's targets (CPU, batch 1): Block AttnRes >= 0.90x prenorm's decode tokens/s, Full AttnRes and
MHAR >= 0.85x; on a GPU >= 0.95x. The lines under the table say, for each clock, whether the interval
clears the target ("holds"), lies below it ("misses"), or straddles it ("undecided").

    python bench/bench_decode.py --threads 1                   # CPU, float32, batches 1 and 16
    python bench/bench_decode.py --device cuda --dtype bfloat16
    python bench/bench_decode.py --quick                       # the tiny preset, a smoke test
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from bench._args import at_least  # noqa: E402
from reslab.models.backbone import Decoder, build_model  # noqa: E402
from reslab.models.config import ModelConfig, ResidualConfig  # noqa: E402
from reslab.models.residual import resolve_residual, variants  # noqa: E402
from reslab.models.serving import Interval, decode_seconds, machine, paired_ratio, step_seconds  # noqa: E402

# issue 33: decode tokens/s at batch 1 relative to prenorm's, at least (CPU, GPU)
TARGETS = {"block_attnres": (0.90, 0.95), "attnres": (0.85, 0.95), "mhar": (0.85, 0.95)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="gpt2-124m", help="model preset (default gpt2-124m)")
    p.add_argument("--vocab", type=at_least(2), default=50304, help="vocabulary size (default 50304)")
    p.add_argument("--batches", default="1,16", help="comma-separated decode batch sizes (default 1,16)")
    p.add_argument("--prompt", type=at_least(1), default=32, help="prompt tokens per row (default 32)")
    p.add_argument("--new", type=at_least(1), default=16, help="decode steps timed per repetition (default 16)")
    p.add_argument("--repeats", type=at_least(1), default=5, help="timed repetitions, the median kept (default 5)")
    p.add_argument("--variants", default="", help="comma-separated variant names (default: every registered one)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--impl", choices=["auto", "reference", "triton"], default="auto",
                   help="the depth reads' implementation (auto: triton on CUDA, the reference elsewhere)")
    p.add_argument("--threads", type=at_least(1), default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--quick", action="store_true", help="a smoke test: tiny preset, batches 1,2, 1 repeat")
    args = p.parse_args(argv)
    try:
        args.batches = [int(b) for b in args.batches.split(",") if b]
    except ValueError:
        p.error(f"--batches: expected comma-separated integers, got {args.batches!r}")
    if not args.batches or min(args.batches) < 1:
        p.error("--batches: expected batch sizes >= 1")
    if args.quick:
        args.preset, args.vocab, args.batches, args.prompt, args.new, args.repeats = "tiny", 320, [1, 2], 8, 4, 1
    names = list(variants())
    chosen = [v for v in args.variants.split(",") if v] or names
    unknown = [v for v in chosen if v not in names]
    if unknown:
        p.error(f"--variants: unknown {', '.join(unknown)}; allowed: {', '.join(names)}")
    # prenorm first (every ratio is to it), then the variants with targets: rows print as they finish
    first = ["prenorm", *(v for v in TARGETS if v in chosen)]
    args.variants = first + [v for v in chosen if v not in first]
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device on this machine")
    return args


def make_model(name: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> Decoder:
    torch.manual_seed(0)
    impl = ("triton" if device.type == "cuda" else "reference") if args.impl == "auto" else args.impl
    with device:  # initialised where it runs: a 124M-parameter init takes seconds on a CPU
        model = build_model(ModelConfig(preset=args.preset, vocab_size=args.vocab), ResidualConfig(name=name),
                            vocab_size=args.vocab, impl=impl)
    return model.to(dtype=dtype).eval()


def blocks_of(name: str, n_layers: int) -> int | None:
    """Block AttnRes's blocks over the 2L sublayers at its default knobs (None for another variant)."""
    if name != "block_attnres":
        return None
    block_size = resolve_residual(ResidualConfig(name=name)).options["block_size"]
    return math.ceil(2 * n_layers / block_size)


@dataclass(frozen=True)
class Paired:
    """A variant's decode tokens/s and its speed ratio to prenorm's, paired step by step, by each clock."""

    tps: float
    wall: Interval
    cpu: Interval


@torch.no_grad()
def paired(prenorm: Decoder, model: Decoder, prompts: torch.Tensor, args: argparse.Namespace) -> Paired:
    """One warm-up round, then `--repeats` rounds: each prefills both models (untimed) and times their `--new`
    greedy decode steps interleaved, one step of each in turn (which goes first alternates), so load that
    comes and goes on a shared machine falls on both steps of a pair alike. Tokens/s: rows x new steps / the
    model's median round wall seconds; the ratios: prenorm's step seconds over the model's, the median over
    every step pair with its interval (`paired_ratio`), in wall time and in the thread's CPU time."""
    models, device = (prenorm, model), prompts.device
    rounds: list[float] = []
    wall: tuple[list[float], list[float]] = ([], [])
    cpu: tuple[list[float], list[float]] = ([], [])
    for r in range(args.repeats + 1):
        logits, states = zip(*(m.prefill(prompts) for m in models), strict=True)
        last = [x[:, -1] for x in logits]
        total = 0.0
        for step in range(args.new):
            for i in (0, 1) if (r + step) % 2 == 0 else (1, 0):
                def one(i: int = i, last: list[torch.Tensor] = last, states: tuple = states) -> None:
                    last[i] = models[i].decode_step(last[i].argmax(-1), states[i])

                w, c = step_seconds(one, device)
                total += w if i == 1 else 0.0
                if r:  # round 0 warms up
                    wall[i].append(w)
                    cpu[i].append(c)
        if r:
            rounds.append(total)
    return Paired(len(prompts) * args.new / statistics.median(rounds), paired_ratio(*wall), paired_ratio(*cpu))


def print_header(args: argparse.Namespace, device: torch.device) -> None:
    where = machine(device)
    print(f"\n### decode, {args.preset} (vocab {args.vocab}), {args.dtype}, {where['name']} "
          f"({where['cpu_count']} CPUs), torch {torch.__version__}")
    print(f"prompt {args.prompt} tokens, {args.new} decode steps timed, median of {args.repeats} rounds after one "
          "warm-up, each round timing the variant's and prenorm's decode steps interleaved, one of each in turn; "
          f"vs prenorm: the median over the {args.repeats * args.new} step pairs of prenorm's step time over the "
          "variant's [its 95% order-statistic interval], in wall time and in the thread's CPU time; state: per "
          "cached token (grows with the context), per row (does not), and a row at the full context")
    if device.type == "cpu" and torch.get_num_threads() > 1:
        print(f"({torch.get_num_threads()} intra-op threads: the thread CPU time counts the calling thread's work "
              "only; --threads 1 counts it all)")
    tps_heads = [f"decode tok/s b={b} | vs prenorm, wall | vs prenorm, CPU" for b in args.batches]
    print(f"\n| variant | {' | '.join(tps_heads)} | KV B/cached token | pathway B/row (the step) | carry B/row "
          "| row at full context, B | / prenorm's | bound | s |")
    print("|---" * (3 * len(args.batches) + 8) + "|", flush=True)


def state_cells(name: str, model: Decoder, prenorm: Decoder) -> tuple[str, tuple[float, float] | None]:
    """The state's table cells and, for Block AttnRes, (KV per cached token / prenorm's, issue 33's bound)."""
    state, base = model.decode_state_bytes(), prenorm.decode_state_bytes()
    seq_len = model.shape.seq_len
    row, base_row = state.row(seq_len), base.row(seq_len)
    blocks = blocks_of(name, model.shape.n_layers)
    bound, cell = None, ""
    if blocks:
        bound = (state.kv / base.kv, 1 + blocks / model.shape.n_layers)
        cell = f"<= {bound[1]:.2f}x ({blocks} blocks)"
    return (f"{state.kv:,} | {state.pathway:,} | {state.carry:,} | {row:,} | {row / base_row:.4f}x "
            f"| {cell}"), bound


def print_targets(device: torch.device, batch1: dict[str, Paired], bounds: dict[str, tuple[float, float]]) -> None:
    column = 0 if device.type == "cpu" else 1
    for name, (cpu, gpu) in TARGETS.items():
        if name in batch1:
            target, got = (cpu, gpu)[column], batch1[name]
            print(f"target, {name} batch-1 decode >= {target:.2f}x prenorm ({device.type}): thread CPU "
                  f"{got.cpu.text()}, {got.cpu.verdict(target)}; wall {got.wall.text()}, {got.wall.verdict(target)}")
    for name, (ratio, limit) in bounds.items():
        print(f"target, {name} decode state per cached token <= (1 + blocks/layers) x prenorm's KV = {limit:.2f}x: "
              f"{ratio:.3f}x, {'holds' if ratio <= limit else 'misses'} (its per-row state does not grow with the "
              "context: the row column)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    print_header(args, device)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, args.vocab, (max(args.batches), args.prompt), generator=generator).to(device)
    prenorm = make_model("prenorm", args, device, dtype)
    batch1: dict[str, Paired] = {}
    bounds: dict[str, tuple[float, float]] = {}  # variant -> (KV per cached token / prenorm's, its bound)
    for name in args.variants:
        tic = time.perf_counter()
        model = prenorm if name == "prenorm" else make_model(name, args, device, dtype)
        cells = []
        for b in args.batches:
            if model is prenorm:
                tps = b * args.new / decode_seconds(model, prompts[:b], args.new, args.repeats)
                cells.append(f"{tps:,.1f} | 1 | 1")
                continue
            got = paired(prenorm, model, prompts[:b], args)
            if b == 1:
                batch1[name] = got
            cells.append(f"{got.tps:,.1f} | {got.wall.text()} | {got.cpu.text()}")
        state, bound = state_cells(name, model, prenorm)
        if bound:
            bounds[name] = bound
        print(f"| {name} | {' | '.join(cells)} | {state} | {time.perf_counter() - tic:.0f} |", flush=True)
        if model is not prenorm:
            del model
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print()
    print_targets(device, batch1, bounds)
    print(f"load average at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
