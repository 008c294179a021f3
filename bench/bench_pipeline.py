"""What crosses a pipeline stage boundary (issue 38): every variant split into S stages on gloo CPU ranks,
the bytes one training step sends across the boundaries, as a ratio to prenorm, and the median step time.

    python bench/bench_pipeline.py [--preset gpt2-124m --seq 64 --stages 2,4 --steps 3 --variants all]
    python bench/bench_pipeline.py --smoke      # the tiny preset, to check the script
    python bench/bench_pipeline.py --device cuda --stages 2 --seq 1024   # NCCL, one GPU per stage

Each stage count spawns S processes (gloo, one intra-op thread each) that build the same model from one seed
and train `--warmup` + `--steps` steps of `models.pipeline.Pipeline` (1F1B, S micro-batches of one sample
each, or GPipe with `--schedule gpipe`). Bytes are counted at the send calls (activations forward, their
gradients backward, every boundary, one step) and checked against the pathway's declaration
(`stage_state_elems`): the column "= decl." says they agree. Bytes scale with the tokens per step, so their
ratio to prenorm does not depend on `--seq`; the step time does (a shortened sequence keeps the 124M model's
steps to seconds on a CPU).

"V=2" and "V=2 cached": the same S ranks running 2 virtual stages each (the model split into 2 S stages, stage k
on rank k mod S, Interleaved 1F1B or LoopedBFS for GPipe), without and with Kimi's cross-stage caching (a rank
keeps what it held at the end of its previous virtual stage of a micro-batch; only what was appended since
crosses), both **measured** at the send calls and checked against the declaration (`declared_bytes`) in the
same "= decl." column. "refused" where `check_pipeline` refuses the cache for the variant (its state keeps
tensors but is declared whole), "-" where 2 S stages do not fit the layers.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _args import at_least

from reslab.common.errors import ConfigError
from reslab.models.backbone import build_model
from reslab.models.config import ModelConfig, ResidualConfig
from reslab.models.pipeline import Pipeline, PipelineOptions, check_pipeline, declared_bytes
from reslab.models.residual import variants

VOCAB = 50257


def _model(args: argparse.Namespace, variant: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(preset=args.preset, seq_len=args.seq)
    return build_model(cfg, ResidualConfig(name=variant), vocab_size=args.vocab)


def _measure(args: argparse.Namespace, model: torch.nn.Module, opts: PipelineOptions, device: torch.device) -> dict:
    """Timed steps of one layout: the last step's bytes (all boundaries, both ways), whether every boundary's
    count equals the declaration, the median step time."""
    pipe = Pipeline(model, opts)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, args.vocab, (opts.microbatches, args.seq), generator=gen).to(device)
    targets = torch.randint(0, args.vocab, (opts.microbatches, args.seq), generator=gen).to(device)
    times = []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        start = time.perf_counter()
        result = pipe.step(idx, targets)
        dist.barrier()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    declared = declared_bytes(model, opts, (opts.microbatches, args.seq))
    return {"total": sum(result.bytes_fwd) + sum(result.bytes_bwd), "declared": 2 * sum(declared),
            "agree": result.bytes_fwd == declared and result.bytes_bwd == declared,
            "median_s": statistics.median(times), "loss": result.loss}


def _variant(args: argparse.Namespace, variant: str, stages: int, device: torch.device) -> dict:
    """One variant on this rank: one stage per rank, then 2 virtual stages each without and with the cache."""
    model = _model(args, variant).to(device)
    opts = PipelineOptions(stages=stages, schedule=args.schedule, microbatches=stages)
    row: dict = {"variant": variant, "stages": stages, **_measure(args, model, opts, device)}
    virtual = dataclasses.replace(opts, virtual_stages=2)
    for key, layout in (("v2", virtual), ("v2c", dataclasses.replace(virtual, cross_stage_cache=True))):
        try:
            check_pipeline(model, layout)
        except ConfigError as err:
            row[key] = "refused" if "cross_stage_cache" in str(err) else None
            continue
        row[key] = _measure(args, model, layout, device)
    return row


def _rank(rank: int, stages: int, root: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{root}/store-{stages}", rank=rank, world_size=stages,
                            timeout=datetime.timedelta(seconds=1800))
    try:
        for variant in args.variants:
            row = _variant(args, variant, stages, device)
            if rank == 0:
                with open(f"{root}/rows.jsonl", "a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"  {variant} S={stages}: {row['median_s']:.2f} s", file=sys.stderr, flush=True)
    finally:
        dist.destroy_process_group()


def _cell(measured: dict | str | None, ref: dict | None) -> tuple[str, str]:
    """(MB/step, / prenorm's one-stage-per-rank bytes) of one virtual layout's measurement."""
    if not isinstance(measured, dict):
        return measured or "-", "-"
    ratio = f"{measured['total'] / ref['total']:.2f}x" if ref else "-"
    return f"{measured['total'] / 1e6:.2f}", ratio


def table(rows: list[dict]) -> str:
    base = {r["stages"]: r for r in rows if r["variant"] == "prenorm"}
    out = ["| variant | ranks S | MB/step (fwd+bwd) | / prenorm | V=2 MB/step | V=2 / prenorm | V=2 cached MB/step "
           "| cached / prenorm | = decl. | median step s | V=2 cached step s |", "|---" * 11 + "|"]
    for r in sorted(rows, key=lambda r: (r["stages"], r["variant"] != "prenorm", r["variant"])):
        ref = base.get(r["stages"])
        ratio = f"{r['total'] / ref['total']:.2f}x" if ref else "-"
        v2, v2r = _cell(r["v2"], ref)
        v2c, v2cr = _cell(r["v2c"], ref)
        measured = [m for m in (r, r["v2"], r["v2c"]) if isinstance(m, dict)]
        agree = "yes" if all(m["agree"] for m in measured) else "NO"
        cached_s = f"{r['v2c']['median_s']:.2f}" if isinstance(r["v2c"], dict) else "-"
        out.append(f"| {r['variant']} | {r['stages']} | {r['total'] / 1e6:.2f} | {ratio} | {v2} | {v2r} | {v2c} "
                   f"| {v2cr} | {agree} | {r['median_s']:.2f} | {cached_s} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2-124m")
    parser.add_argument("--seq", type=at_least(1), default=64, help="tokens per sample (the preset's 1024 shortened)")
    parser.add_argument("--vocab", type=at_least(2), default=VOCAB)
    parser.add_argument("--stages", default="2,4")
    parser.add_argument("--schedule", choices=["gpipe", "1f1b"], default="1f1b")
    parser.add_argument("--steps", type=at_least(1), default=3)
    parser.add_argument("--warmup", type=at_least(0), default=1)
    parser.add_argument("--variants", default="all")
    parser.add_argument("--smoke", action="store_true", help="the tiny preset, short")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cpu: gloo ranks; cuda: NCCL, one GPU per stage (needs as many GPUs as stages)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.preset, args.seq, args.vocab, args.steps = "tiny", 16, 256, 1
    args.variants = list(variants()) if args.variants == "all" else args.variants.split(",")
    if "prenorm" not in args.variants:
        args.variants.insert(0, "prenorm")
    stages = [int(s) for s in args.stages.split(",")]
    if args.device == "cuda" and max(stages) > torch.cuda.device_count():
        parser.error(f"--stages {max(stages)} on --device cuda needs {max(stages)} GPUs; "
                     f"this machine has {torch.cuda.device_count()}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as root:
        for s in stages:
            mp.spawn(_rank, args=(s, root, args), nprocs=s, join=True)
        rows = [json.loads(line) for line in Path(root, "rows.jsonl").read_text().splitlines()]
    backend = "NCCL" if args.device == "cuda" else "gloo"
    print(f"{args.device} ({backend}), preset {args.preset}, seq {args.seq}, {args.schedule}, "
          "S micro-batches of one sample (V=2: Interleaved 1F1B / LoopedBFS), "
          f"median of {args.steps} steps after {args.warmup}")
    print(table(rows))


if __name__ == "__main__":
    main()
