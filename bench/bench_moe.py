"""Training speed of a mixture-of-experts decoder against the dense one with the same active parameters.

    python bench/bench_moe.py [--dense tiny --moe tiny-moe --batch 16 --steps 20 --device cpu]

One AdamW training step (forward with the MoE balance loss, backward, optimizer, the bias hook of
`models.training.moe_balance_step`) of pre-norm at each preset, timed as the median of `--steps` after 3
warm-up steps on random byte tokens, the two models' steps interleaved (load from other processes hits both
alike): tokens/s and the MoE's over the dense one's (issue 37's target on the CPU: >= 0.6x).
`tiny-moe` (8 experts of width 96, top-2) has `tiny`'s active FFN; `small-moe` (64 experts, 8 + 1
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


class Bench:
    """One preset's pre-norm model, optimizer and token stream, timed one training step at a time."""

    def __init__(self, preset: str, batch: int, device: torch.device):
        torch.manual_seed(0)
        self.preset, self.batch, self.device = preset, batch, device
        self.model = build_model(ModelConfig(preset=preset), ResidualConfig(name="prenorm"),
                                 vocab_size=VOCAB).to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.gen = torch.Generator().manual_seed(1)
        self.times: list[float] = []

    @property
    def tokens(self) -> int:
        return self.batch * self.model.shape.seq_len

    def step(self, timed: bool) -> None:
        idx = torch.randint(0, VOCAB, (self.batch, self.model.shape.seq_len + 1), generator=self.gen).to(self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        tic = time.perf_counter()
        out = self.model(idx[:, :-1], idx[:, 1:])
        assert out.loss is not None
        (out.loss if out.aux_loss is None else out.loss + out.aux_loss).backward()
        moe_balance_step(self.model)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if timed:
            self.times.append(time.perf_counter() - tic)


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
    benches = [Bench(args.dense, args.batch, device), Bench(args.moe, args.batch, device)]
    for i in range(args.steps + 3):  # interleaved, so load from other processes hits both alike
        for b in benches:
            b.step(timed=i >= 3)
    base = None
    for b in benches:
        tps = b.tokens / statistics.median(b.times)
        base = tps if base is None else base
        counts = b.model.param_counts()
        print(f"| {b.preset} | {counts['total']:,} | {counts['active']:,} | {tps:,.0f} | {tps / base:.2f} |")

if __name__ == "__main__":
    main()
