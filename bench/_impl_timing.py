"""The overhead half of `bench/bench_impls.py` (CUDA): paired step-time ratio against prenorm with its
interval, peak step memory over prenorm's, and decode time per layer (the docstring there says how)."""

from __future__ import annotations

import argparse
import gc
import math

import torch

from bench._impl_checks import CheckResult
from reslab.models.backbone import Decoder, build_model
from reslab.models.config import ModelConfig, ResidualConfig
from reslab.models.serving import Interval, decode_seconds, paired_ratio, step_seconds

VOCAB = 50304


def build(variant: str, options: dict, impl: str, seed: int, args: argparse.Namespace) -> Decoder:
    torch.manual_seed(seed)
    with torch.device("cuda"):
        return build_model(ModelConfig(preset=args.preset, seq_len=args.seq), ResidualConfig(name=variant,
                           options=options), vocab_size=VOCAB, impl=impl)


def stepper(model: Decoder, x: torch.Tensor):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def peak_above_resident(step) -> float:
    """GiB a step allocates at its peak above what was allocated before it."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**30


def paired_steps(variant: str, options: dict, impl: str, args: argparse.Namespace) -> tuple[Interval, float]:
    """The step-time ratio variant / prenorm over seeds x rounds of alternating pairs, and the peak ratio."""
    var_s, pre_s, peaks = [], [], []
    for seed in range(args.seeds):
        x = torch.randint(0, VOCAB, (args.batch, args.seq), device="cuda", generator=None)
        steps = (stepper(build("prenorm", {}, "reference", seed, args), x),
                 stepper(build(variant, options, impl, seed, args), x))
        for s in steps:  # warm-up: kernels compiled and autotuned, optimizer state allocated
            s()
            s()
        peaks.append(peak_above_resident(steps[1]) / peak_above_resident(steps[0]))
        for r in range(args.rounds):
            order = (0, 1) if (seed + r) % 2 == 0 else (1, 0)
            times = {i: step_seconds(steps[i], torch.device("cuda"))[0] for i in order}
            pre_s.append(times[0])
            var_s.append(times[1])
        del steps
        gc.collect()
        torch.cuda.empty_cache()
    return paired_ratio(var_s, pre_s), max(peaks)


def decode_ms_per_layer(variant: str, options: dict, impl: str, args: argparse.Namespace) -> float:
    model = build(variant, options, impl, 0, args).to(torch.bfloat16).eval()
    prompts = torch.randint(0, VOCAB, (1, 32), device="cuda")
    seconds = decode_seconds(model, prompts, new_tokens=8, repeats=3)
    return 1e3 * seconds / 8 / model.shape.n_layers


def overhead(args: argparse.Namespace, results: dict[tuple[str, str], list[CheckResult]],
             variants: dict[str, dict]) -> dict:
    """Print the overhead table for every (variant, impl) whose float32 and bfloat16 checks passed;
    `variants` maps each variant to its knobs."""
    print(f"\n### overhead against prenorm, {torch.cuda.get_device_name()}, {args.preset}, batch {args.batch} x "
          f"{args.seq}, bf16 autocast, eager; {args.seeds} seeds x {args.rounds} alternating rounds\n")
    print("| variant | impl | step time / prenorm (95% interval) | peak step memory / prenorm | "
          "decode ms per layer per token (prenorm) | note |")
    print("|---|---|---|---|---|---|", flush=True)
    base = decode_ms_per_layer("prenorm", {}, "reference", args)
    out = {}
    for (variant, impl), checks in results.items():
        needed = [c for c in checks if c.name in ("fwd+bwd float32", "fwd+bwd bfloat16")]
        if len(needed) != 2 or not all(c.passed for c in needed):  # unavailable, or wrong: its speed means nothing
            continue
        try:
            ratio, peak = paired_steps(variant, variants[variant], impl, args)
            dec = decode_ms_per_layer(variant, variants[variant], impl, args)
            note = ""
        except Exception as exc:  # one failing row is reported, the others still run
            ratio, peak, dec = Interval(math.nan, math.nan, math.nan, 0, 0.95), math.nan, math.nan
            note = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
        out[(variant, impl)] = {"step_ratio": ratio.__dict__, "peak_ratio": peak, "decode_ms_per_layer": dec}
        print(f"| {variant} | {impl} | {ratio.estimate:.3f} ({ratio.low:.3f}, {ratio.high:.3f}) | {peak:.2f} | "
              f"{dec:.3f} ({base:.3f}) | {note} |", flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    return out
