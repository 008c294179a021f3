"""Incremental decoding (models/decoding.py, Decoder.prefill / decode_step / generate).

The reference is the backbone's own full forward, which has no cache: for every registered variant
and each knob that changes its pathway's structure, in float64 with the pathway's parameters moved
off their init (so an identity at init cannot make the comparison vacuous), the logits of prefill
plus one-token decode steps equal the full forward's at every position, and a left-padded batch
of prompts of different lengths equals each prompt run alone. Greedy generation is checked
against argmax over repeated full forwards. `seq_swa` and a toy pathway defined here (the previous
token's embedding) mix across the sequence, the kind of variant that needs the cross-token hooks.
Block AttnRes decodes in two phases, held to its per-site read; every variant's declared decode
state equals the bytes its real state and carry hold.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import Tensor
from variant_testing import VOCAB, make_model, perturb_pathway, tokens

from reslab.common.errors import ConfigError
from reslab.models.backbone import Decoder
from reslab.models.config import ModelConfig
from reslab.models.conformance import incremental  # what `reslab check`'s decode check runs
from reslab.models.decoding import GenerateOptions, KVCache, tensor_bytes
from reslab.models.presets import resolve_model
from reslab.models.residual import variants
from reslab.models.residual.base import RoutingRecorder
from reslab.models.residual.block_attnres import BlockState
from reslab.models.residual.prenorm import PreNorm

pytestmark = pytest.mark.usefixtures("one_thread")

# GQA (4 query heads over 2 key/value heads), head_dim 8; seq_len is the context generate checks
SHAPE = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, seq_len=32)
RTOL, ATOL = 1e-6, 1e-9

# (variant, knobs): the defaults of every variant, then each knob that changes what the pathway
# computes or keeps per token (sources, streams, blocks, windows, gates, routes)
CASES: list[tuple[str, dict[str, Any]]] = [
    ("prenorm", {}),
    ("attnres", {}), ("attnres", {"readout": False}), ("attnres", {"key_norm": False}),
    ("attnres", {"score": "sigmoid"}), ("attnres", {"query_form": "input"}), ("attnres", {"query_form": "scalar"}),
    ("attnres", {"stream_scale": False}),
    ("block_attnres", {}), ("block_attnres", {"block_size": 3}), ("block_attnres", {"block_size": 1}),
    ("block_attnres", {"block_size": 2}), ("block_attnres", {"block_size": 3, "readout": False}),
    ("block_attnres", {"key_norm": False}),
    ("block_mhar", {}), ("block_mhar", {"block_size": 2, "heads": 2}), ("block_mhar", {"block_size": 3, "heads": 4}),
    ("mhar", {}), ("mhar", {"heads": 2}),
    ("depth_swa", {}), ("depth_swa", {"window": 2}), ("depth_swa", {"window": 2, "include_embedding": False}),
    ("depth_swa", {"query": "projected", "window": 3, "key_dim": 8}),
    ("depth_swa", {"query": "projected", "value_proj": False, "key_dim": 8}),
    ("rd_attnres", {}), ("rd_attnres", {"value_route": "tied"}), ("rd_attnres", {"value_route": "fixed"}),
    ("rd_attnres", {"value_route": "merged"}), ("rd_attnres", {"parent": "full"}),
    ("rd_attnres", {"value_key_norm": "separate"}),
    ("dar", {}), ("dar", {"block_size": 2}), ("dar", {"key_source": "value"}), ("dar", {"addressing": "self"}),
    ("dar", {"addressing": "independent"}), ("dar", {"mix": "learned"}), ("dar", {"write_gate": "fixed"}),
    ("dar", {"write_gate_shape": "channel", "cross_mix": "channel"}), ("dar", {"value_proj": "channel"}),
    ("dar", {"value_proj": "matrix"}), ("dar", {"readout": False}),
    ("ddl", {}), ("ddl", {"beta_mlp": True}),
    ("delta_attnres", {}), ("delta_attnres", {"route_first": True}), ("delta_attnres", {"null_source": True}),
    ("delta_attnres", {"gate": "sigmoid_scalar"}), ("delta_attnres", {"gate": "sigmoid_vector"}),
    ("delta_attnres", {"gate": "learnable_alpha", "gate_init": 0.3}), ("delta_attnres", {"sources": "cumulative"}),
    ("delta_attnres", {"pre_gated": True}), ("delta_attnres", {"heads": 4}),
    ("delta_block", {}), ("delta_block", {"block_delta": "released"}), ("delta_block", {"num_blocks": 1}),
    ("delta_block", {"route_first": True, "null_source": True}),
    ("denseformer", {}), ("denseformer", {"dilation": 2}), ("denseformer", {"period": 2}),
    ("highway", {}), ("highway", {"norm_state": True}),
    ("hyper_connections", {}), ("hyper_connections", {"dynamic": True}),
    ("hyper_connections", {"init": "mhar_baseline"}), ("hyper_connections", {"streams": 1}),
    ("mgr", {}), ("mgr", {"per": "layer"}), ("mgr", {"gate_type": "softmax"}), ("mgr", {"streams": 1}),
    ("mhc", {}), ("mhc", {"variant": "lite", "streams": 3}), ("mhc", {"pre_init": "uniform"}),
    ("review", {}), ("review", {"form": "convex"}),
    ("seq_swa", {}), ("seq_swa", {"window": 1}), ("seq_swa", {"window": 2}), ("seq_swa", {"window": 4, "heads": 2}),
    ("seq_swa", {"window": 4, "heads": 4, "rope": False}),
]


def case_id(case: tuple[str, dict[str, Any]]) -> str:
    name, knobs = case
    return name + "".join(f"-{k}={v}" for k, v in knobs.items())


def build(name: str, knobs: dict[str, Any], **shape: Any) -> Decoder:
    """The float64 model (the caller sets the default dtype) with its pathway moved off its init."""
    model = make_model(name, knobs, **{**SHAPE, **shape})
    perturb_pathway(model, 0.3)
    assert isinstance(model, Decoder)
    return model.eval()


def check_padded_batch(model: Decoder, lengths: tuple[int, ...], extra: int) -> None:
    """Prompts of `lengths` left-padded into one batch, prefilled, then `extra` tokens each decoded:
    every row's logits equal its prompt run alone (full forward) at every real position."""
    rows = [tokens(1, n + extra, seed=10 + n)[0] for n in lengths]
    width = max(lengths)
    idx = torch.zeros(len(rows), width, dtype=torch.long)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, n in enumerate(lengths):
        idx[i, width - n:], valid[i, width - n:] = rows[i][:n], True
    logits, state = model.prefill(idx, valid)
    steps = [model.decode_step(torch.stack([r[n + j] for r, n in zip(rows, lengths, strict=True)]), state)
             for j in range(extra)]
    for i, n in enumerate(lengths):
        alone = model(rows[i][None]).logits[0].detach()                               # [n + extra, V]
        got = torch.cat([logits[i, width - n:], torch.stack([s[i] for s in steps])])
        torch.testing.assert_close(got, alone, rtol=RTOL, atol=ATOL)


def test_positions_count_from_each_rows_first_real_token():
    # RoPE scores depend on position differences only, so the logits alone cannot see an offset
    cache = KVCache(n_layers=1, batch=2, capacity=8)
    valid = torch.tensor([[False, False, True], [True, True, True]])
    assert cache.extend(valid).tolist() == [[-1, -1, 0], [0, 1, 2]]
    assert cache.extend(torch.ones(2, 1, dtype=torch.bool)).tolist() == [[1], [3]]
    # the new token sees its row's real tokens and itself, never the padding
    assert cache.mask[:, 0, 0].tolist() == [[False, False, True, True], [True, True, True, True]]


def test_the_cases_cover_every_registered_variant():
    assert {name for name, _ in CASES} == set(variants())


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_incremental_decoding_equals_the_full_forward(case, float64):
    name, knobs = case
    model = build(name, knobs)
    idx = tokens(3, 9, seed=2)
    full = model(idx).logits.detach()
    for prompt_len in (1, 4, 9):
        torch.testing.assert_close(incremental(model, idx, prompt_len), full, rtol=RTOL, atol=ATOL)
    check_padded_batch(model, (2, 5, 7), extra=2)


# --- the cross-token hooks -------------------------------------------------------------------
@dataclasses.dataclass
class ShiftState:
    h: Tensor      # [B, T, D] the residual stream
    last: Tensor   # [B, 1, D] the chunk's last embedding, for the next tokens


class TokenShift(PreNorm):
    """Pre-norm whose stream starts at e_t + 0.5 e_{t-1} (nothing before a row's first real token):
    the one mixing across the sequence, so decoding needs `resume` and `carry`. Not registered."""

    def start(self, embedding: Tensor) -> Any:
        return embedding

    def resume(self, state: Any, carry: Any, positions: Tensor) -> ShiftState:
        first = torch.zeros_like(state[:, :1]) if carry is None else carry
        prev = torch.cat([first, state[:, :-1]], 1) * (positions > 0).unsqueeze(-1)
        return ShiftState(state + 0.5 * prev, state[:, -1:])

    def carry(self, state: ShiftState) -> Tensor:
        return state.last

    def sublayer_input(self, state: ShiftState, site: int) -> Tensor:
        return state.h

    def update(self, state: ShiftState, site: int, output: Tensor) -> ShiftState:
        return ShiftState(state.h + output, state.last)

    def readout(self, state: ShiftState) -> Tensor:
        return state.h


def test_a_pathway_that_mixes_across_tokens_decodes_through_its_carry(float64):
    model = build("prenorm", {})
    model.pathway = TokenShift(PreNorm.Config(), model.shape)
    idx = tokens(3, 9, seed=4)
    full = model(idx).logits.detach()
    plain = PreNorm(PreNorm.Config(), model.shape)
    assert not torch.allclose(full, Decoder.forward(_with(model, plain), idx).logits, rtol=1e-3)
    for prompt_len in (1, 5):
        torch.testing.assert_close(incremental(model, idx, prompt_len), full, rtol=RTOL, atol=ATOL)
    check_padded_batch(model, (1, 4, 6), extra=3)


def _with(model: Decoder, pathway: Any) -> Decoder:
    """A copy of `model` whose pathway is `pathway` (same backbone weights)."""
    other = Decoder(model.shape, pathway)
    other.load_state_dict(model.state_dict(), strict=False)
    return other


# --- what decoding keeps -------------------------------------------------------------------------
# knobs that change what the state holds but not how the pathway decodes (so not in CASES)
STATE_CASES: list[tuple[str, dict[str, Any]]] = [
    ("dar", {"addressing": "independent", "write_gate": "fixed"}),
    ("dar", {"addressing": "independent", "write_gate": "fixed", "block_size": 5}),
    ("dar", {"key_source": "value", "block_size": 4}), ("dar", {"block_size": 4}),
    ("delta_attnres", {"entropy_bonus": 0.1}), ("delta_attnres", {"sources": "cumulative", "route_first": True}),
    ("delta_block", {"entropy_bonus": 0.1, "route_first": True}), ("delta_block", {"num_blocks": 2}),
    ("delta_block", {"num_blocks": 2, "block_delta": "released"}),
    ("denseformer", {"period": 2}), ("mgr", {"per": "layer", "streams": 3}), ("seq_swa", {"window": 3, "heads": 2}),
]


# two layers, then three: Block AttnRes's last block is partly filled there (6 sites, blocks of 4)
STATE_PARAMS = [pytest.param(case, layers, id=f"L{layers}-{case_id(case)}")
                for layers, cases in ((2, CASES), (3, CASES + STATE_CASES)) for case in cases]


@pytest.mark.parametrize(("case", "n_layers"), STATE_PARAMS)
def test_declared_decode_state_is_what_the_state_holds(case, n_layers, float64):
    # the measurement: every storage the final state of a decoded token holds, less the carry's, and
    # the carry's
    model = make_model(*case, **{**SHAPE, "n_layers": n_layers})
    assert isinstance(model, Decoder)
    declared, measured = model.decode_state_bytes(), model.measure_decode_state_bytes()
    assert declared == measured
    assert declared.pathway >= model.shape.d_model * 8


@pytest.mark.parametrize("name", ["attnres", "mhar", "block_attnres", "block_mhar"])
def test_declared_decode_state_of_a_bfloat16_model(name):
    # the depth cache keeps bf16 sources and float32 scores: two bf16 elements per score
    model = make_model(name, {}, **{**SHAPE, "n_layers": 3}).to(torch.bfloat16).eval()
    assert isinstance(model, Decoder)
    assert model.decode_state_bytes() == model.measure_decode_state_bytes()


def test_the_kv_cache_reserves_under_twice_what_it_uses():
    # a 1-token prompt then 1 token at a time to the full context of 32, then a 9-token prompt: after every
    # step the keys and values as allocated are under twice those of the filled slots, and the filled
    # slots hold exactly `kv` bytes per cached token per row (the declaration, from the shape)
    model = build("attnres", {})
    declared = model.decode_state_bytes()
    for prompt_len in (1, 9):
        idx = tokens(2, 32, seed=5)
        _, state = model.prefill(idx[:, :prompt_len])
        for t in range(prompt_len, 33):
            cache = state.cache
            assert cache.used_bytes() == 2 * declared.kv * t
            assert cache.used_bytes() <= cache.reserved_bytes() < 2 * cache.used_bytes()
            assert cache.valid.shape[1] * 2 * model.shape.n_layers == cache.reserved_bytes() // (
                cache.keys[0].element_size() * model.shape.n_kv_heads * model.shape.head_dim * 2)
            if t < 32:
                model.decode_step(idx[:, t], state)
    # at the full context the cache holds the context and no more
    assert state.cache.reserved_bytes() == state.cache.used_bytes() == 2 * declared.kv * 32


def test_a_short_generation_reserves_under_twice_its_kv():
    # the case, scaled: a 3-token prompt and 6 decode steps in a context of 32 used to reserve all 32
    # slots (3.6x the 9 it fills); measured on the storages the cache's keys and values hold
    model = build("prenorm", {})
    logits, state = model.prefill(tokens(2, 3, seed=6))
    token = logits[:, -1].argmax(-1)
    for _ in range(6):
        token = model.decode_step(token, state).argmax(-1)
    used = 2 * model.decode_state_bytes().kv * 9
    reserved = tensor_bytes([state.cache.keys, state.cache.values])
    assert used <= reserved < 2 * used


def test_decode_state_bytes_in_closed_form():
    # the declarations at gpt2-124m (d 768, L 12), from the pathways alone
    d, layers = 768, 12
    shape = resolve_model(ModelConfig(preset="gpt2-124m"), vocab_size=256)

    def elems(name: str, **knobs: Any) -> tuple[int, int]:
        cls = variants()[name]
        return cls(cls.Config(**knobs), shape).decode_state_elems()

    assert elems("prenorm") == (d, 0) and elems("hyper_connections") == (4 * d, 0)
    # the 2L + 1 sources and, on the reference's cached decode read, each one's score for each of the
    # 2L + 1 routes (the readout's included) and each depth head: 25 x 25 x H float32 scores
    sources = routes = 2 * layers + 1
    assert elems("attnres") == (sources * d + routes * sources, 0)
    assert elems("mhar") == (sources * d + routes * sources * 8, 0)
    assert elems("attnres", query_form="input") == (sources * d, 0)             # ablations read per site
    # 24 sites: blocks of 4 close 6 blocks, blocks of 5 close 4 and leave one partial
    assert elems("block_attnres") == (7 * d + routes * 7, 0)
    assert elems("block_attnres", block_size=5) == (6 * d + routes * 5, 0)
    assert elems("seq_swa") == (d, layers * 7 * 2 * d) and elems("seq_swa", window=1) == (d, 0)


def test_two_phase_read_is_the_per_site_read(float64):
    # random non-zero queries and key gains, blocks and partial blocks of random scale: phase 1 over
    # the completed blocks (written to a decode step's cache) for a block's sites at once, then each
    # site merges its partial block
    for name, knobs in [("block_attnres", {"block_size": 3}), ("block_mhar", {"block_size": 2, "heads": 4})]:
        model = make_model(name, {**knobs, "query_init": "normal"}, **SHAPE)
        perturb_pathway(model, 1.0)
        p, gen = model.pathway, torch.Generator().manual_seed(3)
        blocks = [torch.randn(2, 3, 32, generator=gen) * (0.1 + i) for i in range(3)]
        cache = p.open_cache(blocks[0], 4)
        for block in blocks[1:]:
            cache = p.cache_write(cache, block)
        lead = p.lead_reads(cache, range(1, 4))
        for site in range(1, 4):
            for partial in (None, 5 * torch.randn(2, 3, 32, generator=gen)):
                state = BlockState(blocks=blocks, partial=partial, cache=cache, lead=lead)
                got, ref = p.merged_read(state, site), p.route(state.sources(), site)
                torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("name", "knobs"), [("block_attnres", {"block_size": 3}), ("block_mhar", {"heads": 2}),
                                             ("attnres", {}), ("mhar", {"heads": 2})])
def test_attnres_decode_steps_read_from_their_cache(monkeypatch, name, knobs):
    # the decode path is not a silent fallback: after prefill, no decode step reads per site (Block
    # AttnRes reads in two phases, Full AttnRes and MHAR from the cached scores)
    model = build(name, knobs)
    idx = tokens(2, 5, seed=1)
    full = model(idx).logits.detach()
    logits, state = model.prefill(idx[:, :3])
    calls: list[int] = []
    monkeypatch.setattr(model.pathway, "route", lambda sources, site: calls.append(site))
    steps = [model.decode_step(idx[:, t], state) for t in (3, 4)]
    assert calls == []
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 3:], rtol=1e-5, atol=1e-6)


def test_cached_decode_reads_record_the_per_site_weights(float64):
    # the routing recorder sees the same depth weights from prefill plus decode steps as from the full
    # forward over the same tokens (diagnostics on a decode path read the cached scores; the recorder
    # keeps float32)
    for name, knobs in [("attnres", {}), ("mhar", {"heads": 2}), ("block_attnres", {"block_size": 3}),
                        ("block_mhar", {"heads": 4})]:
        model = build(name, knobs)
        idx = tokens(2, 5, seed=1)
        full = model.routing_stats(idx)
        recorder = RoutingRecorder()
        model.pathway.recorder = recorder
        try:
            incremental(model, idx, 2)
        finally:
            model.pathway.recorder = None
        assert recorder.sites.keys() == full.sites.keys()
        for key, stats in full.sites.items():
            assert recorder.sites[key].tokens == stats.tokens
            torch.testing.assert_close(recorder.sites[key].head_weights, stats.head_weights, rtol=1e-6, atol=1e-7)


# --- generate ----------------------------------------------------------------------------------
def greedy_by_full_forwards(model: Decoder, prompt: list[int], n: int) -> list[int]:
    """n tokens by argmax of a full forward over the whole sequence so far, no cache."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


PROMPTS = [[5, 9, 2], [7, 1, 3, 3, 8, 11], [4]]


@pytest.mark.parametrize("name", ["prenorm", "dar", "mhc", "block_attnres"])
def test_greedy_generate_equals_argmax_of_full_forwards(name, float64):
    model = build(name, {})
    out = model.generate(PROMPTS, GenerateOptions(max_new_tokens=6))
    assert out == [greedy_by_full_forwards(model, p, 6) for p in PROMPTS]


def test_sampling_is_reproducible_with_a_seed_and_top_k_1_is_greedy():
    model = build("attnres", {})
    hot = GenerateOptions(max_new_tokens=8, temperature=2.0, seed=3)
    first = model.generate(PROMPTS, hot)
    assert model.generate(PROMPTS, hot) == first
    assert model.generate(PROMPTS, dataclasses.replace(hot, seed=4)) != first
    assert all(0 <= t < VOCAB for row in first for t in row) and [len(r) for r in first] == [8, 8, 8]
    greedy = model.generate(PROMPTS, GenerateOptions(max_new_tokens=8))
    assert model.generate(PROMPTS, dataclasses.replace(hot, top_k=1)) == greedy


def test_a_stop_token_ends_its_row_only():
    model = build("prenorm", {})
    free = model.generate(PROMPTS, GenerateOptions(max_new_tokens=8))
    stop = free[1][2]
    stopped = model.generate(PROMPTS, GenerateOptions(max_new_tokens=8, stop_tokens=(stop,)))

    def cut(row: list[int]) -> list[int]:
        return row[:row.index(stop) + 1] if stop in row else row

    assert stopped == [cut(r) for r in free]
    assert len(stopped[1]) <= 3 and stopped[1][-1] == stop


def test_a_prompt_longer_than_the_context_is_one_line_config_error():
    model = build("prenorm", {})
    with pytest.raises(ConfigError) as err:
        model.generate([list(range(30)), [1]], GenerateOptions(max_new_tokens=5))
    message = str(err.value)
    assert "\n" not in message and "30 tokens" in message and "35" in message and "seq_len=32" in message
    assert err.value.exit_code == 2
    with pytest.raises(ConfigError, match="seq_len=32"):
        model.prefill(tokens(1, 33))


@pytest.mark.parametrize("options", [dict(max_new_tokens=0), dict(temperature=-1.0), dict(top_k=0),
                                     dict(max_new_tokens="5"), dict(temperature="hot"), dict(seed=1.5)])
def test_bad_generate_options_name_their_field(options):
    with pytest.raises(ConfigError, match=f"generate.{next(iter(options))}"):
        GenerateOptions(**options)


@pytest.mark.parametrize(("prompts", "why"), [([[1, VOCAB]], "the model's vocabulary"), ([[-1, 2]], "vocabulary"),
                                              (["abc"], "integer token ids"), ([[]], "empty prompt")])
def test_bad_prompts_are_one_line_config_errors(prompts, why):
    with pytest.raises(ConfigError, match=why) as err:
        build("prenorm", {}).generate(prompts, GenerateOptions(max_new_tokens=2))
    assert "\n" not in str(err.value)
