"""What recording magnitudes across depth (`train.magnitudes`, models/magnitudes.py) adds to a run's training
time, printed as a markdown table (issue 36's target: at most 3% at the tiny and gpt2-124m presets).

The recording costs nothing on a training step that no evaluation follows (one `is None` test per sublayer);
on the step before an evaluation it sums the squares of the step's gradients per sublayer (`grad`), and during
the evaluation it sums the squares of every sublayer's read and output (`eval`). Both are timed here against
the same work without them, interleaved (on, off, on, off, ...) on the same `Trainer`s, medians of `--reps`:

    python bench/bench_magnitudes.py [--presets tiny gpt2-124m --reps 5]

Per preset: a training step, the extra time of the gradient sums, the evaluation of `--windows` windows with and
without the recorder, and the overhead on a run, (grad + windows x eval delta per window) / (eval_every x step +
windows x eval per window), at the evaluation schedule of the shipped studies (`SCHEDULES`). On a CPU the
gpt2-124m shape trains at a shortened context and small batch (`--gpt2-seq`, `--gpt2-batch`) on the byte-level
stdlib corpus (vocabulary 256+, not GPT-2's 50,257): the table says so.
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
from reslab.models.magnitudes import MagnitudeRecorder
from reslab.models.training import Trainer, evaluate

# preset -> (eval_every, eval_windows) of the shipped studies at that scale: quickstart.yaml's, and the GPU
# studies' (delta_vs_cumulative.yaml: every 500 steps, 1024 windows)
SCHEDULES = {"tiny": (50, 128), "gpt2-124m": (500, 1024)}


def _config(preset: str, seq: int | None, batch: int, windows: int) -> RunConfig:
    return RunConfig(model=ModelConfig(preset=preset, seq_len=seq), residual=ResidualConfig(name="prenorm"),
                     data=DataConfig(corpus="stdlib", tokenizer="byte"),
                     optim=OptimConfig(batch_size=batch, warmup_steps=1),
                     train=TrainConfig(steps=10_000, eval_every=10_000, eval_windows=windows, diagnostics=False,
                                       device="cpu" if not torch.cuda.is_available() else "auto"),
                     cost=CostConfig(measure=False))


def _timed(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    tic = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - tic


def measure(preset: str, seq: int | None, batch: int, windows: int, reps: int) -> dict[str, float]:
    """Median seconds: a training step, the gradient sums, an evaluation with and without the recorder."""
    trainer = Trainer(_config(preset, seq, batch, windows))
    model, sites = trainer.model, 2 * trainer.model.shape.n_layers
    step, grad, eval_on, eval_off = [], [], [], []
    trainer.train_step(0)  # warm-up
    for rep in range(reps):
        step.append(_timed(lambda rep=rep: trainer.train_step(rep + 1)))
        trainer.forward_backward(rep + 1)  # gradients to sum, as the step before an evaluation has them
        grad.append(_timed(trainer._grad_square_sums))
        trainer.optimizer.zero_grad(set_to_none=True)
        for on in ((True, False) if rep % 2 == 0 else (False, True)):
            recorder = MagnitudeRecorder(sites, trainer.device) if on else None
            took = _timed(lambda recorder=recorder: evaluate(model, trainer.val_batches, trainer.device,
                                                             trainer.autocast, magnitudes=recorder))
            (eval_on if on else eval_off).append(took)
    return {"step": statistics.median(step), "grad": statistics.median(grad), "eval_on": statistics.median(eval_on),
            "eval_off": statistics.median(eval_off), "seq": model.shape.seq_len, "layers": model.shape.n_layers,
            "params": sum(p.numel() for p in model.parameters())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "gpt2-124m"], choices=sorted(SCHEDULES))
    parser.add_argument("--reps", type=at_least(2), default=5)
    parser.add_argument("--windows", type=at_least(1), default=16, help="eval windows timed per evaluation")
    parser.add_argument("--gpt2-seq", type=at_least(8), default=128, help="gpt2-124m context on a CPU")
    parser.add_argument("--gpt2-batch", type=at_least(1), default=2, help="gpt2-124m batch on a CPU")
    args = parser.parse_args()
    torch.manual_seed(0)
    gpu = torch.cuda.is_available()
    where = torch.cuda.get_device_name() if gpu else f"CPU, {torch.get_num_threads()} threads"
    print(f"#### magnitudes across depth: overhead on training ({where}, torch {torch.__version__})")
    print("prenorm, byte-level stdlib corpus; medians of interleaved repetitions; run overhead = (grad + windows x "
          "eval delta per window) / (eval_every x step + windows x eval per window)\n")
    print("| preset | layers | params | seq x batch | step s | grad sums s | eval s/window off | eval s/window on "
          "| eval_every, windows | run overhead |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for preset in args.presets:
        big = preset != "tiny" and not gpu
        seq, batch = (args.gpt2_seq, args.gpt2_batch) if big else (None, 16)
        m = measure(preset, seq, batch, args.windows, args.reps)
        every, windows = SCHEDULES[preset]
        off, on = m["eval_off"] / args.windows, m["eval_on"] / args.windows
        overhead = (m["grad"] + windows * (on - off)) / (every * m["step"] + windows * off)
        shape = f"{m['seq']} x {batch}" + (" (shortened on CPU)" if big else "")
        print(f"| {preset} | {m['layers']} | {m['params'] / 1e6:.1f}M | {shape} | {m['step']:.4f} | {m['grad']:.5f} | "
              f"{off:.5f} | {on:.5f} | {every}, {windows} | {100 * overhead:+.2f}% |", flush=True)


if __name__ == "__main__":
    main()
