"""The depth-history kernels against the float64 reference, through a chain of routing sites.

Each case builds a small model-shaped chain: source 0 is a leaf, site s reads the history, and
source s+1 = z_{s+1} + tanh(out_s W_s) / 2 depends on the read, so the backward has to deliver each
source's gradient before the sublayer that produced it runs (what the write/read ordering
guarantees). The leaves z_k receive exactly the gradient of source k, so every source gradient,
every site's output and weights, and the query and gain gradients are compared with
`DepthHistory(impl="reference")` in float64 (kernels/depth_read/reference.py, itself checked by
gradcheck in test_kernels_depth_read.py). Tolerance as there: err <= 2 err_torch_fp32 + 1e-5 scale.

The kernels run in Triton's CPU interpreter in a spawned worker (the interpreter must be chosen
before triton is imported); `torch.empty` is poisoned with NaN there, so a tile or a table entry
the kernels forget to write fails the comparison.
"""

import importlib.util
import math
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import pytest
import torch
from kernel_testing import nan_empty

# not importorskip, and reslab.kernels.depth_history (which imports torch._dynamo, which imports
# triton) only inside functions: the spawned worker imports this module before it sets
# TRITON_INTERPRET=1, and a triton imported then would never interpret
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs the triton package")


@dataclass(frozen=True)
class Case:
    B: int
    T: int
    D: int
    H: int
    sublayers: int  # sites = sublayers + 1 (the readout)
    block: int = 0  # 0: Full AttnRes (every source a slot); k: Block AttnRes with k sublayers a block
    weights: bool = False  # weights returned and used in the loss (a dweights gradient)
    unused_site: int = -1  # a site whose output gets no gradient

    @property
    def id(self) -> str:
        kind = f"block{self.block}" if self.block else "full"
        extra = (["weights"] if self.weights else []) + ([f"unused{self.unused_site}"] if self.unused_site >= 0 else [])
        return "-".join([f"M{self.B * self.T}-D{self.D}-H{self.H}-S{self.sublayers + 1}-{kind}", *extra])


# the interpreter takes 16 rows per program at these widths: M=5 one partial block, 21 and 40 several
CASES = [
    Case(1, 5, 24, 1, 0),  # one site, one source
    Case(3, 7, 40, 2, 4, weights=True),
    Case(2, 20, 36, 3, 5, unused_site=2),  # H=3 pads the heads to 4
    Case(3, 7, 48, 2, 5, block=2, weights=True),  # blocks of 2: partial slots read once each
    Case(1, 5, 100, 1, 6, block=4),  # D=100, a half-filled last block read by the readout
    Case(2, 20, 24, 3, 3, block=3, unused_site=0),
]


def _chain(case: Case, impl: str, dtype: torch.dtype, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Outputs and gradients of the chain, as float64 on the CPU."""
    from reslab.kernels.depth_history import DepthHistory

    gen = torch.Generator().manual_seed(7)
    sites = case.sublayers + 1

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    # per-row scales make the key RMS differ from row to row
    scales = [0.3 + 2 * torch.rand(case.B, case.T, 1, generator=gen, dtype=torch.float64) for _ in range(sites)]
    kw = dict(device=device, dtype=dtype)
    zs = [(randn(case.B, case.T, case.D) * s).to(**kw).requires_grad_() for s in scales]
    mats = [(randn(case.D, case.D) / math.sqrt(case.D)).to(**kw) for _ in range(case.sublayers)]
    query = (0.5 * randn(sites, case.D)).to(**kw).requires_grad_()
    gain = (1 + 0.2 * randn(sites, case.D)).to(**kw).requires_grad_()
    douts = [randn(case.B, case.T, case.D).to(**kw) for _ in range(sites)]
    dws = [randn(sites + 1, case.B, case.T, case.H).to(device) for _ in range(sites)]

    history = DepthHistory(sites, sites, zs[0], heads=case.H, impl=impl)
    last = sites - 1
    history.write(0, zs[0], (0, last))
    n_blocks = 1 + case.sublayers // case.block if case.block else 0
    prefix, partial, filled, partial_slot, next_partial = 1, None, 0, -1, n_blocks
    loss = torch.zeros((), dtype=torch.float64, device=device)
    result = {}
    for site in range(sites):
        out, weights = history.read(site, prefix, query[site], gain[site], extra=partial_slot,
                                    need_weights=case.weights)
        result[f"out[{site}]"] = out.detach()
        if site != case.unused_site:
            loss = loss + (out.double() * douts[site].double()).sum()
        if case.weights:
            result[f"weights[{site}]"] = weights.detach()
            loss = loss + (weights.double() * dws[site][: weights.shape[0]]).sum()
        if site == case.sublayers:
            break
        x = zs[site + 1] + torch.tanh(out @ mats[site]) / 2
        if not case.block:
            history.write(site + 1, x, (site + 1, last))
            prefix += 1
            continue
        # Block AttnRes: completed blocks take the prefix slots, partial states the slots after them
        partial = x if partial is None else partial + x
        filled += 1
        if filled == case.block:
            history.write(prefix, partial, (site + 1, last))
            prefix, partial, filled, partial_slot = prefix + 1, None, 0, -1
        else:
            partial_slot, next_partial = next_partial, next_partial + 1
            history.write(partial_slot, partial, (site + 1, site + 1))
    leaves = {f"d_source[{k}]": z for k, z in enumerate(zs)} | {"d_query": query, "d_key_gain": gain}
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    for name, g in zip(leaves, grads, strict=True):
        assert g is not None, f"{name}: no gradient"
        result[name] = g
    return {k: v.double().cpu() for k, v in result.items()}


def _errors(case: Case, dtype: torch.dtype = torch.float32, device: str = "cpu") -> dict[str, tuple[float, ...]]:
    """Per tensor: (err_kernel, err_torch, max|ref|), max-abs against float64; err_torch is the
    reference's own error in `dtype`."""
    ref = _chain(case, "reference", torch.float64)
    lowp = _chain(case, "reference", dtype, device)
    with nan_empty():
        tri = _chain(case, "triton", dtype, device)
    assert set(tri) == set(ref)
    return {k: ((tri[k] - r).abs().max().item(), (lowp[k] - r).abs().max().item(), r.abs().max().item())
            for k, r in ref.items()}


def _worker_init() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def interpreter():
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx, initializer=_worker_init) as pool:
        yield pool


def _assert_within(errors: dict, case: Case, atol: float) -> None:
    sites = case.sublayers + 1
    expected = {f"out[{s}]" for s in range(sites)} | {f"d_source[{k}]" for k in range(sites)}
    expected |= {f"weights[{s}]" for s in range(sites)} if case.weights else set()
    assert set(errors) == expected | {"d_query", "d_key_gain"}
    bad = [f"{name}: {ek:.3e} (torch fp32 {et:.3e}, |ref| {scale:.2e})"
           for name, (ek, et, scale) in errors.items()
           if not (math.isfinite(ek) and ek <= 2 * et + atol * max(1.0, scale))]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_history_matches_float64_reference(case, interpreter):
    _assert_within(interpreter.submit(_errors, case).result(), case, 1e-5)


def _gpu_ready() -> bool:
    return torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


# the gpt2 width with MHAR's 8 heads, a Block model of 8 blocks, rows leaving a partial block
GPU_CASES = CASES + [Case(2, 255, 768, 8, 12, weights=True), Case(2, 255, 768, 1, 24, block=3)]


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ready(), reason="needs CUDA and compiled (not interpreted) Triton")
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_history_bf16_within_twice_torch_error_gpu(case):
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference's float32 matmuls set err_torch
    try:
        errors = _errors(case, torch.bfloat16, "cuda")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    _assert_within(errors, case, 5e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ready(), reason="needs CUDA and compiled (not interpreted) Triton")
def test_history_is_deterministic_gpu():
    case = GPU_CASES[-1]
    first = _chain(case, "triton", torch.bfloat16, "cuda")
    second = _chain(case, "triton", torch.bfloat16, "cuda")
    assert all(torch.equal(first[k], second[k]) for k in first)


def _validation_message(label: str) -> str:
    from reslab.kernels.depth_history import DepthHistory

    x = torch.randn(2, 3, 8)
    q, g = torch.zeros(8), torch.ones(8)

    def history(**kw) -> DepthHistory:
        h = DepthHistory(4, 3, x, **kw)
        h.write(0, x, (0, 2))
        return h

    calls = {
        "impl": lambda: DepthHistory(4, 3, x, impl="fast"),
        "heads": lambda: DepthHistory(4, 3, x, heads=3),
        "float64": lambda: DepthHistory(4, 3, x.double()),
        "slot_range": lambda: history().write(4, x, (1, 1)),
        "slot_twice": lambda: history().write(0, x, (0, 0)),
        "readers": lambda: history().write(1, x, (2, 1)),
        "source_shape": lambda: history().write(1, x[:, :2], (1, 2)),
        "unwritten": lambda: history().read(0, 2, q, g),
        "extra_in_prefix": lambda: history().read(0, 1, q, g, extra=0),
        "query": lambda: history().read(0, 1, q[:4], g),
        "site_twice": lambda: [h := history(), h.read(0, 1, q, g), h.read(0, 1, q, g)],
        "undeclared": lambda: [h := history(), h.read(0, 1, q, g), h.write(1, x, (1, 1)), h.read(2, 2, q, g)],
        "skipped": lambda: [h := history(), h.read(0, 1, q, g), h.write(1, x, (1, 2)), h.read(2, 1, q, g)],
    }
    try:
        calls[label]()
    except ValueError as e:
        return str(e)
    return "no ValueError raised"


VALIDATION = [
    ("impl", "DepthHistory.impl: 'fast' is not allowed"),
    ("heads", "DepthHistory.heads: 3 must be a positive divisor of D=8"),
    ("float64", "use impl='reference'"),
    ("slot_range", "slot 4 is out of range 0..3"),
    ("slot_twice", "slot 0 is already written"),
    ("source_shape", "source has shape (2, 2, 8)"),
    ("unwritten", "reads slots [1] that are not written"),
    ("extra_in_prefix", "extra slot 0 is inside the prefix"),
    ("query", "query must be a floating (8,) tensor"),
    ("site_twice", "site 0 has already read"),
    ("readers", "readers (2, 1) of slot 1 must be sites"),
    ("undeclared", "site 2 reads slots [0, 1], but the writes declared it a reader of slots [0]"),
    ("skipped", "site 2 reads slots [0], but the writes declared it a reader of slots [0, 1]"),
]


@pytest.mark.parametrize("label, expected", VALIDATION, ids=[v[0] for v in VALIDATION])
def test_history_rejects_bad_arguments(label, expected, interpreter):
    assert expected in interpreter.submit(_validation_message, label).result()


MODELS = [
    ("attnres", {}),
    ("block_attnres", {"block_size": 2}),
    ("block_attnres", {"block_size": 3}),  # 2L=6 sublayers: the readout reads a closed block
    ("block_mhar", {"block_size": 4, "heads": 3}),  # a half-filled last block read by the readout
]


def _model_errors(name: str, options: dict) -> dict[str, tuple[float, float]]:
    """(max |kernels - reference|, max |reference|) of the loss, logits and every gradient."""
    from reslab.models.backbone import build_model
    from reslab.models.config import ModelConfig, ResidualConfig

    shape = ModelConfig(preset="tiny", d_model=24, n_layers=3, n_heads=2, ffn_hidden=40, seq_len=7)
    idx = torch.randint(0, 32, (3, 7), generator=torch.Generator().manual_seed(3))
    results = []
    for impl in ("reference", "triton"):
        torch.manual_seed(0)
        model = build_model(shape, ResidualConfig(name=name, options={**options, "query_init": "normal",
                                                                      "query_init_std": 0.5}),
                            vocab_size=32, impl=impl)
        assert model.pathway.uses_history == (impl == "triton")
        with torch.no_grad():
            model.pathway.key_gains.mul_(1 + 0.3 * torch.randn(model.pathway.key_gains.shape))
        with nan_empty():
            out = model(idx, idx.roll(-1, 1))
            out.loss.backward()
            routing = model.routing_stats(idx)
        weights = torch.cat([s.head_weights.flatten() for _, s in sorted(routing.sites.items())])
        results.append({"loss": out.loss.detach(), "logits": out.logits.detach(), "routing": weights}
                       | {n: p.grad for n, p in model.named_parameters()})
    ref, tri = results
    return {k: ((tri[k] - r).abs().max().item(), r.abs().max().item()) for k, r in ref.items()}


@pytest.mark.parametrize("name, options", MODELS, ids=[f"{n}-{o}" for n, o in MODELS])
def test_model_on_history_kernels_matches_reference(name, options, interpreter):
    errors = interpreter.submit(_model_errors, name, options).result()
    assert "pathway.queries" in errors and "embed.weight" in errors
    bad = [f"{k}: {e:.2e} (|ref| {s:.2e})" for k, (e, s) in errors.items()
           if not (math.isfinite(e) and e <= 2e-5 * max(1.0, s))]
    assert not bad, "\n".join(bad)


def _decode_results(name: str, options: dict) -> dict:
    """Incremental decoding on the history kernels and on the reference path, float32: two prompts
    (3 tokens, and 1 after left padding) prefilled, then 3 decode steps. Returns max |logits
    difference| over max |logits|, the kernels' decode buffer address after each step, and their
    declared and measured decode state."""
    from reslab.models.backbone import build_model
    from reslab.models.config import ModelConfig, ResidualConfig

    shape = ModelConfig(preset="tiny", d_model=24, n_layers=2, n_heads=2, ffn_hidden=40, seq_len=8)
    idx = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(5))
    valid = torch.tensor([[True, True, True], [False, False, True]])
    logits, addresses = {}, []
    for impl in ("reference", "triton"):
        torch.manual_seed(0)
        residual = ResidualConfig(name=name, options={**options, "query_init": "normal", "query_init_std": 0.5})
        model = build_model(shape, residual, vocab_size=32, impl=impl)
        with nan_empty():
            prompt, state = model.prefill(idx[:, :3], valid)
            steps = [prompt[:, -1]]
            for t in range(3, 6):
                steps.append(model.decode_step(idx[:, t], state))
                if impl == "triton":
                    addresses.append(model.pathway.decode_history.buf.data_ptr())
        logits[impl] = torch.stack(steps, 1)
    ref = logits["reference"]
    return {"error": ((logits["triton"] - ref).abs().max() / ref.abs().max()).item(), "addresses": addresses,
            "declared": model.decode_state_bytes(), "measured": model.measure_decode_state_bytes()}


@pytest.mark.parametrize("name, options", [("attnres", {}), ("block_attnres", {"block_size": 3})],
                         ids=["attnres", "block_attnres-3"])
def test_decoding_on_history_kernels_matches_reference_and_keeps_its_buffer(name, options, interpreter):
    # 2L=4 sublayers: blocks of 3 leave the last one partly filled (the partial sum beside the buffer)
    results = interpreter.submit(_decode_results, name, options).result()
    assert results["error"] <= 1e-5, results
    assert len(set(results["addresses"])) == 1, "a decode step allocated a new history buffer"
    assert results["declared"] == results["measured"]


def _prenorm_gaps(name: str, options: dict) -> dict[bool, float]:
    """Zero queries on the history kernels at the shipped eps: max |logits - prenorm's| over
    max |prenorm's logits|, for stream_scale True (the default) and False (the literal read)."""
    from reslab.models.backbone import build_model
    from reslab.models.config import ModelConfig, ResidualConfig

    shape = ModelConfig(preset="tiny", d_model=24, n_layers=3, n_heads=2, ffn_hidden=40, seq_len=7)
    idx = torch.randint(0, 32, (3, 7), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(0)
    ref = build_model(shape, ResidualConfig(name="prenorm"), vocab_size=32)(idx).logits
    gaps = {}
    for scaled in (True, False):
        torch.manual_seed(0)
        model = build_model(shape, ResidualConfig(name=name, options={**options, "stream_scale": scaled}),
                            vocab_size=32, impl="triton")
        assert model.pathway.uses_history
        with nan_empty(), torch.no_grad():
            gaps[scaled] = ((model(idx).logits - ref).abs().max() / ref.abs().max()).item()
    return gaps


@pytest.mark.parametrize("name, options", MODELS, ids=[f"{n}-{o}" for n, o in MODELS])
def test_zero_queries_on_history_kernels_are_prenorm_at_the_shipped_eps(name, options, interpreter):
    # issue 20: the read is scaled outside the kernels (by the number of sources read), so the
    # kernel path must apply it too; the literal read misses prenorm by the RMSNorm eps
    gaps = interpreter.submit(_prenorm_gaps, name, options).result()
    assert gaps[True] <= 1e-5 and gaps[False] > 1e-4, gaps


def _compiled_model_error() -> float:
    """max |compiled - eager| over the loss and every gradient of a Block AttnRes model, two steps."""
    from reslab.models.backbone import build_model
    from reslab.models.config import ModelConfig, ResidualConfig

    shape = ModelConfig(preset="tiny", d_model=24, n_layers=2, n_heads=2, ffn_hidden=40, seq_len=7)
    idx = torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(3))
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = build_model(shape, ResidualConfig(name="block_attnres", options={"block_size": 3,
                                                                                "query_init": "normal"}),
                            vocab_size=32, impl="triton")
        step = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
        for _ in range(2):
            out = step(idx, idx.roll(-1, 1))
            out.loss.backward()
        grads = [p.grad for p in model.parameters()]
        assert all(g is not None for g in grads), "a parameter got no gradient"
        results.append([out.loss.detach(), *grads])
    return max((a - b).abs().max().item() for a, b in zip(*results, strict=True))


@pytest.mark.slow  # torch.compile of a whole model on the CPU (Inductor's C++ build), ~7 s
def test_compiled_model_on_history_kernels_matches_eager(interpreter):
    # fullgraph=True fails on a graph break; aot_eager traces the ops' fake implementations and the
    # autograd Functions, and the tokens must keep every pull after its readers' backward (a
    # write whose backward got lost once left the sublayers without gradient)
    assert interpreter.submit(_compiled_model_error).result() <= 1e-6
