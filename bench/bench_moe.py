"""Training speed of a mixture-of-experts decoder against the dense one with the same active parameters.

    python bench/bench_moe.py [--dense tiny --moe tiny-moe --batch 16 --steps 20 --device cpu]

One AdamW training step (forward with the MoE balance loss, backward, optimizer, the bias hook of
`models.training.moe_balance_step`) of pre-norm at each preset, timed as the median of `--steps` after 3
warm-up steps on random byte tokens: tokens/s and the MoE's over the dense one's (issue 37's target on the CPU:
>= 0.6x). `tiny-moe` (8 experts of width 96, top-2) has `tiny`'s active FFN; `small-moe` (64 experts, 8 + 1
shared active) is `small`'s, for a GPU. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from reslab.models.backbone import build_model
from reslab.models.config import ModelConfig, ResidualConfig
from reslab.models.training import moe_balance_step

VOCAB = 257


def step_seconds(preset: str, batch: int, steps: int, device: torch.device) -> tuple[float, dict[str, int], int]:
    """(median seconds per training step, param counts, tokens per step)."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset=preset), ResidualConfig(name="prenorm"), vocab_size=VOCAB).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seq = model.shape.seq_len
    gen = torch.Generator().manual_seed(1)
    times = []
    for i in range(steps + 3):
        idx = torch.randint(0, VOCAB, (batch, seq + 1), generator=gen).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        tic = time.perf_counter()
        out = model(idx[:, :-1], idx[:, 1:])
        assert out.loss is not None
        (out.loss if out.aux_loss is None else out.loss + out.aux_loss).backward()
        moe_balance_step(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 3:
            times.append(time.perf_counter() - tic)
    return statistics.median(times), model.param_counts(), batch * seq


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dense", default="tiny")
    parser.add_argument("--moe", default="tiny-moe")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"device {device}, torch threads {torch.get_num_threads()}, batch {args.batch}, median of {args.steps} "
          "steps after 3 warm-up\n")
    print("| preset | params total | params active | tokens/s | x dense |")
    print("|---|---:|---:|---:|---:|")
    base = None
    for preset in (args.dense, args.moe):
        seconds, counts, tokens = step_seconds(preset, args.batch, args.steps, device)
        tps = tokens / seconds
        base = tps if base is None else base
        print(f"| {preset} | {counts['total']:,} | {counts['active']:,} | {tps:,.0f} | {tps / base:.2f} |")


if __name__ == "__main__":
    main()
