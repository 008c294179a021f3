"""Step time of Muon + AdamW (`optim.name: muon`, models/optim/muon.py) against AdamW alone, printed as a markdown
table (issue 37's target: a Muon training step within 1.3x of an AdamW one at the gpt2-124m shape).

Two `Trainer`s of one config that differ only in `optim.name` train interleaved (adamw, muon, adamw, ...),
medians of `--reps` after `--warmup` steps each. Per preset: the whole training step (forward, backward,
clipping, optimizer), the optimizer step alone (on the gradients of one backward), and the ratio of the whole
steps, measured and (less exposed to a loaded machine's noise) as the AdamW step with its optimizer step
swapped for Muon's, (step AdamW - opt AdamW + opt Muon) / step AdamW, and from the parts timed apart after
each whole step, warm: forward + backward (the mean of the two runs', the same computation) plus each
optimizer step, (fwd+bwd + opt Muon) / (fwd+bwd + opt AdamW); the last needs no warm-up step to be warm.
Muon's extra cost is its Newton-Schulz
iterations (`optim.options.ns_steps`, 5), a fixed cost per step whatever the batch, so the ratio falls as tokens
per step grow: on a CPU the gpt2-124m shape trains at a shortened context and small batch (`--gpt2-seq`,
`--gpt2-batch`) on the byte-level stdlib corpus (vocabulary 256+, not GPT-2's 50,257), far fewer tokens per
step than a real run's; the table says so.

    python bench/bench_optim.py [--presets tiny gpt2-124m --reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from _args import at_least

from reslab.models.config import (
    CostConfig,
    DataConfig,
    ModelConfig,
    OptimConfig,
    ResidualConfig,
    RunConfig,
    TrainConfig,
)
from reslab.models.training import Trainer


def _config(preset: str, seq: int | None, batch: int, name: str, vocab: int | None = None) -> RunConfig:
    return RunConfig(model=ModelConfig(preset=preset, seq_len=seq, vocab_size=vocab),
                     residual=ResidualConfig(name="prenorm"),
                     data=DataConfig(corpus="stdlib", tokenizer="byte"),
                     optim=OptimConfig(batch_size=batch, warmup_steps=1, name=name),
                     train=TrainConfig(steps=10_000, eval_every=10_000, eval_windows=8, diagnostics=False,
                                       device="cpu" if not torch.cuda.is_available() else "auto"),
                     cost=CostConfig(measure=False))


def _timed(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    tic = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - tic) * 1e3


def measure(preset: str, seq: int | None, batch: int, reps: int, warmup: int,
            vocab: int | None = None, parts: bool = False) -> dict[str, float]:
    """Medians in ms: `step_*` whole steps (absent with `parts`), `fb_*` forward + backward, `opt_*` the optimizer
    step; with `parts` the optimizer step is timed 3 times on one backward's gradients (its cost does not depend on
    their values; the first call, which allocates the state, is the warm-up) and no whole step is taken."""
    trainers = {name: Trainer(_config(preset, seq, batch, name, vocab)) for name in ("adamw", "muon")}
    step = {name: 0 for name in trainers}
    full: dict[str, list[float]] = {name: [] for name in trainers}
    opt: dict[str, list[float]] = {name: [] for name in trainers}
    fb: dict[str, list[float]] = {name: [] for name in trainers}

    def one(name: str) -> None:
        trainers[name].train_step(step[name])
        step[name] += 1

    for _ in range(warmup):
        for name in trainers:
            one(name)
    for _ in range(reps):
        for name, t in trainers.items():
            if not parts:
                full[name].append(_timed(lambda name=name: one(name)))
            fb[name].append(_timed(lambda t=t, name=name: t.forward_backward(step[name])))
            if parts:
                t.optimizer.step()
            opt[name] += [_timed(t.optimizer.step) for _ in range(3 if parts else 1)]
            t.optimizer.zero_grad(set_to_none=True)
    m = trainers["muon"].model
    return {"tokens": batch * m.shape.seq_len, "seq": m.shape.seq_len,
            **{f"{k}_{n}": statistics.median(v) if v else float("nan")
               for k, d in (("step", full), ("opt", opt), ("fb", fb)) for n, v in d.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["tiny", "gpt2-124m"])
    ap.add_argument("--reps", type=at_least(1), default=5)
    ap.add_argument("--warmup", type=at_least(0), default=2)
    ap.add_argument("--batch", type=at_least(1), default=16, help="batch of the presets other than gpt2-124m")
    ap.add_argument("--gpt2-seq", type=at_least(8), default=128, help="gpt2-124m context on a CPU (1024 on CUDA)")
    ap.add_argument("--gpt2-batch", type=at_least(1), default=4)
    ap.add_argument("--gpt2-vocab", type=at_least(0), default=0,
                    help="gpt2-124m's embedding rows (50304: GPT-2's 50,257 padded, the real shape's 124M parameters; "
                         "0: the byte corpus's 320); the ids stay bytes, the embedding and head are full size")
    ap.add_argument("--parts", action="store_true",
                    help="time forward+backward and the optimizer step apart, no whole steps: a step ratio at shapes "
                         "too slow on a CPU for whole interleaved steps (the last column)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    cuda = torch.cuda.is_available()
    print(f"device: {'cuda' if cuda else 'cpu'}, torch threads {torch.get_num_threads()}, reps {args.reps}, "
          f"medians, prenorm, interleaved adamw/muon\n")
    print("| preset | seq x batch | step AdamW ms | step Muon ms | Muon / AdamW | opt.step AdamW ms "
          "| opt.step Muon ms | Muon / AdamW via opt.step | fwd+bwd ms | Muon / AdamW via fwd+bwd |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for preset in args.presets:
        gpt2 = preset == "gpt2-124m"
        seq = None if not gpt2 or cuda else args.gpt2_seq
        batch = args.gpt2_batch if gpt2 else args.batch
        r = measure(preset, seq, batch, args.reps, args.warmup, (args.gpt2_vocab or None) if gpt2 else None,
                    args.parts)
        fb = statistics.mean([r["fb_adamw"], r["fb_muon"]])  # the same forward and backward in both runs
        shape = f"{r['seq']:.0f} x {batch}" + (" (shortened)" if gpt2 and not cuda and r["seq"] < 1024 else "") \
            + (f", vocab {args.gpt2_vocab}" if gpt2 and args.gpt2_vocab else "")
        print(f"| {preset} | {shape} | {r['step_adamw']:.1f} | {r['step_muon']:.1f} | "
              f"{r['step_muon'] / r['step_adamw']:.2f}x | {r['opt_adamw']:.1f} | {r['opt_muon']:.1f} | "
              f"{(r['step_adamw'] - r['opt_adamw'] + r['opt_muon']) / r['step_adamw']:.2f}x | {fb:.1f} | "
              f"{(fb + r['opt_muon']) / (fb + r['opt_adamw']):.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
