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
from reslab.models.config import DEVICE_RE, DivergenceConfig, RunConfig, canonical_json
from reslab.models.diagnostics import collect_diagnostics
from reslab.common.errors import ConfigError, RunFailed
from reslab.models.resolve import validate_run_config

CHECKPOINT_NAME = "checkpoint.pt"

class TrainingDiverged(RunFailed):
    """A divergence rule fired (`train.divergence`); the run stops instead of logging a garbage curve."""


class CheckpointUnreadable(RunFailed):
    """A checkpoint file exists but cannot be loaded; retrying would fail the same way."""


class StopRun(Exception):
    """Raised by an `on_step` callback to stop a run part-way at `step`; `train` checkpoints the
    run at that step first, so resuming continues from it."""

    def __init__(self, step: int, reason: str = "stopped") -> None:
        super().__init__(f"{reason} at step {step}")
        self.step = step


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
    """`train.device` as a torch device that exists on this machine, else `ConfigError` saying
    which devices do."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if DEVICE_RE.match(requested) is None:
        raise ConfigError(f"train.device: {requested!r} is not a device; allowed: auto, cpu, mps, cuda, cuda:N")
    device = torch.device(requested)
    n_cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    has_mps = torch.backends.mps.is_available()
    here = ["auto", "cpu", *(f"cuda:{i}" for i in range(n_cuda)), *(["mps"] if has_mps else [])]
    if device.type == "cuda" and (n_cuda == 0 or (device.index or 0) >= n_cuda):
        found = f"{n_cuda} CUDA device(s)" if n_cuda else "no CUDA device"
        raise ConfigError(f"train.device: {requested!r} but this machine has {found}; allowed here: {', '.join(here)}")
    if device.type == "mps" and not has_mps:
        raise ConfigError(f"train.device: 'mps' is not available on this machine; allowed here: {', '.join(here)}")
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


def _save_atomic(obj: dict, path: Path, commit: Callable[[Callable[[], None]], None] | None = None) -> None:
    """Write a sibling, then rename it over `path`; `commit` wraps the rename (the worker's lease fence)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(obj, tmp)
    try:
        if commit is None:
            os.replace(tmp, path)
        else:
            commit(lambda: os.replace(tmp, path))
    finally:
        tmp.unlink(missing_ok=True)


def load_checkpoint(path: Path, device: torch.device) -> dict[str, Any]:
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except Exception as exc:  # torch raises many types for a damaged zip/pickle
        raise CheckpointUnreadable(
            f"{path} cannot be loaded ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); move it away "
            "to restart the run from step 0"
        ) from None
    if not isinstance(ckpt, dict) or not {"model", "optimizer", "step", "config"} <= set(ckpt):
        raise CheckpointUnreadable(f"{path} is not a reslab checkpoint; move it away to restart the run from step 0")
    return ckpt


def _segment_totals(segments: list[dict[str, float]], tokens_per_step: int) -> dict[str, float]:
    """Throughput over the steps that ran, summed over segments (a resumed run has several)."""
    steps = sum(s["end_step"] - s["start_step"] for s in segments)
    train_time = sum(s["train_time_s"] for s in segments)
    return {
        "tokens_per_s": tokens_per_step * steps / train_time if steps and train_time > 0 else math.nan,
        "train_time_s": train_time,
        "wall_time_s": sum(s["wall_time_s"] for s in segments),
        "peak_mem_mb": max((s["peak_mem_mb"] for s in segments), default=math.nan),
    }


def _check_eval(val_loss: float, step: int, initial_loss: float | None, strikes: int,
                rule: DivergenceConfig) -> int:
    """Apply `train.divergence` to one evaluation; returns the strikes so far, raises when it fires."""
    if not math.isfinite(val_loss):
        raise TrainingDiverged(f"val_loss is {val_loss} at step {step} (evaluation); stopping. Lower optim.lr, "
                               "raise optim.warmup_steps or check the variant's knobs.")
    if rule.max_loss_ratio is None or initial_loss is None:
        return 0
    bound = rule.max_loss_ratio * initial_loss
    strikes = strikes + 1 if val_loss > bound else 0
    if strikes >= rule.patience:
        raise TrainingDiverged(
            f"val_loss {val_loss:.4g} at step {step} is above {rule.max_loss_ratio:g} x the initial loss "
            f"{initial_loss:.4g} for {strikes} evaluation(s) in a row (train.divergence); stopping. Lower optim.lr "
            "or relax train.divergence.max_loss_ratio / patience."
        )
    return strikes


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
    on_step: Callable[[int], None] | None = None,
    log: Callable[[str], None] | None = None,
    commit: Callable[[Callable[[], None]], None] | None = None,
) -> TrainResult:
    """Train one run. With `run_dir`, checkpoints go there and an existing one is resumed.

    `on_step(done)` runs after every optimizer step (after that step's log, evaluation and
    checkpoint) with the number of steps done; whatever it raises (`StopRun` to stop on purpose)
    propagates to the caller after the run is checkpointed at that step, unless it was the last
    (the run's end writes the final checkpoint).
    `commit(rename)` performs each checkpoint's final rename; the worker passes its lease fence,
    so a run taken over by another process can no longer replace the checkpoint.

    A run resumed from its final checkpoint trains nothing and returns the result stored in it,
    so its summary is the one it finished with. Throughput and time figures count only the steps
    each segment (one process's stretch of the run) actually trained; `info["segments"]` lists them.
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
    segments: list[dict[str, float]] = []
    initial_loss: float | None = None
    strikes = 0
    finished: dict[str, Any] | None = None
    if resume and ckpt_path is not None and ckpt_path.exists():
        ckpt = load_checkpoint(ckpt_path, device)
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
        segments = json.loads(ckpt.get("segments", "[]"))
        initial_loss = ckpt.get("initial_loss")
        strikes = int(ckpt.get("strikes", 0))
        finished = json.loads(ckpt["result"]) if "result" in ckpt else None
        say(f"resumed from {ckpt_path} at step {start_step}")

    counts = model.param_counts()
    info: dict[str, Any] = {
        "device": str(device), "dtype": str(dtype).removeprefix("torch."), "impl": impl,
        "data_fingerprint": dataset.fingerprint, "vocab_size": dataset.vocab_size,
        "n_train_tokens": dataset.n_train_tokens, "n_val_tokens": dataset.n_val_tokens,
        "params": counts, "params_residual_per_layer": model.pathway.extra_params_per_layer(),
        "shape": model.shape.__dict__, "start_step": start_step, "torch": torch.__version__,
    }
    if callback is not None:
        callback.on_start(info)
    if finished is not None and start_step >= t.steps:
        say(f"{ckpt_path} is the final checkpoint: nothing to train, returning its stored result")
        return TrainResult(summary=finished["summary"], history=history, info=finished["info"])
    say(
        f"{cfg.residual.name} | {counts['total'] / 1e6:.2f}M params "
        f"(residual +{counts['residual']}) | {device} {info['dtype']} | impl={impl} | "
        f"data {dataset.fingerprint[:12]}"
    )

    def segment(step: int) -> dict[str, float]:
        return {"start_step": start_step, "end_step": step, "train_time_s": train_time,
                "wall_time_s": time.perf_counter() - wall_start, "peak_mem_mb": _peak_memory_mb(device),
                "tokens_per_s": tokens_per_step * (step - start_step) / train_time if train_time > 0 else math.nan}

    def save_checkpoint(step: int, result: dict[str, Any] | None = None) -> None:
        if ckpt_path is None:
            return
        state = {
            "model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
            "rng_cpu": torch.get_rng_state(), "config": config_json, "history": json.dumps(history),
            "log_window": json.dumps(window),
            "segments": json.dumps(result["info"]["segments"] if result else [*segments, segment(step)]),
            "strikes": strikes,
        }
        if initial_loss is not None:
            state["initial_loss"] = initial_loss
        if result is not None:
            state["result"] = json.dumps(result)
        if device.type == "cuda":
            state["rng_cuda"] = torch.cuda.get_rng_state()
        _save_atomic(state, ckpt_path, commit)
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
        if step == 0:
            initial_loss = loss
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip if o.grad_clip > 0 else float("inf"))
        if not math.isfinite(float(grad_norm)):
            raise TrainingDiverged(
                f"gradient norm is {float(grad_norm)} at step {step + 1} (lr {lr:.3g}); stopping. Lower optim.lr "
                f"or raise optim.warmup_steps."
            )
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
            diagnostics: dict[str, Any] = {}
            if t.diagnostics:
                diagnostics, scalars = collect_diagnostics(
                    model, val_batches, deff_passages=t.deff_passages, deff_debiased=t.deff_cka == "debiased")
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
            strikes = _check_eval(val_loss, done, initial_loss, strikes, t.divergence)

        checkpointed = bool(t.checkpoint_every) and done % t.checkpoint_every == 0 and done != t.steps
        if checkpointed:
            save_checkpoint(done)
        if on_step is not None:
            try:
                on_step(done)
            except BaseException:
                if done != t.steps and not checkpointed:
                    save_checkpoint(done)
                raise

    info["segments"] = [*segments, segment(t.steps)]
    last_eval = history["eval"][-1]
    summary = {
        "val_loss": last_eval["val_loss"],
        "val_loss_tail": last_eval["val_loss_tail"],
        "train_loss": history["train"][-1]["train_loss"],
        **_segment_totals(info["segments"], tokens_per_step),
        "params_total": float(counts["total"]),
        "params_residual": float(counts["residual"]),
        "tokens": float(tokens_per_step * t.steps),
    }
    save_checkpoint(t.steps, {"summary": summary, "info": info})
    say(
        f"done: val {summary['val_loss']:.4f} (tail-{t.tail_k} {summary['val_loss_tail']:.4f}) | "
        f"train {summary['train_loss']:.4f} | {summary['tokens_per_s'] / 1e3:.1f}k tok/s | "
        f"{summary['train_time_s']:.1f}s training | peak mem {summary['peak_mem_mb']:.0f} MiB"
    )
    return TrainResult(summary=summary, history=history, info=info)
