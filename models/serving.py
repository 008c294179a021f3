"""What a trained model costs to serve, measured by the run after training on its own device and dtype.

`measure_cost` returns the cost metrics of `common.metrics` (`prefill_tps`, `decode_tps`,
`decode_tps_batch`, `decode_state_bytes`, `decode_step_bytes`, `decode_peak_mem_mb`, `flops_per_token`) for one
model:

    prefill_tps         cost.decode_batch prompts of cost.prompt_tokens tokens (validation windows, else
                        fixed ids) through `Decoder.prefill`, timed alone: prompt tokens / median seconds
    decode_tps          one row: after an untimed prefill of its prompt, cost.new_tokens greedy decode steps,
                        timed together: new tokens / median seconds
    decode_tps_batch    the same with cost.decode_batch rows: rows x new tokens / median seconds
    decode_state_bytes  what grows with the context, per cached token: `Decoder.decode_state_bytes().kv`, every
                        layer's keys and values
    decode_step_bytes   what a row holds whatever its context: `Decoder.decode_state_bytes().per_row`, the
                        pathway's state of the token in flight (gone after its step) plus its carry to the next
    decode_peak_mem_mb  the model's parameters and buffers plus what batched decoding adds: on CUDA the peak of
                        `torch.cuda.max_memory_allocated` over one batched prefill + decode above what was allocated
                        before it; on other devices computed from the tensors, not the process's RSS (a noisy figure
                        that counts the allocator and the interpreter): the decode state as allocated (the KV cache
                        grows by doubling: under twice the slots a row uses) plus the pathway's state of each
                        row's token
    flops_per_token     `flops_per_token(shape, params)`: 2 N + 4 L d_attn S, the forward matmuls and attention
                        scores at the full context, one third of `experiments.budget.train_flops` per token

Every timing is one warm-up, then cost.repeats repetitions, the median; CUDA is synchronised around
each. The model decodes as served: in eval mode, uncompiled, in the run's dtype (a float32 model of a
bfloat16 run is measured as a bfloat16 copy, so the KV cache and the state bytes are bf16's).
`machine` names what it ran on; `Trainer.summarise` records it in the run's info.
"""

from __future__ import annotations

import copy
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from reslab.common.errors import ConfigError
from reslab.models.backbone import Decoder
from reslab.models.config import CostConfig
from reslab.models.presets import ModelShape

MIB = 2**20


def flops_per_token(shape: ModelShape, params: int) -> float:
    """Forward FLOPs per token at the full context: 2 N for the matmuls (N every parameter a token's
    matmuls touch, the active ones of a MoE model (`Decoder.param_counts`): the backbone with the tied
    embedding counted once, as the LM head, the norms and the pathway's extra parameters, as
    `experiments.size.backbone_active_params + residual_params`) plus
    4 L d_attn S for the attention scores and their weighted sum over S = seq_len keys: the forward
    third of `experiments.budget.train_flops` (6 N + 12 L d_attn S per token, PaLM's count)."""
    d_attn = shape.n_heads * shape.head_dim
    return 2.0 * params + 4.0 * shape.n_layers * d_attn * shape.seq_len


def machine(device: torch.device) -> dict[str, Any]:
    """What the cost was measured on: the CPU's model name, torch's intra-op threads, on CUDA the GPU's
    name, and `name`, one line of them (`NVIDIA H200` or `AMD EPYC 7B13, 2 threads`)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    threads = torch.get_num_threads()
    out: dict[str, Any] = {"device": str(device), "cpu": cpu, "cpu_count": os.cpu_count(), "threads": threads,
                           "name": f"{cpu}, {threads} thread{'s' if threads != 1 else ''}"}
    if device.type == "cuda":
        out["gpu"] = out["name"] = torch.cuda.get_device_name(device)
    return out


def serving_prompts(val_windows: Callable[[int, int], Tensor] | None, batch: int, tokens: int,
                    vocab_size: int) -> Tensor:
    """[batch, tokens] prompt ids: `val_windows(batch, tokens)` (the validation split's windows) when it
    can serve them, else fixed ids (0, 1, 2, ... modulo the vocabulary)."""
    if val_windows is not None:
        try:
            return val_windows(batch, tokens)
        except (ValueError, ConfigError):  # a split too short for that many windows
            pass
    return torch.arange(batch * tokens).remainder(vocab_size).view(batch, tokens)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(fn: Callable[[Any], object], device: torch.device, setup: Callable[[], Any] = lambda: None) -> float:
    """Wall seconds of one `fn(setup())`, `setup` untimed, CUDA synchronised on both sides."""
    state = setup()
    _sync(device)
    tic = time.perf_counter()
    fn(state)
    _sync(device)
    return time.perf_counter() - tic


def step_seconds(fn: Callable[[], object], device: torch.device) -> tuple[float, float]:
    """(wall seconds, the calling thread's CPU seconds) of one `fn()`, CUDA synchronised on both sides. The
    thread's CPU time does not count time the thread waits while another process holds the core, so a
    shared machine's load does not bias it; it counts only this thread's work (all of it with one intra-op
    thread, `torch.set_num_threads(1)`)."""
    _sync(device)
    wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
    fn()
    _sync(device)
    return (time.perf_counter_ns() - wall) / 1e9, (time.thread_time_ns() - cpu) / 1e9


@dataclass(frozen=True)
class Interval:
    """A median `estimate` of `n` values and its distribution-free interval [`low`, `high`] at `level`
    (infinite when n is too small for one: fewer than 6 values at 0.95)."""

    estimate: float
    low: float
    high: float
    n: int
    level: float

    def verdict(self, target: float) -> str:
        """Against a target the value should reach (>= target): "holds" when the whole interval does,
        "misses" when none of it does, else "undecided"."""
        if self.low >= target:
            return "holds"
        return "misses" if self.high < target else "undecided"

    def text(self, fmt: str = ".3f") -> str:
        """`0.902 [0.871, 0.929]`; `0.902 [n=4: too few for an interval]` when there is none."""
        if math.isinf(self.low) or math.isinf(self.high):
            return f"{self.estimate:{fmt}} [n={self.n}: too few for an interval]"
        return f"{self.estimate:{fmt}} [{self.low:{fmt}}, {self.high:{fmt}}]"


def median_ranks(n: int, level: float = 0.95) -> int | None:
    """The rank k (1-based) of the order-statistic interval [x_(k), x_(n+1-k)] for the median of n
    independent values of a continuous distribution: the largest k whose coverage, 1 - 2 P(Bin(n, 1/2) <=
    k - 1), is at least `level`; None when not even [min, max] reaches it."""
    if not 0 < level < 1:
        raise ConfigError(f"median interval level: {level} is not allowed; allowed: 0 < level < 1")
    tail, best = 0.0, None
    for k in range(1, (n + 1) // 2 + 1):
        tail += math.comb(n, k - 1) / 2**n          # P(Bin(n, 1/2) <= k - 1)
        if 1 - 2 * tail < level:
            break
        best = k
    return best


def median_interval(values: Sequence[float], level: float = 0.95) -> Interval:
    """The median of `values` with its order-statistic interval (`median_ranks`): exact coverage >= level
    for independent values, no assumption on their distribution's shape."""
    xs = sorted(values)
    if not xs:
        raise ConfigError("median interval: no values; allowed: one or more")
    k = median_ranks(len(xs), level)
    low, high = (-math.inf, math.inf) if k is None else (xs[k - 1], xs[len(xs) - k])
    return Interval(statistics.median(xs), low, high, len(xs), level)


def paired_ratio(control: Sequence[float], treatment: Sequence[float], level: float = 0.95) -> Interval:
    """The median over pairs of control[i] / treatment[i] (a speed ratio when both are seconds: above 1 the
    treatment is faster) with its interval (`median_interval`). Pairs timed back to back share the
    machine's load, so the ratio of a pair cancels what they share."""
    if len(control) != len(treatment):
        raise ConfigError(f"paired ratio: {len(control)} control times and {len(treatment)} treatment times; "
                          "allowed: one of each per pair")
    return median_interval([c / t for c, t in zip(control, treatment, strict=True)], level)


def _median_seconds(fn: Callable[[Any], object], repeats: int, device: torch.device,
                    setup: Callable[[], Any] = lambda: None) -> float:
    """Median wall seconds of `fn(setup())` over `repeats` calls after one warm-up; `setup` is untimed."""
    _seconds(fn, device, setup)
    return statistics.median(_seconds(fn, device, setup) for _ in range(repeats))


def _decode(model: Decoder, new_tokens: int) -> Callable[[tuple[Tensor, Any]], None]:
    """`new_tokens` greedy decode steps from a prefill's (logits, state)."""
    def run(prefilled: tuple[Tensor, Any]) -> None:
        logits, state = prefilled
        logits = logits[:, -1]
        for _ in range(new_tokens):
            logits = model.decode_step(logits.argmax(-1), state)

    return run


@torch.no_grad()
def prefill_seconds(model: Decoder, prompts: Tensor, repeats: int) -> float:
    """Median seconds of `model.prefill(prompts)` ([B, P] on the model's device), one warm-up first."""
    return _median_seconds(lambda _: model.prefill(prompts), repeats, prompts.device)


@torch.no_grad()
def decode_once(model: Decoder, prompts: Tensor, new_tokens: int) -> float:
    """Seconds of `new_tokens` greedy decode steps of every row of `prompts` after their prefill (untimed)."""
    return _seconds(_decode(model, new_tokens), prompts.device, setup=lambda: model.prefill(prompts))


@torch.no_grad()
def decode_seconds(model: Decoder, prompts: Tensor, new_tokens: int, repeats: int) -> float:
    """Median of `decode_once` over `repeats` calls, one warm-up first."""
    decode_once(model, prompts, new_tokens)
    return statistics.median(decode_once(model, prompts, new_tokens) for _ in range(repeats))


def module_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


@dataclass(frozen=True)
class Cost:
    """The cost metrics (`metrics`, the summary's keys) and how they were taken (`info`, the run's info)."""

    metrics: dict[str, float]
    info: dict[str, Any]


def serving_copy(model: Decoder, dtype: torch.dtype) -> Decoder:
    """The model as served in `dtype`: itself when its parameters already are, else a cast copy."""
    if model.embed.weight.dtype == dtype:
        return model
    return copy.deepcopy(model).to(dtype)


@torch.no_grad()
def measure_cost(model: Decoder, cost: CostConfig, prompts: Tensor, dtype: torch.dtype) -> Cost:
    """The serving cost of `model` (the module docstring) on its own device, in `dtype`, from `prompts`
    [cost.decode_batch, cost.prompt_tokens]; `cost` resolved (`models.resolve.validate_run_config`)."""
    assert cost.prompt_tokens is not None and cost.new_tokens is not None, "resolve the cost config first"
    tic = time.perf_counter()
    device = model.embed.weight.device
    served = serving_copy(model, dtype)
    was_training = served.training
    served.eval()
    try:
        prompts = prompts.to(device)
        batch, prompt_len = prompts.shape
        prefill_s = prefill_seconds(served, prompts, cost.repeats)
        one_s = decode_seconds(served, prompts[:1], cost.new_tokens, cost.repeats)
        batch_s = decode_seconds(served, prompts, cost.new_tokens, cost.repeats)
        state_bytes = served.decode_state_bytes()
        peak = _decode_peak_bytes(served, prompts, cost.new_tokens, state_bytes.pathway)
    finally:
        served.train(was_training)
    s = served.shape
    params = model.param_counts()["active"]  # a MoE token reaches top_k of its experts: FLOPs by active parameters
    metrics = {
        "prefill_tps": batch * prompt_len / prefill_s,
        "decode_tps": cost.new_tokens / one_s,
        "decode_tps_batch": batch * cost.new_tokens / batch_s,
        "decode_state_bytes": float(state_bytes.kv),
        "decode_step_bytes": float(state_bytes.per_row),
        "decode_peak_mem_mb": peak / MIB,
        "flops_per_token": flops_per_token(s, params),
    }
    info = {
        "machine": machine(device), "dtype": str(dtype).removeprefix("torch."), "decode_batch": batch,
        "prompt_tokens": prompt_len, "new_tokens": cost.new_tokens, "repeats": cost.repeats,
        "state_bytes": {"kv": state_bytes.kv, "pathway": state_bytes.pathway, "carry": state_bytes.carry},
        "peak_mem": "cuda max_memory_allocated" if device.type == "cuda" else "computed from the tensors",
        "seconds": time.perf_counter() - tic,
    }
    return Cost(metrics, info)


def _decode_peak_bytes(model: Decoder, prompts: Tensor, new_tokens: int, pathway_bytes: int) -> int:
    """The model's bytes plus what one batched prefill + decode adds (the module docstring)."""
    from reslab.models.decoding import tensor_bytes

    device = model.embed.weight.device
    if device.type == "cuda":
        _sync(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        _decode(model, new_tokens)(model.prefill(prompts))
        _sync(device)
        return module_bytes(model) + torch.cuda.max_memory_allocated(device) - before
    logits, state = model.prefill(prompts)
    _decode(model, new_tokens)((logits, state))
    return module_bytes(model) + tensor_bytes(state) + len(prompts) * pathway_bytes
