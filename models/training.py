"""The training loop: one run of one `RunConfig`, deterministic, resumable, loud on divergence.

AdamW (decoupled weight decay on Linear/Embedding weights by default), warmup + cosine to
`min_lr_ratio * lr`, gradient accumulation and clipping, bf16 autocast on CUDA and float32 on
CPU, optional `torch.compile`. Batches are a pure function of (data seed, step, micro step), so
the data position is the step, and a resumed run continues the exact same curve.

Callers observe progress through a `TrainCallback`; the loop itself knows nothing of MLflow.
"""

from __future__ import annotations

import json
import math
import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from reslab.kernels import select_impl
from reslab.models.backbone import Decoder, build_model
from reslab.models.config import RunConfig, canonical_json, validate_run_config
from reslab.models.diagnostics import collect_diagnostics

CHECKPOINT_NAME = "checkpoint.pt"
# the fixed validation passages for effective depth: the first ones of the eval batches, so every
# checkpoint of a run (and every arm of a study with the same data) is measured on the same text
DEFF_PASSAGES = 64


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; the run stops instead of logging a garbage curve."""


class TrainCallback(Protocol):
    def on_start(self, info: dict[str, Any]) -> None: ...
    def on_log(self, step: int, metrics: dict[str, float]) -> None: ...
    def on_eval(self, step: int, metrics: dict[str, float], diagnostics: dict[str, Any]) -> None: ...
    def on_checkpoint(self, step: int, path: Path) -> None: ...


@dataclass
class TrainResult:
    summary: dict[str, float]
    history: dict[str, list[dict[str, float]]]
    info: dict[str, Any] = field(default_factory=dict)


def pick_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(requested)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"train.device={requested!r} but CUDA is not available on this machine")
    return device


def pick_dtype(requested: str, device: torch.device) -> torch.dtype:
    if requested == "auto":
        # bf16 on CPU is about 30x slower than float32 here
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[requested]


def lr_at(step: int, cfg: RunConfig) -> float:
    """Linear warmup to `lr`, then cosine decay to `min_lr_ratio * lr` at the last step."""
    o, total = cfg.optim, cfg.train.steps
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    span = max(1, total - 1 - o.warmup_steps)
    progress = min(1.0, (step - o.warmup_steps) / span)
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: nn.Module, cfg: RunConfig, device: torch.device) -> torch.optim.AdamW:
    decay, no_decay = [], []
    decayed = set()
    if cfg.optim.decay_scope == "matrices":
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                decayed.add(id(module.weight))
    for p in model.parameters():
        if cfg.optim.decay_scope == "all" or id(p) in decayed:
            decay.append(p)
        else:
            no_decay.append(p)
    o = cfg.optim
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=device.type == "cuda",
    )


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _save_atomic(obj: dict, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


@torch.no_grad()
def evaluate(model: Decoder, batches, device, autocast) -> float:
    model.eval()
    total = 0.0
    for x, y in batches:
        with autocast():
            total += model(x.to(device), y.to(device)).loss.item()
    model.train()
    return total / len(batches)


def train(
    cfg: RunConfig,
    run_dir: str | Path | None = None,
    *,
    callback: TrainCallback | None = None,
    resume: bool = True,
    stop_after: int | None = None,
    log: Callable[[str], None] | None = None,
) -> TrainResult:
    """Train one run. With `run_dir`, checkpoints go there and an existing one is resumed.

    `stop_after=k` returns after k optimizer steps (used to test interruption and resume).
    """
    from reslab.models.data import TokenDataset

    cfg = validate_run_config(cfg)
    t, o = cfg.train, cfg.optim
    device = pick_device(t.device)
    dtype = pick_dtype(t.dtype, device)
    impl = select_impl(cfg.residual.impl, device.type)
    say = log or (lambda _msg: None)

    dataset = TokenDataset.open(cfg.data)
    torch.manual_seed(t.seed)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(t.seed)
        torch.cuda.reset_peak_memory_stats(device)
    model = build_model(cfg.model, cfg.residual, vocab_size=dataset.vocab_size, impl=impl).to(device)
    resuming = resume and run_dir is not None and (Path(run_dir) / CHECKPOINT_NAME).exists()
    if t.init_from is not None and not resuming:
        model.load_state_dict(torch.load(t.init_from, map_location=device, weights_only=True))
        say(f"initialised from {t.init_from}")
    seq_len = model.shape.seq_len
    optimizer = make_optimizer(model, cfg, device)
    forward = torch.compile(model) if t.compile else model

    def autocast():
        return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    val_batches = dataset.val_batches(t.eval_batches, o.batch_size, seq_len)
    history: dict[str, list[dict[str, float]]] = {"train": [], "eval": []}
    # the train-loss log is a mean over the steps since the last log line; a resume keeps it whole
    window = {"loss": 0.0, "steps": 0, "time": 0.0}
    start_step = 0
    config_json = canonical_json(cfg)
    ckpt_path = Path(run_dir) / CHECKPOINT_NAME if run_dir is not None else None
    if ckpt_path is not None:
        ckpt_path.parent.mkdir(parents=True, exist_ok=True)
    if resume and ckpt_path is not None and ckpt_path.exists():
        ckpt = torch.load(ckpt_path, map_location=device, weights_only=True)
        if ckpt["config"] != config_json:
            raise RuntimeError(
                f"{ckpt_path} was written by a different config; refusing to resume it. "
                "Delete the run directory or use a new one."
            )
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        torch.set_rng_state(ckpt["rng_cpu"])
        if device.type == "cuda" and "rng_cuda" in ckpt:
            torch.cuda.set_rng_state(ckpt["rng_cuda"])
        history = json.loads(ckpt["history"])
        start_step = ckpt["step"]
        window = json.loads(ckpt["log_window"])
        say(f"resumed from {ckpt_path} at step {start_step}")

    counts = model.param_counts()
    info = {
        "device": str(device), "dtype": str(dtype).removeprefix("torch."), "impl": impl,
        "data_fingerprint": dataset.fingerprint, "vocab_size": dataset.vocab_size,
        "n_train_tokens": dataset.n_train_tokens, "n_val_tokens": dataset.n_val_tokens,
        "params": counts, "params_residual_per_layer": model.pathway.extra_params_per_layer(),
        "shape": model.shape.__dict__, "start_step": start_step, "torch": torch.__version__,
    }
    if callback is not None:
        callback.on_start(info)
    say(
        f"{cfg.residual.name} | {counts['total'] / 1e6:.2f}M params "
        f"(residual +{counts['residual']}) | {device} {info['dtype']} | impl={impl} | "
        f"data {dataset.fingerprint[:12]}"
    )

    def save_checkpoint(step: int) -> None:
        if ckpt_path is None:
            return
        state = {
            "model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
            "rng_cpu": torch.get_rng_state(), "config": config_json, "history": json.dumps(history),
            "log_window": json.dumps(window),
        }
        if device.type == "cuda":
            state["rng_cuda"] = torch.cuda.get_rng_state()
        _save_atomic(state, ckpt_path)
        if callback is not None:
            callback.on_checkpoint(step, ckpt_path)

    tokens_per_step = o.batch_size * o.grad_accum * seq_len
    train_time = 0.0
    wall_start = time.perf_counter()
    model.train()
    step = start_step
    for step in range(start_step, t.steps):
        tic = time.perf_counter()
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum = 0.0
        for micro in range(o.grad_accum):
            x, y = dataset.train_batch(step, micro, o.batch_size, seq_len, cfg.data_seed)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast():
                out = forward(x, y)
                objective = out.loss if out.aux_loss is None else out.loss + out.aux_loss
            (objective / o.grad_accum).backward()
            loss_sum += out.loss.item()
        loss = loss_sum / o.grad_accum
        if not math.isfinite(loss):
            raise TrainingDiverged(
                f"loss is {loss} at step {step + 1} (lr {lr:.3g}); stopping. Lower optim.lr, "
                f"raise optim.warmup_steps or check the variant's knobs."
            )
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip if o.grad_clip > 0 else float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - tic
        train_time += elapsed
        window = {"loss": window["loss"] + loss, "steps": window["steps"] + 1, "time": window["time"] + elapsed}
        done = step + 1

        if done % t.log_every == 0 or done == t.steps:
            metrics = {
                "train_loss": window["loss"] / window["steps"], "lr": lr, "grad_norm": float(grad_norm),
                "tokens_per_s": tokens_per_step * window["steps"] / window["time"],
            }
            history["train"].append({"step": done, **metrics})
            if callback is not None:
                callback.on_log(done, metrics)
            window = {"loss": 0.0, "steps": 0, "time": 0.0}

        if done % t.eval_every == 0 or done == t.steps:
            val_loss = evaluate(model, val_batches, device, autocast)
            tail = [e["val_loss"] for e in history["eval"][-(t.tail_k - 1):]] if t.tail_k > 1 else []
            tail.append(val_loss)
            metrics = {"val_loss": val_loss, "val_loss_tail": sum(tail) / len(tail)}
            diagnostics = {}
            if t.diagnostics:
                diagnostics, scalars = collect_diagnostics(model, val_batches, deff_passages=DEFF_PASSAGES)
                metrics.update(scalars)
            history["eval"].append({"step": done, **metrics})
            last_train = history["train"][-1]["train_loss"] if history["train"] else float("nan")
            say(
                f"step {done:>6}/{t.steps} | train {last_train:.4f} | val {val_loss:.4f} "
                f"(tail {metrics['val_loss_tail']:.4f}) | lr {lr:.2e} | "
                f"{tokens_per_step * (done - start_step) / max(train_time, 1e-9) / 1e3:.1f}k tok/s"
            )
            if callback is not None:
                callback.on_eval(done, metrics, diagnostics)

        if t.checkpoint_every and done % t.checkpoint_every == 0 and done != t.steps:
            save_checkpoint(done)
        if stop_after is not None and done - start_step >= stop_after and done != t.steps:
            save_checkpoint(done)
            return TrainResult(summary={"interrupted_at": float(done)}, history=history, info=info)

    save_checkpoint(t.steps)
    last_eval = history["eval"][-1]
    summary = {
        "val_loss": last_eval["val_loss"],
        "val_loss_tail": last_eval["val_loss_tail"],
        "train_loss": history["train"][-1]["train_loss"],
        "tokens_per_s": tokens_per_step * (t.steps - start_step) / max(train_time, 1e-9),
        "train_time_s": train_time,
        "wall_time_s": time.perf_counter() - wall_start,
        "peak_mem_mb": _peak_memory_mb(device),
        "params_total": float(counts["total"]),
        "params_residual": float(counts["residual"]),
        "tokens": float(tokens_per_step * t.steps),
    }
    say(
        f"done: val {summary['val_loss']:.4f} (tail-{t.tail_k} {summary['val_loss_tail']:.4f}) | "
        f"train {summary['train_loss']:.4f} | {summary['tokens_per_s'] / 1e3:.1f}k tok/s | "
        f"{summary['train_time_s']:.1f}s training | peak mem {summary['peak_mem_mb']:.0f} MiB"
    )
    return TrainResult(summary=summary, history=history, info=info)
