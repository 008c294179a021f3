"""The field's kernels as implementations (`residual.impl: fla | liger | flash_attn_res`, kernels/field).

Each adapter is held to reslab's reference (kernels/depth_read/reference.py, itself gradchecked in
test_kernels_depth_read.py) in float64: the read's output and the gradients of every source, the query and
the key gain, then a whole model's loss, logits and every parameter gradient for Full and Block AttnRes.
Tolerance: err <= 2 err_torch + atol max(1, |ref|), err_torch the reference's own error in the dtype (as
the depth-history tests); fla and liger compute in float32 whatever the dtype, so their float64 runs are
held to float32's atol (1e-5), and flash-attn-res writes its reads in bfloat16 (atol 2e-2).

On the CPU: liger's Triton kernels run in Triton's interpreter in a spawned worker (the interpreter must be
chosen before triton is imported); fla's fused kernel refuses CPU tensors, so the adapter runs fla's own
PyTorch reference `naive_attnres` there (the fused kernel is checked by the gpu-marked test);
flash-attn-res 0.1.12 does not import with the triton installed here, so its adapter is checked against the
library's own PyTorch phase functions (`phase_1_fn`, `phase_2_fn` in flash_attn_res/experimental/torch.py,
a file with no imports of its own: the functions are taken from its source and run un-compiled).
Each test skips with a reason when its library is absent.
"""

import ast
import importlib.metadata
import importlib.util
import math
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs the triton package")

DISTS = {"fla": "fla-core", "liger": "liger-kernel", "flash_attn_res": "flash-attn-res"}
# the atol each implementation is held to in float64 and float32 (see the module docstring)
ATOL = {"fla": 1e-5, "liger": 1e-5, "flash_attn_res": 2e-2}
MODELS = [("attnres", {}), ("block_attnres", {"block_size": 3})]


def _installed(impl: str) -> bool:
    try:
        importlib.metadata.version(DISTS[impl])
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def needs(impl: str):
    return pytest.mark.skipif(not _installed(impl), reason=f"needs {DISTS[impl]} (pip install 'reslab[kernels]')")


def _worker_init() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def interpreter():
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx, initializer=_worker_init) as pool:
        yield pool


def _inputs(dtype: torch.dtype, n: int = 5, d: int = 32) -> list[torch.Tensor]:
    """Sources [B, T, D] of different scales, a query, a key gain and an upstream gradient, as leaves."""
    g = torch.Generator().manual_seed(7)
    sources = [torch.randn(2, 5, d, generator=g) * (0.5 + k) for k in range(n)]
    query = torch.randn(d, generator=g) * 0.5
    gain = 1 + 0.3 * torch.randn(d, generator=g)
    dout = torch.randn(2, 5, d, generator=g)
    return [t.to(dtype).requires_grad_(i < n + 2) for i, t in enumerate([*sources, query, gain, dout])]


def _read(read, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The read's output and the gradient of every input, in float64 for comparison."""
    *sources, query, gain, dout = _inputs(dtype)
    out = read(sources, query, gain)
    (out.to(dtype) * dout).sum().backward()
    grads = {f"d_source[{k}]": s.grad for k, s in enumerate(sources)} | {"d_query": query.grad, "d_gain": gain.grad}
    return {k: v.double() for k, v in ({"out": out} | grads).items()}


def _read_errors(impl: str, dtype_name: str) -> dict[str, tuple[float, float, float]]:
    """name -> (|impl - ref64|, |ref_dtype - ref64|, |ref64|) for the read through `impl`'s adapter."""
    from reslab.kernels.depth_read import depth_read

    dtype = getattr(torch, dtype_name)
    eps = 1e-6

    def through(which):
        return lambda s, q, g: depth_read(s, q, g, eps=eps, impl=which)[0]

    ref = _read(through("reference"), torch.float64)
    lowp = _read(through("reference"), dtype)
    got = _read(through(impl), dtype)
    return {k: ((got[k] - r).abs().max().item(), (lowp[k] - r).abs().max().item(), r.abs().max().item())
            for k, r in ref.items()}


def _assert_within(errors: dict, atol: float) -> None:
    assert {"out", "d_query", "d_gain", "d_source[0]"} <= set(errors)
    bad = [f"{name}: {e:.3e} (reference in this dtype {et:.3e}, |ref| {s:.2e})"
           for name, (e, et, s) in errors.items() if not (math.isfinite(e) and e <= 2 * et + atol * max(1.0, s))]
    assert not bad, "\n".join(bad)


@needs("fla")
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_fla_read_matches_reference(dtype):
    _assert_within(_read_errors("fla", dtype), ATOL["fla"])


@needs("liger")
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_liger_kernel_read_matches_reference_in_the_interpreter(dtype, interpreter):
    _assert_within(interpreter.submit(_read_errors, "liger", dtype).result(), ATOL["liger"])


def _far_torch_phases(eps: float):
    """flash-attn-res's own PyTorch phases (experimental/torch.py), with the kernels' signatures."""
    spec = importlib.util.find_spec("flash_attn_res")  # located, not imported (it may not import here)
    assert spec is not None and spec.submodule_search_locations
    path = os.path.join(spec.submodule_search_locations[0], "experimental", "torch.py")
    with open(path) as f:
        tree = ast.parse(f.read())
    wanted = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in ("phase_1_fn", "phase_2_fn")]
    for node in wanted:
        node.decorator_list = []  # @torch.compile: run eagerly on the CPU
    space: dict = {"torch": torch, "EPS": eps}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), path, "exec"), space)
    assert len(wanted) == 2

    def phase_1(values, queries, eps_):
        lse, normalized, _ = space["phase_1_fn"](queries, values)
        return normalized, lse

    def phase_2(partial, query, prev_out, prev_lse, eps_):
        return space["phase_2_fn"](partial, query, prev_lse, prev_out)

    return phase_1, phase_2


@needs("flash_attn_res")
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_flash_attn_res_adapter_on_the_librarys_torch_phases_matches_reference(dtype):
    from reslab.kernels.depth_read import depth_read
    from reslab.kernels.field.flash_attn_res import depth_read_far

    eps, dt = 1e-6, getattr(torch, dtype)
    ops = _far_torch_phases(eps)
    ref = _read(lambda s, q, g: depth_read(s, q, g, eps=eps)[0], torch.float64)
    lowp = _read(lambda s, q, g: depth_read(s, q, g, eps=eps)[0], dt)
    got = _read(lambda s, q, g: depth_read_far(s, q, g, eps, ops=ops), dt)
    _assert_within({k: ((got[k] - r).abs().max().item(), (lowp[k] - r).abs().max().item(), r.abs().max().item())
                    for k, r in ref.items()}, ATOL["flash_attn_res"])
    # one source: phase 1 alone
    one = depth_read_far(_inputs(dt, n=1)[:1], *_inputs(dt, n=1)[1:3], eps, ops=ops)
    assert (one - _inputs(dt, n=1)[0]).abs().max().item() < 1e-2 * _inputs(dt, n=1)[0].abs().max().item()


def _model_errors(name: str, options: dict, impl: str, dtype_name: str) -> dict[str, tuple[float, float, float]]:
    """name -> (|impl - ref64|, |ref_dtype - ref64|, |ref64|) of a whole model's loss, logits and every
    parameter gradient, random (not zero) pseudo-queries so that the reads weigh their sources unequally."""
    from reslab.models.backbone import build_model
    from reslab.models.config import ModelConfig, ResidualConfig

    shape = ModelConfig(preset="tiny", d_model=32, n_layers=3, n_heads=2, ffn_hidden=40, seq_len=7)
    idx = torch.randint(0, 32, (3, 7), generator=torch.Generator().manual_seed(3))
    results = []
    for impl_, dtype in (("reference", torch.float64), ("reference", getattr(torch, dtype_name)),
                         (impl, getattr(torch, dtype_name))):
        torch.manual_seed(0)
        residual = ResidualConfig(name=name, options={**options, "query_init": "normal", "query_init_std": 0.5})
        model = build_model(shape, residual, vocab_size=32, impl=impl_)
        with torch.no_grad():
            model.pathway.key_gains.mul_(1 + 0.3 * torch.randn(model.pathway.key_gains.shape))
        model = model.to(dtype)
        out = model(idx, idx.roll(-1, 1))
        out.loss.backward()
        results.append({"loss": out.loss.detach().double(), "logits": out.logits.detach().double()} | {
            n: p.grad.double() for n, p in model.named_parameters()})
    ref, lowp, got = results
    return {k: ((got[k] - r).abs().max().item(), (lowp[k] - r).abs().max().item(), r.abs().max().item())
            for k, r in ref.items()}


def _assert_model_within(errors: dict, atol: float) -> None:
    assert "embed.weight" in errors
    bad = [f"{k}: {e:.2e} (reference in this dtype {et:.2e}, |ref| {s:.2e})" for k, (e, et, s) in errors.items()
           if not (math.isfinite(e) and e <= 2 * et + atol * max(1.0, s))]
    assert not bad, "\n".join(bad)


@needs("fla")
@pytest.mark.parametrize("name, options", MODELS, ids=[n for n, _ in MODELS])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_model_on_fla_matches_reference(name, options, dtype):
    errors = _model_errors(name, options, "fla", dtype)
    assert "pathway.queries" in errors
    _assert_model_within(errors, ATOL["fla"])


@needs("liger")
@pytest.mark.parametrize("name, options", MODELS, ids=[n for n, _ in MODELS])
def test_model_on_liger_matches_reference_in_the_interpreter(name, options, interpreter):
    _assert_model_within(interpreter.submit(_model_errors, name, options, "liger", "float32").result(),
                         ATOL["liger"])


def _mhc_errors(dtype_name: str) -> dict[str, tuple[float, float, float]]:
    """As `_model_errors` for mHC on liger's fused mHC: phi N(0, 0.05^2) and gating factors 1 (not the zero
    phi of the init, whose coefficients ignore the input), so H_res is input-dependent and not symmetric."""
    from reslab.models.backbone import build_model
    from reslab.models.config import ModelConfig, ResidualConfig

    shape = ModelConfig(preset="tiny", d_model=32, n_layers=2, n_heads=2, ffn_hidden=40, seq_len=7)
    idx = torch.randint(0, 32, (3, 7), generator=torch.Generator().manual_seed(3))
    results = []
    for impl, dtype in (("reference", torch.float64), ("reference", getattr(torch, dtype_name)),
                        ("liger", getattr(torch, dtype_name))):
        torch.manual_seed(0)
        model = build_model(shape, ResidualConfig(name="mhc", options={"sinkhorn_iters": 5}), vocab_size=32,
                            impl=impl)
        with torch.no_grad():
            for linear in model.pathway.phi:
                linear.weight.normal_(0, 0.05)
            model.pathway.alpha.fill_(1.0)
        model = model.to(dtype)
        out = model(idx, idx.roll(-1, 1))
        out.loss.backward()
        results.append({"loss": out.loss.detach().double(), "logits": out.logits.detach().double()} | {
            n: p.grad.double() for n, p in model.named_parameters()})
    ref, lowp, got = results
    return {k: ((got[k] - r).abs().max().item(), (lowp[k] - r).abs().max().item(), r.abs().max().item())
            for k, r in ref.items()}


@needs("liger")
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_mhc_on_liger_matches_reference_in_the_interpreter(dtype, interpreter):
    errors = interpreter.submit(_mhc_errors, dtype).result()
    assert "pathway.phi.0.weight" in errors and "pathway.alpha" in errors and "pathway.bias" in errors
    _assert_model_within(errors, ATOL["liger"])


def _refusal(name: str, options: dict, impl: str) -> str:
    from reslab.common.errors import ConfigError
    from reslab.models.backbone import build_model
    from reslab.models.config import ModelConfig, ResidualConfig

    shape = ModelConfig(preset="tiny", d_model=32, n_layers=2, n_heads=2, ffn_hidden=40, seq_len=7)
    try:
        build_model(shape, ResidualConfig(name=name, options=options), vocab_size=32, impl=impl)
    except ConfigError as exc:
        return str(exc)
    return ""


@pytest.mark.parametrize("name, options, expected", [
    ("mhar", {"heads": 2}, "residual.impl: fla does not compute mhar's read"),
    ("prenorm", {}, "residual.impl: fla does not compute prenorm's read"),
    ("depth_swa", {}, "residual.impl: fla does not compute depth_swa's read"),
    ("attnres", {"score": "sigmoid"}, "residual.options.score: 'sigmoid' is not supported by residual.impl fla"),
    ("attnres", {"key_norm": False}, "residual.options.key_norm: False is not supported by residual.impl fla"),
    ("mhc", {}, "residual.impl: fla does not compute mhc's read (it maps liger)"),
])
def test_unmappable_variants_and_knobs_are_refused_in_one_line(name, options, expected):
    message = _refusal(name, options, "fla")
    assert message.startswith(expected) and "\n" not in message


def test_mhc_lite_on_liger_is_refused_in_one_line():
    message = _refusal("mhc", {"variant": "lite", "streams": 3}, "liger")
    assert message.startswith("residual.options.variant: 'lite' is not supported by residual.impl liger")


def test_a_library_that_is_not_installed_names_the_extra(monkeypatch):
    from reslab.common.errors import ConfigError
    from reslab.kernels import field

    # a distribution name that exists nowhere stands in for an absent library: the real ones are installed here
    monkeypatch.setitem(field.LIBRARIES, "liger", ("reslab-no-such-distribution", "liger_kernel"))
    with pytest.raises(ConfigError, match=r"needs the reslab-no-such-distribution package, which is not installed; "
                                          r"pip install 'reslab\[kernels\]'"):
        field.library("liger")


def _select(impl: str, device: str) -> str:
    from reslab.common.errors import ConfigError
    from reslab.kernels import select_impl

    try:
        return select_impl(impl, device)
    except ConfigError as exc:
        return "error: " + str(exc)


@needs("liger")
def test_liger_needs_cuda_or_the_interpreter(interpreter):
    assert interpreter.submit(_select, "liger", "cpu").result() == "liger"
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert _select("liger", "cpu").startswith("error: residual.impl: liger runs Triton kernels, which need a CUDA")


@needs("flash_attn_res")
def test_flash_attn_res_that_does_not_import_is_one_line():
    from reslab.kernels.field import library

    try:
        library("flash_attn_res")
    except Exception as exc:  # the failing import, said in one line
        assert str(exc).startswith("residual.impl: flash_attn_res: flash-attn-res") and "\n" not in str(exc)
    else:
        pytest.skip("flash-attn-res imports with this triton: the kernels run in the gpu-marked test")


def _gpu_ready() -> bool:
    return torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ready(), reason="needs CUDA and compiled (not interpreted) Triton")
@pytest.mark.parametrize("impl", ["fla", "liger", "flash_attn_res"])
def test_field_kernels_on_the_gpu_match_reference_gpu(impl):
    from reslab.common.errors import ConfigError
    from reslab.kernels.depth_read import depth_read

    if not _installed(impl):
        pytest.skip(f"needs {DISTS[impl]}")
    eps = 1e-6
    ref = _read(lambda s, q, g: depth_read([x.double() for x in s], q.double(), g.double(), eps=eps)[0].float(),
                torch.float32)
    try:
        got = _read(lambda s, q, g: depth_read([x.cuda() for x in s], q.cuda(), g.cuda(), eps=eps,
                                               impl=impl)[0].cpu(), torch.float32)
    except ConfigError as exc:
        pytest.skip(str(exc))
    bad = [k for k, r in ref.items() if not (got[k] - r).abs().max().item() <= ATOL[impl] * max(1.0, r.abs().max())]
    assert not bad, bad
