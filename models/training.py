"""The training loop: one run of one `RunConfig`, deterministic, resumable, loud on divergence.

AdamW (decoupled weight decay on Linear/Embedding weights by default) or Muon + AdamW
(`models.optim`), warmup + cosine (or warmup-stable-decay) to `min_lr_ratio * lr`, gradient
accumulation and clipping, bf16 autocast on CUDA and float32 on CPU, optional `torch.compile`.
Batches are a pure function of (data seed, step, micro step), so the data position is the step,
and a resumed run continues the exact same curve.

`train` is the entry point; `Trainer` holds one run's pieces and runs it as steps (resume,
`train_step`, `eval_step`, `save_checkpoint`, `summarise`). Callers observe progress through a
`TrainCallback`; the loop itself knows nothing of MLflow or of leases (`commit` wraps each rename).
A `Trainer` always holds a `distributed.Parallel`: one process is `ONE_PROCESS`, a world of one whose
collectives are identities, and N data-parallel ranks train one run with the same maths. Its
`checkpoint.Checkpointer` picks the checkpoint layout (pt or DCP) once, from that `Parallel`.
"""

from __future__ import annotations

import math
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

import torch
from torch import nn

from reslab.common.errors import ConfigError, RunFailed
from reslab.kernels import select_impl
from reslab.models.backbone import Decoder, build_model
from reslab.models.checkpoint import Checkpointer
from reslab.models.config import DEVICE_RE, DivergenceConfig, RunConfig, canonical_json, to_dict
from reslab.models.diagnostics import collect_diagnostics
from reslab.models.distributed import ONE_PROCESS, Parallel, StepInputs
from reslab.models.hf_import import hf_path, load_hf_weights
from reslab.models.magnitudes import MagnitudeRecorder, grad_square_sums, magnitude_record, route_max_late, summary_of
from reslab.models.optim import lr_at, make_optimizer, optimizer_refusal
from reslab.models.progress import RunProgress, checkpoint_state, empty_window, restore_progress
from reslab.models.resolve import validate_run_config


class TrainingDiverged(RunFailed):
    """A divergence rule fired (`train.divergence`); the run stops instead of logging a garbage curve."""


class StopRun(Exception):
    """Raised by an `on_step` callback to stop a run part-way at `step`; `train` checkpoints the
    run at that step first, so resuming continues from it."""

    def __init__(self, step: int, reason: str = "stopped") -> None:
        super().__init__(f"{reason} at step {step}")
        self.step, self.reason = step, reason

    def __reduce__(self):
        # rebuilt from (step, reason), not the message: a data-parallel run sends it to every rank
        return type(self), (self.step, self.reason)


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


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _segment_totals(segments: list[dict[str, Any]], tokens_per_step: int) -> dict[str, float]:
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
def evaluate(model: Decoder, batches, device: torch.device, autocast, parallel: Parallel = ONE_PROCESS,
             magnitudes: MagnitudeRecorder | None = None) -> float:
    """The mean next-token loss over every target of `batches` (each batch's mean weighted by its
    rows, so a smaller last batch counts for what it holds). Rank r scores batches r, r + N, ...:
    the row-weighted loss sums are all-reduced in float64, so every rank returns the 1-rank value up
    to summation order. Under FSDP every forward is a collective, so a rank without a batch in a
    round runs one it discards. With `magnitudes`, the model (a `Decoder`) records each sublayer's
    magnitudes into it on the batches this rank scores, summed over the ranks at the end."""
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # [loss * rows, rows]
    try:
        for first in range(0, len(batches), parallel.world):
            k = first + parallel.rank
            if k >= len(batches) and parallel.sharding == "ddp":
                continue
            x, y = batches[k if k < len(batches) else 0]
            model.magnitudes = magnitudes if k < len(batches) else None
            with autocast():
                loss = model(x.to(device), y.to(device)).loss.item()
            if k < len(batches):
                sums += torch.tensor([loss * len(x), len(x)], dtype=torch.float64, device=device)
    finally:
        model.magnitudes = None
        model.train()
    parallel.all_reduce(sums)
    if magnitudes is not None:
        parallel.all_reduce(magnitudes.sums)
    return (sums[0] / sums[1]).item()


def moe_loads(model: Decoder, parallel: Parallel = ONE_PROCESS) -> list[tuple[int, torch.Tensor]]:
    """(layer, routed slots per expert since the last call, summed over the ranks) of every MoE layer; zeroes
    each layer's count. Empty for a dense model."""
    out = []
    for layer, moe in model.moe_layers():
        load = moe.load.clone()
        parallel.all_reduce(load)
        moe.load.zero_()
        out.append((layer, load))
    return out


@torch.no_grad()
def moe_balance_step(model: Decoder, parallel: Parallel = ONE_PROCESS) -> None:
    """The auxiliary-loss-free balancing update, run before each optimizer step: every `balance: bias` MoE
    layer moves its expert bias by bias_update_rate x sign(mean load - load) over this step's tokens, the same
    on every rank (the loads are summed over the ranks first). Zeroes the loads of every MoE layer."""
    for (_, moe), (_, load) in zip(model.moe_layers(), moe_loads(model, parallel), strict=True):
        if moe.cfg.balance == "bias" and moe.cfg.bias_update_rate > 0:
            moe.expert_bias += moe.cfg.bias_update_rate * torch.sign(load.mean() - load).to(moe.expert_bias.dtype)


def moe_utilisation(loads: list[tuple[int, torch.Tensor]]) -> tuple[dict[str, Any], dict[str, float]]:
    """Expert utilisation from `moe_loads`: (the diagnostics record {"layers", "fraction": per layer the fraction
    of routed slots each expert took}, per layer the series `moe/max_load/lNN` and `moe/min_load/lNN`: the
    largest and smallest fraction times the number of experts, 1 when balanced)."""
    record: dict[str, Any] = {"layers": [], "fraction": []}
    scalars: dict[str, float] = {}
    for layer, load in loads:
        frac = (load / load.sum().clamp_min(1)).tolist()
        record["layers"].append(layer)
        record["fraction"].append(frac)
        scalars[f"moe/max_load/l{layer:02d}"] = max(frac) * len(frac)
        scalars[f"moe/min_load/l{layer:02d}"] = min(frac) * len(frac)
    return record, scalars


def _silent(_msg: str) -> None:
    pass


def seeded_model(cfg: RunConfig, vocab_size: int, impl: str, device: torch.device, init: bool,
                 say: Callable[[str], None]) -> Decoder:
    """The run's model from its seed on `device`; with `init`, `train.init_from` loaded over it (a resumed run's
    checkpoint supersedes it, so resuming skips the load)."""
    t = cfg.train
    torch.manual_seed(t.seed)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(t.seed)
        torch.cuda.reset_peak_memory_stats(device)
    model = build_model(cfg.model, cfg.residual, vocab_size=vocab_size, impl=impl).to(device)
    hf_dir = hf_path(t.init_from)
    if hf_dir is not None and init:
        load_hf_weights(model, hf_dir)
        say(f"initialised from {t.init_from}")
    elif t.init_from is not None and init:
        model.load_state_dict(torch.load(t.init_from, map_location=device, weights_only=True))
        say(f"initialised from {t.init_from}")
    return model


def run_cost(cfg: RunConfig, dataset: Any, parallel: Parallel, models: tuple[nn.Module, nn.Module | None],
             dtype: torch.dtype, say: Callable[[str], None]) -> tuple[dict[str, float], dict[str, Any]]:
    """The serving cost (`models.serving`: its metrics and info) of the trained model, measured on rank 0's whole
    model (under FSDP its replica, `models` = (model, replica), gathered first) and the same on every rank;
    logged through `say`."""
    from reslab.models.serving import measure_cost, serving_prompts

    c = cfg.cost
    assert c.prompt_tokens is not None

    def val_windows(batch: int, tokens: int) -> torch.Tensor:
        return dataset.val_batches(batch, batch, tokens)[0][0]

    prompts = serving_prompts(val_windows, c.decode_batch, c.prompt_tokens, dataset.vocab_size)
    cost = parallel.computed_on_main(lambda model: measure_cost(cast(Decoder, model), c, prompts, dtype), *models)
    m = cost.metrics
    say(
        f"serving cost: prefill {m['prefill_tps']:.0f} tok/s | decode {m['decode_tps']:.1f} tok/s (batch 1), "
        f"{m['decode_tps_batch']:.1f} tok/s (batch {c.decode_batch}) | state {m['decode_state_bytes']:.0f} "
        f"B/token | decode peak {m['decode_peak_mem_mb']:.1f} MiB | {m['flops_per_token'] / 1e6:.3g} "
        f"MFLOPs/token | {cost.info['machine']['name']} | {cost.info['seconds']:.1f}s to measure"
    )
    return m, cost.info


class Trainer:
    """One run of one `RunConfig`, as the steps `train` chains. Construction sets up the model,
    optimizer and data and, with a checkpoint in `run_dir` (unless `resume` is False), loads it;
    `fit` then runs `train_step` (`forward_backward` per micro-batch), `log_step`, `eval_step` and
    `save_checkpoint` per step, and `summarise` at the end.

    `parallel` places this process in the run (`models.distributed`): `ONE_PROCESS` by default, or
    one rank of a data-parallel run, which trains its share of each global batch; only rank 0 logs
    and calls the callback. Checkpoints go where `self.checkpointer` (`models.checkpoint`) puts them."""

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: str | Path | None = None,
        *,
        callback: TrainCallback | None = None,
        resume: bool = True,
        log: Callable[[str], None] | None = None,
        commit: Callable[[Callable[[], None]], None] | None = None,
        parallel: Parallel = ONE_PROCESS,
    ) -> None:
        from reslab.models.data import TokenDataset

        self.cfg = validate_run_config(cfg)
        t, o = self.cfg.train, self.cfg.optim
        self.parallel, main = parallel, parallel.is_main
        parallel.check_group()
        self.device = parallel.device(pick_device(t.device))
        self.dtype = pick_dtype(t.dtype, self.device)
        # pipeline stages split the depth history the fused kernels keep in one buffer: the reference for "auto"
        auto_reference = parallel.stages > 1 and self.cfg.residual.impl == "auto"
        self.impl = "reference" if auto_reference else select_impl(self.cfg.residual.impl, self.device.type)
        self.say = (log or _silent) if main else _silent
        if self.cfg.residual.impl == "auto" and self.impl != "reference":  # a kernel only once it passed its checks
            from reslab.models.impl_check import verified_impl

            self.impl = verified_impl(self.cfg.residual, self.impl, self.device, self.say)
        self.callback = callback if main else None
        self.checkpointer = Checkpointer(run_dir, parallel, resume=resume, commit=commit)

        self.dataset = TokenDataset.open(self.cfg.data)
        self.model = seeded_model(self.cfg, self.dataset.vocab_size, self.impl, self.device,
                                  init=self.checkpointer.resume_from is None, say=self.say)
        self.seq_len = self.model.shape.seq_len
        self.tokens_per_step = o.batch_size * o.grad_accum * self.seq_len
        # rank 0 keeps a whole copy under FSDP for what reads the whole model: diagnostics, the serving cost
        keep = main and (t.diagnostics or self.cfg.cost.measure)
        self.wrapped, self.replica = parallel.wrap(self.model, self.device, keep_replica=keep)
        optimizer_refusal(o, ranks=parallel.world, stages=parallel.stages, sharding=parallel.sharding)
        self.optimizer = make_optimizer(self.model, self.cfg, self.device)
        self.forward = torch.compile(self.wrapped) if t.compile else self.wrapped
        self.steps = parallel.steps(StepInputs(model=self.model, wrapped=self.wrapped, forward=self.forward,
                                               batches=self._batch, autocast=self.autocast, batch_size=o.batch_size,
                                               grad_accum=o.grad_accum, seq_len=self.seq_len))
        self.val_batches = self.dataset.val_batches(t.eval_windows, t.eval_batch_size or o.batch_size, self.seq_len)
        self.config_json = canonical_json(self.cfg)
        self.progress = RunProgress()
        if self.checkpointer.resume_from is not None:
            self.progress = restore_progress(self.checkpointer, self.model, self.optimizer, self.device,
                                             self.config_json)
            self.say(f"resumed from {self.checkpointer.resume_from} at step {self.progress.start_step}")
        self.counts = self.model.param_counts()
        self.info = self._run_info()
        self.train_time = 0.0
        self.wall_start = time.perf_counter()
        self.grad_sums: torch.Tensor | None = None  # the last eval step's gradient squares (`_grad_square_sums`)

    def _run_info(self) -> dict[str, Any]:
        # plain values only: this goes to the driver's event sink, and a `TorchVersion` there made
        # the sink's process import torch (about 1 s) before it could take the run's first event
        return {
            "device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."), "impl": self.impl,
            "data_fingerprint": self.dataset.fingerprint, "vocab_size": self.dataset.vocab_size,
            "n_train_tokens": self.dataset.n_train_tokens, "n_val_tokens": self.dataset.n_val_tokens,
            "params": self.counts, "params_residual_per_layer": self.model.pathway.extra_params_per_layer(),
            "shape": to_dict(self.model.shape), "start_step": self.progress.start_step, "torch": str(torch.__version__),
            **self.parallel.layout(),
        }

    def autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32)

    def fit(self, on_step: Callable[[int], None] | None = None) -> TrainResult:
        """Train from the resumed step to `train.steps` and summarise; `on_step` as in `train`."""
        t, p = self.cfg.train, self.progress
        if self.callback is not None:
            self.callback.on_start(self.info)
        if p.finished is not None and p.start_step >= t.steps:
            self.say(f"{self.checkpointer.resume_from} is the final checkpoint: nothing to train, "
                     "returning its stored result")
            return TrainResult(summary=p.finished["summary"], history=p.history, info=p.finished["info"])
        self.say(
            f"{self.cfg.residual.name} | {self.counts['total'] / 1e6:.2f}M params "
            f"(residual +{self.counts['residual']}) | {self.device} {self.info['dtype']} | impl={self.impl} | "
            f"data {self.dataset.fingerprint[:12]}"
        )
        self.wall_start = time.perf_counter()  # wall time counts from here, after `on_start`
        self.model.train()
        for step in range(p.start_step, t.steps):
            lr, grad_norm = self.train_step(step)
            done = step + 1
            if done % t.log_every == 0 or done == t.steps:
                self.log_step(done, lr, grad_norm)
            if self._evaluates(done):
                self.eval_step(done, lr)
            self._end_step(done, on_step)
        return self.summarise()

    def _batch(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The run's training samples [first, first + count) (after `train.data_offset`) on the device."""
        x, y = self.dataset.train_samples(first + self.cfg.train.data_offset, count, self.seq_len, self.cfg.data_seed)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def forward_backward(self, step: int) -> float:
        """Accumulate the gradients of this process's share of `step` (`self.steps`: its micro-batches, or its
        pipeline stage); returns their mean LM loss (the aux loss is trained on but not reported)."""
        return self.steps.forward_backward(step)

    def train_step(self, step: int) -> tuple[float, float]:
        """One optimizer step at `step` (0-based), added to the log window; returns (lr, grad norm).
        Raises `TrainingDiverged` on a non-finite loss or gradient norm."""
        o, p = self.cfg.optim, self.progress
        tic = time.perf_counter()
        lr = lr_at(step, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        moe_loads(self.model)  # zero the MoE loads that passes outside training left
        loss = self.parallel.mean(self.forward_backward(step), self.device)
        if not math.isfinite(loss):
            raise TrainingDiverged(
                f"loss is {loss} at step {step + 1} (lr {lr:.3g}); stopping. Lower optim.lr, "
                f"raise optim.warmup_steps or check the variant's knobs."
            )
        if step == 0:
            p.initial_loss = loss
        if self.cfg.train.magnitudes and self._evaluates(step + 1):
            self.grad_sums = self._grad_square_sums()
        max_norm = o.grad_clip if o.grad_clip > 0 else float("inf")
        grad_norm = self.steps.clip(max_norm)
        if not math.isfinite(grad_norm):
            raise TrainingDiverged(
                f"gradient norm is {grad_norm} at step {step + 1} (lr {lr:.3g}); stopping. Lower optim.lr "
                f"or raise optim.warmup_steps."
            )
        moe_balance_step(self.model, self.parallel)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - tic
        self.train_time += elapsed
        w = p.window
        p.window = {"loss": w["loss"] + loss, "steps": w["steps"] + 1, "time": w["time"] + elapsed}
        return lr, grad_norm

    def _evaluates(self, done: int) -> bool:
        """Whether the run evaluates after `done` steps."""
        t = self.cfg.train
        return done % t.eval_every == 0 or done == t.steps

    def _grad_square_sums(self) -> torch.Tensor:
        """`models.magnitudes.grad_square_sums` of the step's whole gradient, before clipping, summed over the
        ranks that hold parts of it (`Steps.sum_sites`)."""
        sums = grad_square_sums(list(self.model.sublayers), list(self.model.norms))
        self.steps.sum_sites(sums)
        return sums

    def log_step(self, done: int, lr: float, grad_norm: float) -> None:
        """Log the train-loss window's mean after `done` steps and start a new window."""
        p, w = self.progress, self.progress.window
        metrics = {
            "train_loss": w["loss"] / w["steps"], "lr": lr, "grad_norm": grad_norm,
            "tokens_per_s": self.tokens_per_step * w["steps"] / w["time"],
            **self.steps.metrics(),
        }
        p.history["train"].append({"step": done, **metrics})
        if self.callback is not None:
            self.callback.on_log(done, metrics)
        p.window = empty_window()

    def eval_step(self, done: int, lr: float) -> None:
        """Evaluate after `done` steps (validation loss, its tail mean, diagnostics), report it and
        apply the divergence rule, which raises `TrainingDiverged` when it fires."""
        t, p = self.cfg.train, self.progress
        self.steps.gather()
        recorder = MagnitudeRecorder(2 * self.model.shape.n_layers, self.device) if t.magnitudes else None
        moe_loads(self.model)
        val_loss = evaluate(self.model, self.val_batches, self.device, self.autocast, self.parallel, recorder)
        moe_record, moe_scalars = moe_utilisation(moe_loads(self.model, self.parallel))
        tail = [e["val_loss"] for e in p.history["eval"][-(t.tail_k - 1):]] if t.tail_k > 1 else []
        tail.append(val_loss)
        metrics = {"val_loss": val_loss, "val_loss_tail": sum(tail) / len(tail), **moe_scalars}
        diagnostics: dict[str, Any] = {"moe": moe_record} if moe_scalars else {}
        if t.diagnostics:
            collected, scalars = self._diagnostics()
            diagnostics.update(collected)
            metrics.update(scalars)
            late = route_max_late(diagnostics.get("routing"), self.model.shape.n_layers)
            if late is not None:
                metrics["route_max_late"] = late
        if recorder is not None:
            diagnostics["magnitudes"], scalars = magnitude_record(recorder, self.grad_sums)
            metrics.update(scalars)
            self.grad_sums = None
        p.history["eval"].append({"step": done, **metrics})
        # before the first log window there is no train loss yet: "-", as the study driver's line says
        last_train = f"{p.history['train'][-1]['train_loss']:.4f}" if p.history["train"] else "-"
        self.say(
            f"step {done:>6}/{t.steps} | train {last_train} | val {val_loss:.4f} "
            f"(tail {metrics['val_loss_tail']:.4f}) | lr {lr:.2e} | "
            f"{self.tokens_per_step * (done - p.start_step) / max(self.train_time, 1e-9) / 1e3:.1f}k tok/s"
        )
        if self.callback is not None:
            self.callback.on_eval(done, metrics, diagnostics)
        p.strikes = _check_eval(val_loss, done, p.initial_loss, p.strikes, t.divergence)

    def _diagnostics(self) -> tuple[dict[str, Any], dict[str, float]]:
        """`collect_diagnostics` on the whole model; with ranks, rank 0 computes them for all."""
        t = self.cfg.train

        def collect(model: nn.Module) -> tuple[dict[str, Any], dict[str, float]]:
            return collect_diagnostics(model, self.val_batches, deff_passages=t.deff_passages,
                                       deff_debiased=t.deff_cka == "debiased")

        return self.parallel.computed_on_main(collect, self.model, self.replica)

    def _end_step(self, done: int, on_step: Callable[[int], None] | None) -> None:
        """The periodic checkpoint, then `on_step`; what `on_step` raises propagates after the run
        is checkpointed at `done` (unless it already was, or `done` is the last step). With ranks,
        rank 0 runs `on_step` and every rank raises what it raised."""
        t = self.cfg.train
        checkpointed = bool(t.checkpoint_every) and done % t.checkpoint_every == 0 and done != t.steps
        if checkpointed:
            self.save_checkpoint(done)
        try:
            self.parallel.raise_from_main(lambda: None if on_step is None else on_step(done))
        except BaseException:
            if done != t.steps and not checkpointed:
                self.save_checkpoint(done)
            raise

    def segment(self, step: int) -> dict[str, Any]:
        """This process's stretch of the run, from the resumed step to `step`."""
        start = self.progress.start_step
        return {"start_step": start, "end_step": step, "train_time_s": self.train_time,
                "wall_time_s": time.perf_counter() - self.wall_start, "peak_mem_mb": _peak_memory_mb(self.device),
                "tokens_per_s": self.tokens_per_step * (step - start) / self.train_time
                if self.train_time > 0 else math.nan, **self.parallel.layout()}

    def save_checkpoint(self, step: int, result: dict[str, Any] | None = None) -> None:
        """Checkpoint the run at `step` (with the final `result` at its end); nothing without a
        run_dir. With ranks, every rank calls it (`checkpoint.save_sharded`)."""
        if self.checkpointer.path is None:
            return
        self.steps.gather()
        p = self.progress
        segments = result["info"]["segments"] if result else [*p.segments, self.segment(step)]
        state = checkpoint_state(step, p, self.config_json, self.device, segments, result)
        path = self.checkpointer.save(state, self.model, self.optimizer)
        if self.callback is not None:
            self.callback.on_checkpoint(step, path)

    def measure_cost(self) -> dict[str, float]:
        """The serving cost metrics (`run_cost`), recorded in `info["cost"]`; nothing with `cost.measure: false`."""
        if not self.cfg.cost.measure:
            return {}
        metrics, self.info["cost"] = run_cost(self.cfg, self.dataset, self.parallel, (self.model, self.replica),
                                              self.dtype, self.say)
        return metrics

    def summarise(self) -> TrainResult:
        """The run's summary (`common.metrics`), the serving cost included, written with the final
        checkpoint (so a run resumed from it returns the same summary)."""
        t, p = self.cfg.train, self.progress
        cost = self.measure_cost()
        self.info["segments"] = [*p.segments, self.segment(t.steps)]
        last_eval = p.history["eval"][-1]
        summary = {
            "val_loss": last_eval["val_loss"],
            "val_loss_tail": last_eval["val_loss_tail"],
            "train_loss": p.history["train"][-1]["train_loss"],
            **_segment_totals(self.info["segments"], self.tokens_per_step),
            "params_total": float(self.counts["total"]),
            "params_active": float(self.counts["active"]),
            "params_residual": float(self.counts["residual"]),
            "tokens": float(self.tokens_per_step * t.steps),
            **summary_of(last_eval),
            **cost,
            **self.steps.summary(),
        }
        self.save_checkpoint(t.steps, {"summary": summary, "info": self.info})
        self.say(
            f"done: val {summary['val_loss']:.4f} (tail-{t.tail_k} {summary['val_loss_tail']:.4f}) | "
            f"train {summary['train_loss']:.4f} | {summary['tokens_per_s'] / 1e3:.1f}k tok/s | "
            f"{summary['train_time_s']:.1f}s training | peak mem {summary['peak_mem_mb']:.0f} MiB"
        )
        return TrainResult(summary=summary, history=p.history, info=self.info)


def train(
    cfg: RunConfig,
    run_dir: str | Path | None = None,
    *,
    callback: TrainCallback | None = None,
    resume: bool = True,
    on_step: Callable[[int], None] | None = None,
    log: Callable[[str], None] | None = None,
    commit: Callable[[Callable[[], None]], None] | None = None,
    parallel: Parallel = ONE_PROCESS,
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

    `parallel` (default `ONE_PROCESS`) can make this process one rank of a data-parallel run
    (`models.distributed`; the default process group must be initialised): every rank calls `train`
    with the same arguments and returns the result; only rank 0 logs, calls `callback`, runs `on_step` and writes the
    `COMMITTED` marker through `commit`, and every rank raises what rank 0's `on_step` raised.
    """
    trainer = Trainer(cfg, run_dir, callback=callback, resume=resume, log=log, commit=commit, parallel=parallel)
    return trainer.fit(on_step)
