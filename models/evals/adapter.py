"""`ReslabLM`: a reslab `Decoder` behind lm-evaluation-harness's model interface (`lm_eval.api.model.TemplateLM`).

The harness hands over requests; the adapter scores them with the run's own model and tokenizer (byte or BPE)
on the model's device:

- `loglikelihood` (the harness's `TemplateLM.loglikelihood` encodes each (context, continuation) pair and calls
  `_loglikelihood_tokens`): log P(continuation | context), summed over the continuation's tokens, and whether
  every continuation token is the argmax (`is_greedy`). An empty context is the end-of-text token (the
  harness's `prefix_token_id`), the token every training document follows. Inputs longer than the model's
  context keep their last `seq_len + 1` tokens (the continuation whole), as the harness's Hugging Face model does.
- `loglikelihood_rolling`: the log-likelihood of a whole text, cut into the harness's disjoint rolling windows
  of `seq_len` tokens (`lm_eval.utils.get_rolling_token_windows`, the first predicted from end-of-text).
- `generate_until`: greedy (or sampled, with `do_sample` and `temperature`) decoding with the KV cache
  (`models.decoding.generate`, what `Decoder.generate` runs), among the tokenizer's ids only (a model's
  vocabulary may be padded past them), stopped at end-of-text or `max_gen_toks`, the text then cut at the
  first `until` string. The context keeps its last `seq_len - max_gen_toks` tokens.

Batched: requests are sorted longest first (so a batch pads little and an out-of-memory error comes at once),
right-padded to the batch's longest input (the model is causal, so padding after a row changes nothing before
it), scored `batch_size` at a time and returned in the harness's order. Log-softmax is taken in float32 at
least, whatever the autocast dtype. Shape legend: B rows, T tokens, V vocabulary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from reslab.common.errors import ConfigError
from reslab.models import decoding
from reslab.models.backbone import Decoder
from reslab.models.data.tokenizer import Tokenizer
from reslab.models.decoding import DecodeState, GenerateOptions

Request = tuple[tuple[str, str] | None, list[int], list[int]]  # (the strings, context ids, continuation ids)


class _TokenizerIds:
    """The model seen through its tokenizer for generation: the ids past the tokenizer's (the vocabulary's
    padding) get -inf, so they are never generated (`models.decoding.Extendable`)."""

    def __init__(self, model: Decoder, n_ids: int) -> None:
        self.model, self.n_ids = model, n_ids

    def _mask(self, logits: torch.Tensor) -> torch.Tensor:
        logits[..., self.n_ids:] = float("-inf")
        return logits

    def prefill(self, idx: torch.Tensor, valid: torch.Tensor | None = None) -> tuple[torch.Tensor, DecodeState]:
        logits, state = self.model.prefill(idx, valid)
        return self._mask(logits), state

    def decode_step(self, token: torch.Tensor, state: DecodeState) -> torch.Tensor:
        return self._mask(self.model.decode_step(token, state))


class ReslabLM(TemplateLM):
    """The harness's view of one trained reslab model (module docstring). `dtype`: the autocast dtype the
    forward runs in (None: the parameters' own)."""

    def __init__(self, model: Decoder, tokenizer: Tokenizer, *, batch_size: int = 16, max_gen_toks: int = 256,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if tokenizer.vocab_size > model.shape.vocab_size:
            raise ValueError(f"tokenizer has {tokenizer.vocab_size} ids, the model's vocabulary "
                             f"{model.shape.vocab_size}")
        self.model = model.eval()
        self.tokenizer_ = tokenizer
        self.batch_size = batch_size
        self.max_gen_toks = max_gen_toks
        self.dtype = dtype
        self._device = model.embed.weight.device

    @property
    def device(self) -> torch.device:
        """The model's device (lm-eval's LM defines `device` as a read-only property from 0.4.10 on)."""
        return self._device

    # --- what TemplateLM asks for -------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer_.eot_id

    @property
    def max_length(self) -> int:
        return self.model.shape.seq_len

    def tok_encode(self, string: str, **kwargs: Any) -> list[int]:
        return self.tokenizer_.encode(string)

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer_.decode(tokens)

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """The harness's rule without its `transformers` import: trailing whitespace of the context moves to
        the continuation, and the continuation's ids are those of context + continuation after the context's."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole, head = self.tok_encode(context + continuation), self.tok_encode(context)
        return head, whole[len(head):]

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None or self.dtype == self.model.embed.weight.dtype:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    # --- scoring -----------------------------------------------------------------------------
    @torch.no_grad()
    def _score_batch(self, rows: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        """Each row is (input ids, continuation length): the continuation is the last tokens of input + one
        more, so row r's continuation ids are `ids[1:][-n:]` of its full sequence; scored in one forward."""
        width = max(len(ids) - 1 for ids, _ in rows)
        idx = torch.zeros(len(rows), width, dtype=torch.long)                          # [B, T] right-padded
        for r, (ids, _) in enumerate(rows):
            idx[r, : len(ids) - 1] = torch.tensor(ids[:-1])
        with self._autocast():
            logits = self.model(idx.to(self.device)).logits                            # [B, T, V]
        logp = F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
        out = []
        for r, (ids, n) in enumerate(rows):
            end = len(ids) - 1
            target = torch.tensor(ids[-n:], device=self.device)
            span = logp[r, end - n : end]                                              # [n, V]
            score = span.gather(-1, target.unsqueeze(-1)).sum()
            out.append((float(score), bool((span.argmax(-1) == target).all())))
        return out

    def _loglikelihood_tokens(self, requests: list[Request], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        rows = []
        for _, context, continuation in requests:
            if not continuation:
                raise ValueError("loglikelihood: an empty continuation has no likelihood to score")
            if len(continuation) > self.max_length:
                raise ConfigError(f"evals: an answer of {len(continuation)} tokens is over the model's context "
                                  f"seq_len={self.max_length}; allowed: tasks whose answers fit the context")
            ids = (context + continuation)[-(self.max_length + 1):]
            rows.append((ids, len(continuation)))
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        results: list[tuple[float, bool] | None] = [None] * len(rows)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            for i, answer in zip(chunk, self._score_batch([rows[i] for i in chunk]), strict=True):
                results[i] = answer
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
        return [r for r in results if r is not None]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        windows: list[Request] = []
        owner: list[int] = []
        for i, request in enumerate(requests):
            (text,) = request.args
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, list(context), list(continuation)))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (score, _) in zip(owner, self._loglikelihood_tokens(windows), strict=True):
            totals[i] += score
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # --- generation --------------------------------------------------------------------------
    def _options(self, gen_kwargs: dict[str, Any]) -> tuple[GenerateOptions, list[str]]:
        until = gen_kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        new = min(int(gen_kwargs.get("max_gen_toks", self.max_gen_toks)), self.max_length - 1)
        temperature = float(gen_kwargs.get("temperature", 0.0)) if gen_kwargs.get("do_sample") else 0.0
        return GenerateOptions(max_new_tokens=new, temperature=temperature, stop_tokens=(self.eot_token_id,),
                               seed=int(gen_kwargs.get("seed", 0) or 0), pad_id=self.eot_token_id), until

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        texts: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}  # one GenerateOptions per group
        for i, request in enumerate(requests):
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(i)
        for members in groups.values():
            options, until = self._options(requests[members[0]].args[1])
            keep = self.max_length - options.max_new_tokens
            members = sorted(members, key=lambda i: -len(requests[i].args[0]))
            for start in range(0, len(members), self.batch_size):
                chunk = members[start : start + self.batch_size]
                prompts = [(self.tok_encode(requests[i].args[0]) or [self.prefix_token_id])[-keep:] for i in chunk]
                with self._autocast():
                    outputs = decoding.generate(_TokenizerIds(self.model, self.tokenizer_.vocab_size), prompts,
                                                options, self.max_length, self.model.shape.vocab_size, self.device)
                for i, ids in zip(chunk, outputs, strict=True):
                    text = self.tok_decode([t for t in ids if t != self.eot_token_id])
                    for stop in until:
                        text = text.split(stop)[0] if stop else text
                    texts[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return [t if t is not None else "" for t in texts]
