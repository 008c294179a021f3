"""The fused depth read against the float64 reference (style.md G4, G5).

CPU: the Triton kernels run in Triton's interpreter in float32 (it computes bf16 wrongly). The
interpreter has to be chosen before `triton` is imported and then holds for the whole process,
so every kernel call here runs in one spawned worker that sets TRITON_INTERPRET=1 itself; this
pytest process only compares numbers and never sees the variable. Kernel outputs are poisoned
with NaN (torch.empty) so a tile the kernel forgets to write fails the comparison.

GPU (`-m gpu`, skipped without CUDA): the same cases in bf16, plus one at the gpt2 width, with
err_kernel <= 2 * err_torch_bf16 + ATOL for the output, the weights and every gradient.
"""

import math
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import pytest
import torch
from kernel_testing import nan_empty

from reslab.kernels.depth_read import depth_read, depth_read2, depth_read2_reference, depth_read_reference

# one table for every tolerance: ATOL[dtype] * max(1, max|reference|) on top of 2 * err_torch
ATOL = {torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 1e-2}


@dataclass(frozen=True)
class Case:
    B: int
    T: int
    D: int
    H: int
    N: int
    keys: bool = False
    residual: bool = False
    routes: int = 1
    dweights: bool = True
    zero_query: bool = False

    @property
    def id(self) -> str:
        flags = [f for f in ("keys", "residual", "zero_query") if getattr(self, f)]
        flags += [] if self.dweights else ["no_dw"]
        return "-".join([f"B{self.B}-T{self.T}-D{self.D}-H{self.H}-N{self.N}-R{self.routes}", *flags])


# the interpreter takes 16 rows per program: 14 rows is one partial block, 21 two programs
CASES = [
    # D=48 not a power of two, 4 heads of 12
    Case(2, 7, 48, 4, 3),
    # one source: the weights are 1 and the key path of the gradient vanishes
    Case(2, 7, 40, 2, 1),
    # DAR keys and a Delta residual, two programs and their partial sums
    Case(3, 7, 48, 1, 4, keys=True, residual=True),
    # H=3 pads the head axis to 4; no gradient into the weights
    Case(3, 7, 48, 3, 2, residual=True, dweights=False),
    # the zero-initialised query: uniform weights
    Case(2, 7, 40, 2, 5, zero_query=True),
    # RD-AttnRes: two routes in one pass, with keys and a residual
    Case(3, 7, 40, 2, 3, keys=True, residual=True, routes=2),
    Case(2, 7, 48, 4, 2, routes=2, dweights=False),
]
# the gpt2 width with MHAR's H=8 and a row count that leaves a partial block
GPU_CASES = CASES + [Case(2, 255, 768, 8, 13), Case(2, 255, 768, 1, 25, residual=True)]


def _inputs(case: Case, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    f64 = torch.float64

    def rows(n: int) -> list[torch.Tensor]:
        # per-row scales make the key RMS differ from row to row
        return [
            torch.randn(case.B, case.T, case.D, generator=gen, dtype=f64)
            * (0.25 + 2 * torch.rand(case.B, case.T, 1, generator=gen, dtype=f64))
            for _ in range(n)
        ]

    routes = range(case.routes)
    return {
        "sources": rows(case.N),
        "keys": rows(case.N) if case.keys else None,
        "residual": rows(1)[0] if case.residual else None,
        "query": [
            torch.zeros_like(q) if case.zero_query else q
            for q in (0.3 * torch.randn(case.D, generator=gen, dtype=f64) for _ in routes)
        ],
        "key_gain": [1 + 0.2 * torch.randn(case.D, generator=gen, dtype=f64) for _ in routes],
        "dout": [torch.randn(case.B, case.T, case.D, generator=gen, dtype=f64) for _ in routes],
        "dweights": [torch.randn(case.N, case.B, case.T, case.H, generator=gen, dtype=f64) for _ in routes],
    }


def _run(case: Case, inp: dict, dtype: torch.dtype, device: str, impl: str) -> dict[str, torch.Tensor]:
    """Outputs and all gradients of one implementation, as float64 on the CPU."""

    def leaf(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype).requires_grad_()

    sources = [leaf(s) for s in inp["sources"]]
    keys = None if inp["keys"] is None else [leaf(k) for k in inp["keys"]]
    residual = None if inp["residual"] is None else leaf(inp["residual"])
    queries = [leaf(q) for q in inp["query"]]
    gains = [leaf(g) for g in inp["key_gain"]]
    kw = dict(heads=case.H, keys=keys, residual=residual, impl=impl)
    if case.routes == 1:
        out, weights = depth_read(sources, queries[0], gains[0], **kw)
        outs = {"out": out, "weights": weights}
    else:
        out, out_v, weights, weights_v = depth_read2(sources, queries[0], gains[0], queries[1], gains[1], **kw)
        outs = {"out": out, "out_v": out_v, "weights": weights, "weights_v": weights_v}

    leaves = {f"d_source[{i}]": s for i, s in enumerate(sources)}
    leaves.update({f"d_key[{i}]": k for i, k in enumerate(keys or [])})
    if residual is not None:
        leaves["d_residual"] = residual
    suffixes = ["", "_v"][: case.routes]
    leaves.update({f"d_query{s}": q for s, q in zip(suffixes, queries, strict=True)})
    leaves.update({f"d_key_gain{s}": g for s, g in zip(suffixes, gains, strict=True)})

    tensors, grads_in = [], []
    for s, dout, dw in zip(suffixes, inp["dout"], inp["dweights"], strict=True):
        tensors.append(outs[f"out{s}"])
        grads_in.append(dout.to(device=device, dtype=outs[f"out{s}"].dtype))
        if case.dweights:
            tensors.append(outs[f"weights{s}"])
            grads_in.append(dw.to(device=device, dtype=outs[f"weights{s}"].dtype))
    grads = torch.autograd.grad(tensors, list(leaves.values()), grads_in)
    result = {name: t.detach().double().cpu() for name, t in outs.items()}
    result.update({name: g.double().cpu() for name, g in zip(leaves, grads, strict=True)})
    return result


def _kernel_errors(case: Case, dtype_name: str, device: str) -> dict[str, tuple[float, float, float, float]]:
    """Per tensor: (err_kernel, err_torch, max|ref|, relative RMSE of the kernel), all max-abs."""
    dtype = getattr(torch, dtype_name)
    inp = _inputs(case)
    # the float64 reference sees the same rounded inputs as the low-precision runs
    rounded = {
        k: v if v is None else (v.to(dtype).double() if torch.is_tensor(v) else [t.to(dtype).double() for t in v])
        for k, v in inp.items()
    }
    ref = _run(case, rounded, torch.float64, "cpu", "reference")
    lowp = _run(case, inp, dtype, device, "reference")
    with nan_empty():
        tri = _run(case, inp, dtype, device, "triton")
    errors = {}
    for name, r in ref.items():
        err_k = (tri[name] - r).abs().max().item()
        err_t = (lowp[name] - r).abs().max().item()
        rmse = ((tri[name] - r).pow(2).mean().sqrt() / r.pow(2).mean().sqrt().clamp_min(1e-30)).item()
        errors[name] = (err_k, err_t, r.abs().max().item(), rmse)
    return errors


def _assert_within(errors: dict, dtype: torch.dtype, case: Case) -> None:
    suffixes = ["", "_v"][: case.routes]
    expected = {f"d_source[{i}]" for i in range(case.N)}
    expected |= {f"d_key[{i}]" for i in range(case.N)} if case.keys else set()
    expected |= {"d_residual"} if case.residual else set()
    expected |= {f"{n}{s}" for n in ("out", "weights", "d_query", "d_key_gain") for s in suffixes}
    assert set(errors) == expected
    bad = []
    for name, (err_k, err_t, scale, rmse) in errors.items():
        bound = 2 * err_t + ATOL[dtype] * max(1.0, scale)
        if not (math.isfinite(err_k) and err_k <= bound):
            bad.append(
                f"{name}: {err_k:.3e} > {bound:.3e} (torch {err_t:.3e}, |ref| {scale:.2e}, rel rmse {rmse:.1e})"
            )
    assert not bad, "\n".join(bad)


def _worker_init() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    # tiny tensors: a second intra-op thread only adds synchronisation (gradcheck ran 40x slower)
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def triton():
    """The `triton` package; a test that needs it skips without it (the reference tests still run)."""
    return pytest.importorskip("triton")


@pytest.fixture(scope="module")
def interpreter(triton):
    """A worker process whose `triton` runs in the CPU interpreter."""
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx, initializer=_worker_init) as pool:
        yield pool


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_triton_matches_float64_reference(case, interpreter):
    errors = interpreter.submit(_kernel_errors, case, "float32", "cpu").result()
    _assert_within(errors, torch.float32, case)


def _validation_message(label: str) -> str:
    from reslab.kernels.depth_read.triton import depth_read2_triton, depth_read_triton

    B, T, D, N = 2, 3, 40, 3
    src = [torch.randn(B, T, D) for _ in range(N)]
    q, g = torch.zeros(D), torch.ones(D)
    calls = {
        "empty": lambda: depth_read_triton([], q, g),
        "stacked": lambda: depth_read_triton(torch.stack(src), q, g),
        "rank": lambda: depth_read_triton([s[0] for s in src], q, g),
        "shape": lambda: depth_read_triton([src[0], torch.randn(B, T + 1, D)], q, g),
        "heads": lambda: depth_read_triton(src, q, g, heads=3),
        "query": lambda: depth_read_triton(src, torch.zeros(D + 1), g),
        "key_gain": lambda: depth_read_triton(src, q, g[None]),
        "keys_count": lambda: depth_read_triton(src, q, g, keys=src[:-1]),
        "keys_shape": lambda: depth_read_triton(src, q, g, keys=[s[:, :2] for s in src]),
        "residual": lambda: depth_read_triton(src, q, g, residual=torch.randn(B, T, D + 1)),
        "mixed_dtype": lambda: depth_read_triton([src[0], src[1].half()], q, g),
        "float64": lambda: depth_read_triton([s.double() for s in src], q, g),
        "mixed_device": lambda: depth_read_triton([src[0], torch.empty(B, T, D, device="meta")], q, g),
        "query_device": lambda: depth_read_triton(src, torch.zeros(D, device="meta"), g),
        "query_v": lambda: depth_read2_triton(src, q, g, torch.zeros(D // 2), g),
    }
    try:
        calls[label]()
    except ValueError as e:
        return str(e)
    return "no ValueError raised"


VALIDATION = [
    ("empty", "sources is empty"),
    ("stacked", "not a stacked tensor"),
    ("rank", "must be [B, T, D]"),
    ("shape", "sources[1] has shape (2, 4, 40)"),
    ("heads", "D=40 is not divisible by heads=3"),
    ("query", "query must have shape (40,)"),
    ("key_gain", "key_gain must have shape (40,)"),
    ("keys_count", "2 keys for 3 sources"),
    ("keys_shape", "keys[0] has shape (2, 2, 40)"),
    ("residual", "residual has shape (2, 3, 41)"),
    ("mixed_dtype", "sources[1] has dtype torch.float16"),
    ("float64", "use impl='reference'"),
    ("mixed_device", "sources[1] is on meta"),
    ("query_device", "query is on meta"),
    ("query_v", "query_v must have shape (40,)"),
]


@pytest.mark.parametrize("label, expected", VALIDATION, ids=[v[0] for v in VALIDATION])
def test_triton_rejects_bad_arguments(label, expected, interpreter):
    assert expected in interpreter.submit(_validation_message, label).result()


def _compiled_vs_eager() -> float:
    from reslab.kernels.depth_read.triton import depth_read2_triton, depth_read_triton

    gen = torch.Generator().manual_seed(1)
    B, T, D, H, N = 2, 5, 40, 2, 3
    leaves = [torch.randn(B, T, D, generator=gen) for _ in range(2 * N + 1)]
    leaves += [0.3 * torch.randn(D, generator=gen) for _ in range(4)]

    def step(*xs):
        src, keys, res, (q, g, qv, gv) = list(xs[:N]), list(xs[N : 2 * N]), xs[2 * N], xs[2 * N + 1 :]
        out, w = depth_read_triton(src, q, g, heads=H, keys=keys, residual=res)
        o1, o2, w1, w2 = depth_read2_triton(src, q, g, qv, gv, heads=H)
        return (out * o1).sum() + (o2.sin() * res).sum() + (w * w2).sum() + w1.square().sum()

    results = []
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        xs = [t.clone().requires_grad_() for t in leaves]
        loss = fn(*xs)
        results.append([loss.detach(), *torch.autograd.grad(loss, xs)])
    return max((a - b).abs().max().item() for a, b in zip(*results, strict=True))


def test_triton_compiles_without_graph_break(interpreter):
    # fullgraph=True raises on a graph break; aot_eager traces the fake and autograd registrations
    assert interpreter.submit(_compiled_vs_eager).result() <= 1e-6


def _opcheck_results() -> dict[str, str]:
    import reslab.kernels.depth_read.triton  # noqa: F401  (registers the reslab ops)

    gen = torch.Generator().manual_seed(2)
    B, T, D, H, N = 2, 3, 24, 2, 2

    def t(*shape):
        return torch.randn(*shape, generator=gen).requires_grad_()

    src, keys = [t(B, T, D) for _ in range(N)], [t(B, T, D) for _ in range(N)]
    fwd_args = (src, keys, t(2, D), t(2, D), t(B, T, D), H, 1e-6)
    out, weights, inv_rms = torch.ops.reslab.depth_read_fwd(*fwd_args)
    bwd_args = (torch.randn(2, B, T, D, generator=gen), torch.randn(2, N, B, T, H, generator=gen),
                [s.detach() for s in src], [k.detach() for k in keys], fwd_args[2].detach(), fwd_args[3].detach(),
                weights.detach(), inv_rms, H)
    results = {}
    for name, op, args in (("fwd", torch.ops.reslab.depth_read_fwd.default, fwd_args),
                           ("bwd", torch.ops.reslab.depth_read_bwd.default, bwd_args)):
        for test, status in torch.library.opcheck(op, args).items():
            results[f"{name}.{test}"] = status
    return results


def test_custom_ops_pass_opcheck(interpreter):
    results = interpreter.submit(_opcheck_results).result()
    assert len(results) == 8 and all(v == "SUCCESS" for v in results.values()), results


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="this process already runs the interpreter")
def test_triton_on_cpu_without_interpreter_is_an_error(triton):
    from reslab.kernels.depth_read.triton import depth_read_triton

    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        depth_read_triton([torch.randn(1, 2, 8)], torch.zeros(8), torch.ones(8))


def test_reference_gradcheck_float64():
    gen = torch.Generator().manual_seed(3)
    N, B, T, D, H = 3, 2, 3, 8, 2

    def t(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).requires_grad_()

    values, keys, residual = t(N, B, T, D), t(N, B, T, D), t(B, T, D)
    query, gain, query_v, gain_v = t(D, scale=0.5), t(D), t(D, scale=0.5), t(D)

    def one(v, k, q, g, r):
        return depth_read_reference(v, q, g, heads=H, keys=k, residual=r)

    def two(v, q, g, qv, gv):
        return depth_read2_reference(v, q, g, qv, gv, heads=H)

    assert torch.autograd.gradcheck(one, (values, keys, query, gain, residual))
    assert torch.autograd.gradcheck(lambda v, q, g: depth_read_reference(v, q, g, heads=1), (values, query, gain))
    assert torch.autograd.gradcheck(two, (values, query, gain, query_v, gain_v))


def test_reference_tied_routes_equal_one_route():
    gen = torch.Generator().manual_seed(4)
    values = torch.randn(4, 2, 3, 12, generator=gen, dtype=torch.float64)
    query = torch.randn(12, generator=gen, dtype=torch.float64)
    gain = torch.rand(12, generator=gen, dtype=torch.float64)
    out, out_v, w, w_v = depth_read2_reference(values, query, gain, query, gain, heads=3)
    ref, ref_w = depth_read_reference(values, query, gain, heads=3)
    assert torch.equal(out, ref) and torch.equal(out_v, ref) and torch.equal(w, ref_w) and torch.equal(w_v, ref_w)


def _gpu_ready() -> bool:
    return torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


@pytest.fixture
def _no_tf32():
    # the reference's float32 matmuls must not run in TF32 when they set err_torch
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ready(), reason="needs CUDA and compiled (not interpreted) Triton")
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_triton_bf16_within_twice_torch_error_gpu(case, _no_tf32, triton):
    _assert_within(_kernel_errors(case, "bfloat16", "cuda"), torch.bfloat16, case)


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ready(), reason="needs CUDA and compiled (not interpreted) Triton")
def test_triton_is_deterministic_gpu(triton):
    case = GPU_CASES[-2]
    inp = _inputs(case)
    first = _run(case, inp, torch.bfloat16, "cuda", "triton")
    second = _run(case, inp, torch.bfloat16, "cuda", "triton")
    assert all(torch.equal(first[name], second[name]) for name in first)
