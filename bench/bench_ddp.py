"""Data-parallel training speed and agreement: one run on 1, 2, ... ranks, printed as a markdown table.

    python bench/bench_ddp.py [--preset gpt2-124m --variants prenorm,attnres --world 1,2 --sharding ddp,fsdp]
    python bench/bench_ddp.py --smoke      # tiny shapes on CPU ranks (gloo), to check the script

Each case spawns `world` processes (NCCL on GPUs, one per rank; gloo on the CPU) that train the same
run through `models.training.Trainer` with a `models.distributed.Parallel`, the path a
`--gpus-per-run N` study takes inside its Ray Train workers. The global batch is fixed
(`--batch` x `--accum` samples), so every world size trains the same tokens: the table gives tokens/s
over the timed steps (after `--warmup`), the scaling against one rank of the same variant and sharding,
peak memory of rank 0, and the last step's train loss relative to one rank's (the promise: the same
data and maths, all-reduce order aside). Worlds larger than the visible GPUs are skipped with a note.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _args import at_least

from reslab.models.config import DataConfig, ModelConfig, OptimConfig, ResidualConfig, RunConfig, TrainConfig


def run_config(args: argparse.Namespace, variant: str) -> RunConfig:
    steps = args.warmup + args.steps
    return RunConfig(
        model=ModelConfig(preset=args.preset), residual=ResidualConfig(name=variant, impl=args.impl),
        data=DataConfig(corpus="stdlib", tokenizer="byte"),
        optim=OptimConfig(batch_size=args.batch, grad_accum=args.accum, warmup_steps=1),
        train=TrainConfig(steps=steps, eval_every=steps, eval_windows=8, log_every=1, diagnostics=False,
                          device="cpu" if args.smoke else "auto", compile=args.compile),
    )


def _rank(rank: int, world: int, port: int, cfg: RunConfig, sharding: str, warmup: int, out: mp.Queue) -> None:
    from reslab.models.distributed import Parallel
    from reslab.models.training import Trainer

    cuda = torch.cuda.is_available() and cfg.train.device != "cpu"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    try:
        trainer = Trainer(cfg, parallel=Parallel.from_process_group(sharding))  # type: ignore[arg-type]
        marks: list[float] = []

        def mark(done: int) -> None:
            if cuda:
                torch.cuda.synchronize()
            if done == warmup or done == cfg.train.steps:
                marks.append(time.perf_counter())

        result = trainer.fit(on_step=mark)
        if rank == 0:
            tokens = trainer.tokens_per_step * (cfg.train.steps - warmup)
            peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else float("nan")
            out.put((tokens / (marks[1] - marks[0]), peak, result.history["train"][-1]["train_loss"]))
    finally:
        dist.destroy_process_group()


def measure(cfg: RunConfig, world: int, sharding: str, warmup: int) -> tuple[float, float, float]:
    """(global tokens/s over the timed steps, rank 0's peak MiB, last train loss) of one spawned run."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    mp.start_processes(_rank, args=(world, port, cfg, sharding, warmup, out), nprocs=world, start_method="spawn")
    return out.get(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="gpt2-124m", help="model preset (default gpt2-124m)")
    ap.add_argument("--variants", default="prenorm,attnres", help="comma-separated residual variants")
    ap.add_argument("--world", default="1,2", help="comma-separated world sizes (ranks, one GPU each)")
    ap.add_argument("--sharding", default="ddp,fsdp", help="comma-separated: ddp, fsdp")
    ap.add_argument("--batch", type=at_least(1), default=16, help="micro-batch samples (default 16)")
    ap.add_argument("--accum", type=at_least(1), default=2, help="grad_accum: global batch = batch x accum")
    ap.add_argument("--steps", type=at_least(1), default=8, help="timed steps (default 8)")
    ap.add_argument("--warmup", type=at_least(1), default=3, help="untimed steps first (default 3)")
    ap.add_argument("--impl", default="auto", help="residual impl: auto (Triton on GPUs), reference, triton")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model on every rank")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, CPU ranks (gloo)")
    args = ap.parse_args()
    if args.smoke:
        args = argparse.Namespace(**{**vars(args), "preset": "tiny", "batch": 2, "accum": 2, "steps": 2,
                                     "warmup": 1, "world": "1,2"})
    gpus = torch.cuda.device_count() if not args.smoke else 0
    print(f"{args.preset}, global batch {args.batch * args.accum} samples, {args.steps} timed steps, "
          f"{'CPU gloo ranks' if args.smoke else f'{gpus} GPU(s) visible'}\n")
    print("| variant | sharding | ranks | tokens/s | scaling vs 1 rank | peak MiB (rank 0) | last loss vs 1 rank |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for variant in args.variants.split(","):
        cfg = run_config(args, variant)
        for sharding in args.sharding.split(","):
            one: tuple[float, float, float] | None = None
            for world in (int(w) for w in args.world.split(",")):
                if not args.smoke and world > gpus:
                    print(f"| {variant} | {sharding} | {world} | skipped: {gpus} GPU(s) visible | | | |")
                    continue
                speed, peak, loss = measure(dataclasses.replace(cfg), world, sharding, args.warmup)
                one = one or (speed, peak, loss)
                print(f"| {variant} | {sharding} | {world} | {speed:,.0f} | {speed / one[0]:.2f}x | {peak:,.0f} | "
                      f"{(loss - one[2]) / one[2]:+.1e} |", flush=True)


if __name__ == "__main__":
    main()
