"""The summary metrics of a run: the one registry that training, the study spec and results share.

`models.training.train` reports exactly these keys at the end of a run; a study's comparison may
name any of them (`experiments.spec`); `results.collect` tabulates them. Pure Python, no torch,
so results and the spec can import it without importing the model code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

Direction = Literal["minimize", "maximize"]


@dataclass(frozen=True)
class Metric:
    name: str
    direction: Direction  # which way is better
    unit: str
    fmt: str  # a format spec for one value, e.g. ".4f"
    description: str


METRICS: dict[str, Metric] = {m.name: m for m in (
    Metric("val_loss_tail", "minimize", "nats/token", ".4f",
           "the mean held-out loss of the run's last train.tail_k evals (default 1: the final eval alone)"),
    Metric("val_loss", "minimize", "nats/token", ".4f", "held-out loss at the last eval"),
    Metric("train_loss", "minimize", "nats/token", ".4f", "training loss at the last log step"),
    Metric("tokens_per_s", "maximize", "tokens/s", ".0f", "training throughput of this run's steps"),
    Metric("peak_mem_mb", "minimize", "MiB", ".0f", "peak accelerator (or process) memory"),
    Metric("train_time_s", "minimize", "s", ".1f", "time in training steps, evals excluded"),
    Metric("wall_time_s", "minimize", "s", ".1f", "wall time of the whole run"),
    Metric("params_total", "minimize", "parameters", ".0f", "every trainable parameter"),
    Metric("params_active", "minimize", "parameters", ".0f",
           "the parameters a token's forward touches: params_total less the routed experts it does not reach "
           "(a mixture-of-experts model); params_total for a dense one"),
    Metric("params_residual", "minimize", "parameters", ".0f", "the residual pathway's own parameters"),
    Metric("tokens", "maximize", "tokens", ".0f", "tokens trained on (steps x batch x sequence)"),
    # serving cost, measured by the run after training on its own device (models.serving)
    Metric("prefill_tps", "maximize", "tokens/s", ".0f",
           "prompt tokens per second of prefill, cost.decode_batch prompts of cost.prompt_tokens (median)"),
    Metric("decode_tps", "maximize", "tokens/s", ".1f", "tokens per second decoding one sequence (batch 1, median)"),
    Metric("decode_tps_batch", "maximize", "tokens/s", ".1f",
           "tokens per second decoding cost.decode_batch sequences together (median)"),
    Metric("decode_state_bytes", "minimize", "bytes/token", ".0f",
           "decode state per cached token, what grows with the context: every layer's keys and values (a "
           "row's state that does not grow is counted apart, per row)"),
    Metric("decode_step_bytes", "minimize", "bytes/row", ".0f",
           "decode state per row that does not grow with the context: the residual pathway's state of the "
           "token in flight (gone after its step) plus what the pathway carries from token to token"),
    Metric("decode_peak_mem_mb", "minimize", "MiB", ".1f",
           "peak accelerator memory of batched decoding (on a CPU: the decode state and the model)"),
    Metric("flops_per_token", "minimize", "FLOPs/token", ".3g",
           "forward FLOPs per token at the full context: 2 N plus the attention scores"),
    # pipeline stages (`resources.pipeline_stages`, models.staged): what crosses the stage boundaries
    Metric("pipe_bytes_per_step", "minimize", "bytes", ".0f",
           "bytes sent across every pipeline stage boundary per training step, forward and backward (counted)"),
    Metric("pipe_bytes_declared", "minimize", "bytes", ".0f",
           "the same from the variant's declaration (stage_state_elems), which the count must equal"),
    # mechanism summaries, from the run's last evaluation (models.magnitudes); a direction only because the
    # registry needs one: a mechanism row reports the paired delta, not a verdict
    Metric("growth", "minimize", "ratio", ".3g",
           "output RMS of the last Transformer layer over the first's (both sublayers' outputs pooled), eval windows"),
    Metric("stream_growth", "minimize", "ratio", ".3g",
           "RMS of what the last sublayer reads over what the second layer's attention reads, eval windows"),
    Metric("grad_cv", "minimize", "ratio", ".3g",
           "coefficient of variation (SD ddof 0 / mean) of the per-layer gradient norms, step before the last eval"),
    Metric("route_max_late", "maximize", "weight", ".3f",
           "mean max depth-routing weight over the multi-source routing sites in the last third of the depth"),
    # mechanism values from a finished run's interventions (results.interventions: work after training, not
    # in the training summary): "" the zero mode, "_mean" the mean mode
    *(Metric(f"imbalance{mode}", "minimize", "nats/token", ".4f",
             f"stream 0's knock-out effect minus the mean of the other streams' ({what}; two streams: their "
             "difference)") for mode, what in (("", "zeroed"), ("_mean", "replaced by their means"))),
    *(Metric(f"stream{k}_knockout{mode}", "minimize", "nats/token", ".4f",
             f"held-out loss increase when stream {k} is {what} in every read (the variant's k-th stream)")
      for k in range(4) for mode, what in (("", "zeroed"), ("_mean", "replaced by its mean"))),
)}

# The mechanism values a run's interventions give (`interventions:`), not its training summary.
INTERVENTION_METRICS: tuple[str, ...] = tuple(
    m for m in METRICS if re.fullmatch(r"imbalance(_mean)?|stream\d+_knockout(_mean)?", m))

# The metrics a study may compare as costs (`costs: [...]`): ratio rows, treatment / control.
COST_METRICS: tuple[str, ...] = (
    "prefill_tps", "decode_tps", "decode_tps_batch", "decode_state_bytes", "decode_step_bytes", "decode_peak_mem_mb",
    "flops_per_token", "tokens_per_s", "peak_mem_mb", "params_total", "params_active", "pipe_bytes_per_step",
)

# The summaries only a run split into pipeline stages has (NaN in the runs table for the others).
PIPELINE_METRICS: tuple[str, ...] = ("pipe_bytes_per_step", "pipe_bytes_declared")

# The metrics a study may read as mechanisms (`mechanisms: [...]`): paired delta rows, treatment - control.
MECHANISM_METRICS: tuple[str, ...] = ("growth", "stream_growth", "grad_cv", "route_max_late", *INTERVENTION_METRICS)

# What training reports at the end of a run (and `results.collect` tabulates): every metric but the interventions'.
SUMMARY_METRICS: tuple[str, ...] = tuple(m for m in METRICS if m not in INTERVENTION_METRICS)
