"""Sequence-axis ShortSWA (`seq_swa`): the window read against a hand computation and a loop over
tokens (heads, RoPE, left padding), w = 1 as a per-token map, the window's causality, the block
S = H + ShortSWA(Norm(H)), A = S + Attn(Norm(S)), H' = A + MLP(Norm(A)) against a hand-written
loop, init and parameter count, refused knobs, training. Prenorm at init, causality across the
model and gradient reach are test_variant_contract.py's; decoding is test_decoding.py's."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from variant_testing import maker, perturb_pathway, tokens, train_steps

from reslab.models.config import ConfigError, ModelConfig
from reslab.models.presets import resolve_model
from reslab.models.residual import get_variant
from reslab.models.residual.seq_swa import ShortSWA
from reslab.orchestrator.cli import main

D, L = 32, 3
EPS = ModelConfig().norm_eps

make = maker("seq_swa")


def short_swa(d: int, window: int, heads: int, rope: bool, seed: int = 0) -> ShortSWA:
    """A ShortSWA of width d with every map (W_O too) and the gain drawn at random."""
    shape = resolve_model(ModelConfig(preset="tiny", d_model=d, n_heads=1, n_layers=1), vocab_size=64)
    module = ShortSWA(shape, window, heads, rope, layer=0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(d))
    return module


def positions_of(valid: torch.Tensor) -> torch.Tensor:
    """Each slot's position in its row, counted from the first real token (negative on left padding)."""
    return valid.long().cumsum(-1) - 1


def test_window_read_by_hand(float64):
    # d = 2, one head, w = 2, identity maps, no RoPE: z_t = sum over {t-1, t} of softmax(x_t . x_j / sqrt 2) x_j
    module = short_swa(2, window=2, heads=1, rope=False)
    with torch.no_grad():
        for m in (module.q_proj, module.k_proj, module.v_proj, module.o_proj):
            m.weight.copy_(torch.eye(2))
        module.norm.weight.fill_(1.0)
    h = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]])
    z, _ = module(h, torch.arange(3).view(1, 3), None)
    r = math.sqrt(2) / math.sqrt(1 + 2 * EPS)              # the nonzero entry of [1, 0] and [0, 1] after RMSNorm
    s = 1 / math.sqrt(1 + EPS)                              # each entry of [1, 1] after RMSNorm
    # token 2: x_2 = [s, s]
    # token 0 reads itself alone: x_0 = [r, 0]
    expected = [[r, 0.0]]
    # token 1: scores x_1 . x_0 = 0 and x_1 . x_1 = r^2, over sqrt 2; x_1 = [0, r]
    a1 = 1 / (1 + math.exp(-r * r / math.sqrt(2)))
    expected.append([(1 - a1) * r, a1 * r])
    # token 2: scores x2 . x1 = s r and x2 . x2 = 2 s^2, over sqrt 2
    a2 = 1 / (1 + math.exp((s * r - 2 * s * s) / math.sqrt(2)))
    expected.append([a2 * s, (1 - a2) * r + a2 * s])
    assert torch.allclose(z[0], torch.tensor(expected), rtol=0, atol=1e-14), (z, expected)


def rotate(x: list[float], position: int, theta: float) -> list[float]:
    """RoPE of one head vector (half-split layout) at `position`."""
    half = len(x) // 2
    out = [0.0] * len(x)
    for i in range(half):
        angle = position / theta ** (2 * i / len(x))
        c, s = math.cos(angle), math.sin(angle)
        out[i], out[i + half] = x[i] * c - x[i + half] * s, x[i] * s + x[i + half] * c
    return out


def loop_reference(module: ShortSWA, h: torch.Tensor, valid: torch.Tensor, theta: float) -> torch.Tensor:
    """z by the note's equation, one token, head and window slot at a time, in Python floats."""
    b, t, d = h.shape
    e, w, rope = module.head_dim, module.window, module.rotary is not None
    with torch.no_grad():
        x = module.norm(h)
        q, k, v = (m(x) for m in (module.q_proj, module.k_proj, module.v_proj))  # [B, T, D]
        read = torch.zeros(b, t, d, dtype=h.dtype)
        for row in range(b):
            first = int(valid[row].long().argmax())
            for head in range(module.heads):
                cut = slice(head * e, (head + 1) * e)
                qs = [q[row, j, cut].tolist() for j in range(t)]
                ks = [k[row, j, cut].tolist() for j in range(t)]
                if rope:
                    qs = [rotate(qs[j], j - first, theta) for j in range(t)]
                    ks = [rotate(ks[j], j - first, theta) for j in range(t)]
                for i in range(first, t):
                    window = range(max(first, i - w + 1), i + 1)
                    scores = [sum(a * c for a, c in zip(qs[i], ks[j], strict=True)) / math.sqrt(e) for j in window]
                    weights = [math.exp(score - max(scores)) for score in scores]
                    for weight, j in zip(weights, window, strict=True):
                        read[row, i, cut] += weight / sum(weights) * v[row, j, cut]
        return module.o_proj(read)


@pytest.mark.parametrize("window,heads,rope", [(3, 2, True), (4, 1, False), (2, 4, True)])
def test_window_read_is_the_equation_over_tokens_and_padding(float64, window, heads, rope):
    module = short_swa(8, window, heads, rope)
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(2, 7, 8, generator=gen)
    valid = torch.ones(2, 7, dtype=torch.bool)
    valid[1, :3] = False                                      # row 1: three slots of left padding
    z, tail = module(h, positions_of(valid), None)
    ref = loop_reference(module, h, valid, theta=10000.0)
    assert torch.allclose(z[valid], ref[valid], rtol=1e-6, atol=1e-9)
    # the padding never reaches a real token
    moved = h.clone()
    moved[1, :3] += 10.0
    assert torch.equal(module(moved, positions_of(valid), None)[0][valid], z[valid])
    assert tail is not None and tail[0].shape == (2, heads, window - 1, 8 // heads)


def test_window_one_is_a_per_token_map(float64):
    module = short_swa(8, window=1, heads=2, rope=True)
    h = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(2))
    z, tail = module(h, torch.arange(5).expand(3, -1), None)
    assert tail is None
    expected = module.o_proj(module.v_proj(module.norm(h)))
    assert torch.allclose(z, expected, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("window", [1, 2, 4])
def test_a_token_beyond_the_window_changes_no_output(float64, window):
    module = short_swa(8, window, heads=2, rope=True)
    h = torch.randn(1, 10, 8, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(10).view(1, 10)
    z = module(h, positions, None)[0]
    j = 4
    moved = h.clone()
    moved[0, j] += 1.0
    changed = (module(moved, positions, None)[0] - z).abs().amax(-1)[0]               # [T]
    inside = [t for t in range(10) if j <= t < j + window]
    assert all(changed[t] == 0 for t in range(10) if t not in inside), changed
    assert all(changed[t] > 1e-6 for t in inside), changed


def reference_logits(model, idx: torch.Tensor) -> torch.Tensor:
    """The note's block, written out: S = H + ShortSWA(Norm(H)), A = S + Attn(Norm(S)), H' = A + MLP(Norm(A))."""
    h = model.embed(idx)
    positions = torch.arange(idx.shape[1]).expand(idx.shape[0], -1)
    for layer in range(model.shape.n_layers):
        s = h + model.pathway.swa[layer](h, positions, None)[0]
        a = s + model.sublayers[2 * layer](model.norms[2 * layer](s))
        h = a + model.sublayers[2 * layer + 1](model.norms[2 * layer + 1](a))
    return F.linear(model.final_norm(h), model.embed.weight)


@pytest.mark.parametrize("options", [{}, {"window": 2, "heads": 4}, {"window": 1, "rope": False}])
def test_block_matches_the_notes_equations(float64, options):
    model = make(options)
    perturb_pathway(model, 0.3)
    idx = tokens()
    assert (model(idx).logits - reference_logits(model, idx)).abs().max().item() < 1e-12
    # off its init the block is not pre-norm's
    assert (model(idx).logits - make(name="prenorm")(idx).logits).abs().max().item() > 1e-3


def test_init_is_private_zero_output_and_follows_the_run_seed():
    p = make().pathway
    assert all(swa.o_proj.weight.abs().sum() == 0 for swa in p.swa)
    assert all(torch.equal(swa.norm.weight, torch.ones(D)) for swa in p.swa)
    w = p.swa[0].q_proj.weight
    assert abs(w.std().item() - 0.02) < 0.004 and not torch.equal(w, p.swa[0].k_proj.weight)
    assert not torch.equal(w, p.swa[1].q_proj.weight)
    assert torch.equal(w, make().pathway.swa[0].q_proj.weight)
    assert not torch.equal(w, make(seed=4).pathway.swa[0].q_proj.weight)


def test_param_count():
    assert make().pathway.extra_params() == L * (4 * D * D + D)
    assert make({"heads": 4, "window": 2}).pathway.extra_params() == L * (4 * D * D + D)
    cls = get_variant("seq_swa")
    shape = resolve_model(ModelConfig(preset="gpt2-124m"), vocab_size=256)
    assert cls(cls.Config(), shape).extra_params_per_layer() == 4 * 768**2 + 768


@pytest.mark.parametrize("options,field,allowed", [
    ({"window": 0}, "window: 0 is not allowed", "allowed: an integer >= 1"),
    ({"heads": 3}, "heads: 3 does not divide d_model=32", "allowed: a divisor of d_model"),
    ({"heads": 32}, "heads: 32 leaves an odd head width d_model/heads=1", "rope: false"),
])
def test_bad_knobs_are_one_line_config_errors(options, field, allowed):
    with pytest.raises(ConfigError) as err:
        make(options)
    message = str(err.value)
    assert "\n" not in message and field in message and allowed in message, message
    if "odd head width" in field:  # without RoPE any width will do
        assert make({**options, "rope": False}).pathway.swa[0].head_dim == 1


def test_validate_refuses_a_bad_window_with_one_line(tmp_path, capsys):
    spec = tmp_path / "bad.yaml"
    spec.write_text("study: bad_window\nbase:\n  model: {preset: tiny}\n  data: {corpus: stdlib, tokenizer: byte}\n"
                    "  train: {steps: 5}\narms:\n  control: prenorm\n"
                    "  swa: {residual: {name: seq_swa, options: {window: 0}}}\n"
                    "seeds: 2\ncomparisons:\n  - {name: all, control: control}\n")
    assert main(["validate", str(spec), "--workspace", str(tmp_path / "ws")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "arms.swa.residual.options" in err and "window: 0" in err, err


def test_training_lowers_loss():
    losses = train_steps(make({"window": 4}), 30)
    assert losses[-1] < losses[0] - 0.5, losses
