"""The variant contract as checks anyone can run (`reslab check VARIANT[:IMPL]`, issue 53).

Every check builds the variant at a small size (`SMALL`: 4 layers of width 32, 64 tokens of vocabulary) from
a fixed seed, on the reference implementation or the one named (`impl`: "triton", or whatever a
`ResidualPathway` accepts as its `impl`), and returns one `Check`: pass, fail or skip, the worst error
measured, the tolerance it was held to and one line that says what differs. The same checks hold in-tree,
external (`residual.name: "pkg.module:Class"`, the `reslab.variants` entry points) and third-party
implementations alike, and `models.impl_check` runs them before `impl: auto` uses a kernel.

- identity: each `Identity` the variant declares holds at init (float64, the shipped RMSNorm eps): logits,
  loss and backbone gradients equal the other variant's to `IDENTITY_RTOL`;
- gradcheck: `torch.autograd.gradcheck` (float64, fast mode) of the loss with respect to the embedding
  and the pathway's parameters, moved off their init, on one row of 4 tokens;
- float64 / float32 / bfloat16: the implementation's logits, loss and every gradient against the reference
  implementation's in that dtype, relative to the reference's largest entry (`DTYPE_RTOL`); in bfloat16 both
  against the float64 reference, the implementation's error at most twice the reference's own plus 0.01
  (`BF16_FACTOR`, `BF16_FLOOR`); on a difference the first sublayer whose input differs is named;
- decode: prefill plus one-token decode steps (`models.decoding`) equal the full forward at every position;
  a step that equals a neighbouring position instead is called one position off;
- decode bytes: `Decoder.decode_state_bytes` (the variant's declaration) equals the measured state and carry;
- stage bytes: before every layer boundary, `stage_send` of the real state holds the bytes
  `stage_state_elems` declares;
- seed: the same seed gives the same weights, the same loss and the same weights after one SGD step;
- checkpoint: a state_dict saved and loaded (`weights_only=True`) into a model of another seed gives the
  same logits;
- from prenorm: where the variant declares an identity with prenorm, a trained prenorm's weights loaded
  into the variant (only the pathway's own parameters missing) compute prenorm's logits.

The float64 checks run in float32 at `DTYPE_RTOL["float32"]` for an implementation that refuses float64
(the Triton kernels), and say so; gradcheck is then skipped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.autograd.gradcheck import GradcheckError

from reslab.common.errors import ConfigError
from reslab.models.backbone import Decoder, build_model
from reslab.models.config import ModelConfig, ResidualConfig
from reslab.models.residual import control as control_variant
from reslab.models.residual import get_variant
from reslab.models.residual.base import Identity

# four layers: every in-tree knob default fits (delta_block's num_blocks=4 needs L >= 4)
SMALL: dict[str, Any] = dict(preset="tiny", d_model=32, n_layers=4, n_heads=2, ffn_hidden=64, seq_len=16)
VOCAB = 64
# the token batch [B, T + 1] of the forward-and-backward checks (identity, the dtypes, seed, checkpoint, from prenorm)
BATCH: tuple[int, int] = (2, 13)
# float64 makes a declared identity exact to rounding (~1e-15 here); issue 20's bar was 1e-6
IDENTITY_RTOL = 1e-12
# implementation against the reference, relative to the reference's largest entry; bfloat16 keeps 8 bits
DTYPE_RTOL = {"float64": 1e-10, "float32": 1e-4, "bfloat16": 6e-2}
# bfloat16 is held to the float64 reference: at most this many times the reference's own bfloat16 error, plus
BF16_FACTOR, BF16_FLOOR = 2.0, 1e-2
DECODE_RTOL = {"float64": 1e-9, "float32": 1e-4}
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
CHECKS = ("identity", "gradcheck", "float64", "float32", "bfloat16", "decode", "decode bytes", "stage bytes",
          "seed", "checkpoint", "from prenorm")


@dataclass(frozen=True)
class Check:
    """One check's verdict: `passed` None is a skip (why in `detail`)."""

    name: str
    passed: bool | None
    detail: str
    worst: float | None = None       # the largest error measured (relative unless `detail` says otherwise)
    tolerance: float | None = None

    @property
    def status(self) -> str:
        return "skip" if self.passed is None else "pass" if self.passed else "FAIL"


@dataclass
class Report:
    variant: str
    impl: str
    device: str
    options: dict[str, Any] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c.passed is not False for c in self.checks)

    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.passed is False]

    def to_dict(self) -> dict[str, Any]:
        def finite(x: float | None) -> float | str | None:  # JSON has no inf or nan
            return x if x is None or math.isfinite(x) else str(x)

        checks = [{**dataclasses.asdict(c), "worst": finite(c.worst), "status": c.status} for c in self.checks]
        return {"variant": self.variant, "impl": self.impl, "device": self.device, "options": self.options,
                "passed": self.passed, "checks": checks}


@dataclass(frozen=True)
class Case:
    """What the checks build: the variant `name` with `options`, implementation `impl`, on `device`;
    `precise` the dtype its exact checks run in (float64, or float32 where the implementation refuses it);
    `layers` a depth for knobs that need more than SMALL's (a block size of 6 layers)."""

    name: str
    options: dict[str, Any]
    impl: str = "reference"
    device: str = "cpu"
    precise: str = "float64"
    layers: int | None = None  # the depth of every model built (None: SMALL's, 3 for decoding)


def implementations() -> list[str]:
    """The implementations a run config may name (`residual.impl`), "auto" aside: what `reslab check` holds every
    variant to on the devices where each runs."""
    import typing

    return [i for i in typing.get_args(typing.get_type_hints(ResidualConfig)["impl"]) if i != "auto"]


def parse_target(text: str) -> tuple[str, str]:
    """`VARIANT[:IMPL]` -> (variant, impl). A variant may itself be a path, `pkg.module:Class`: the last
    `:part` is the implementation only when what precedes it is a variant on its own (a registered name or a
    path with its own colon)."""
    text = text.strip()
    if not text or text.startswith(":") or text.endswith(":"):
        raise ConfigError(f"check: {text!r} is not VARIANT[:IMPL]; e.g. attnres, attnres:triton, "
                          "my_pkg.my_module:MyPathway")
    head, sep, tail = text.rpartition(":")
    if not sep:
        return text, "reference"
    if ":" in head or _is_registered(head):
        return head, tail
    return text, "reference"


def _is_registered(name: str) -> bool:
    try:
        get_variant(name)
    except ConfigError:
        return False
    return True


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype if dtype in (torch.float32, torch.float64) else old)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build(case: Case, dtype: torch.dtype = torch.float32, *, seed: int = 0, name: str | None = None,
          options: dict[str, Any] | None = None, impl: str | None = None, **model: Any) -> Decoder:
    """The SMALL model (fields overridden by `model`) of `case`'s variant (or `name` with `options`), built
    from `seed` in `dtype` (float32 or float64 as the default dtype while it is built) on `case.device`."""
    cfg = ResidualConfig(name=name or case.name, options=case.options if options is None else options)
    if case.layers is not None:
        model = {**model, "n_layers": case.layers}
    with torch.random.fork_rng(devices=[]), default_dtype(dtype):
        torch.manual_seed(seed)
        out = build_model(ModelConfig(**{**SMALL, **model}), cfg, vocab_size=VOCAB,
                          impl=case.impl if impl is None else impl)
    return out.to(device=case.device, dtype=dtype)


def perturb(model: torch.nn.Module, scale: float, prefix: str = "pathway.") -> None:
    """Add seeded N(0, scale^2) noise to every parameter under `prefix` (off its init: an identity at init
    cannot make a comparison vacuous)."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(prefix):
                p.add_((torch.randn(p.shape, generator=gen, dtype=torch.float64) * scale).to(p))


def tokens(b: int, t: int, seed: int = 1, device: str = "cpu") -> Tensor:
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed)).to(device)


def rel(a: Tensor, b: Tensor, floor: float = 0.0) -> float:
    """max |a - b| over max |b| (or `floor`, if larger; in float64); 0 when both are zero."""
    a64, b64 = a.detach().double(), b.detach().double()
    scale = max(b64.abs().max().item(), floor)
    diff = (a64 - b64).abs().max().item()
    return diff / scale if scale > 0 else diff


def objective(out: Any) -> Tensor:
    return out.loss if out.aux_loss is None else out.loss + out.aux_loss


def init_differences(model: Decoder, other: Decoder, idx: Tensor) -> dict[str, float]:
    """Relative differences of one training step's forward and backward: the logits, the loss, and the worst
    backbone parameter's gradient (the pathways' own parameters are not compared)."""
    out, ref = model(idx[:, :-1], idx[:, 1:]), other(idx[:, :-1], idx[:, 1:])
    out.loss.backward()
    ref.loss.backward()
    diffs = {"logits": rel(out.logits, ref.logits),
             "loss": abs(out.loss.item() - ref.loss.item()) / abs(ref.loss.item()), "gradients": 0.0}
    ref_params = dict(other.named_parameters())
    for key, param in model.named_parameters():
        if key.startswith("pathway.") or key not in ref_params:
            continue
        grad, ref_grad = param.grad, ref_params[key].grad
        if grad is None or ref_grad is None or not ref_grad.abs().max() > 0:
            diffs["gradients"] = math.inf  # a backbone parameter without a gradient: nothing is compared there
            continue
        diffs["gradients"] = max(diffs["gradients"], rel(grad, ref_grad))
    return diffs


def _worst(diffs: dict[str, float]) -> tuple[str, float]:
    key = max(diffs, key=lambda k: diffs[k])
    return key, diffs[key]


def declared_identities(cls: type) -> tuple[Identity, ...]:
    return tuple(getattr(cls, "identities", ()))


# --- the checks ------------------------------------------------------------------------------------
def check_identity(case: Case) -> Check:
    identities = declared_identities(get_variant(case.name))
    if not identities:
        return Check("identity", None, f"{case.name} declares no identity at init")
    dtype = DTYPES[case.precise]
    tol = IDENTITY_RTOL if case.precise == "float64" else DTYPE_RTOL[case.precise]
    worst, lines = 0.0, []
    for identity in identities:
        model = build(case, dtype, options=identity.options)
        other = build(case, dtype, name=identity.equals, options=identity.equals_options, impl="reference")
        with default_dtype(dtype):
            key, err = _worst(init_differences(model, other, tokens(*BATCH, device=case.device)))
        worst = max(worst, err)
        if err > tol:
            lines.append(f"{_claim(case.name, identity)}: {key} differ by {err:.3g}")
    detail = "; ".join(lines) if lines else f"{len(identities)} declared: " + "; ".join(
        _claim(case.name, i) for i in identities)
    return Check("identity", not lines, f"{detail} ({case.precise}, tolerance {tol:g})", worst, tol)


def _claim(name: str, identity: Identity) -> str:
    knobs = ", ".join(f"{k}={v}" for k, v in identity.options.items())
    return f"{name}{f' ({knobs})' if knobs else ''} at init = {identity.equals}"


def check_gradcheck(case: Case) -> Check:
    if case.precise != "float64":
        return Check("gradcheck", None, f"impl {case.impl} does not run float64")
    model = build(case, torch.float64, n_layers=SMALL["n_layers"], d_model=16, ffn_hidden=16, seq_len=8)
    perturb(model, 0.3)
    names = ["embed.weight"] + [n for n, _ in model.named_parameters() if n.startswith("pathway.")]
    params = dict(model.named_parameters())
    idx = tokens(1, 5, device=case.device)

    # a fixed random projection of the float64 logits (the loss is computed in float32), plus the aux term
    weights = torch.randn(1, 5, VOCAB, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

    def loss(*values: Tensor) -> Tensor:
        out = torch.func.functional_call(model, {**params, **dict(zip(names, values, strict=True))}, (idx,))
        total = (out.logits * weights.to(out.logits.device)).sum()
        return total if out.aux_loss is None else total + out.aux_loss

    inputs = tuple(params[n].detach().clone().requires_grad_(True) for n in names)
    try:
        with default_dtype(torch.float64):
            torch.autograd.gradcheck(loss, inputs, eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)
    except GradcheckError as exc:
        first = str(exc).strip().splitlines()[0]
        return Check("gradcheck", False, f"the analytical gradient differs from the numerical one: {first}")
    return Check("gradcheck", True, f"float64, fast mode, {len(names)} tensors (embedding and pathway), "
                 "eps 1e-6, atol 1e-7, rtol 1e-5")


def _site_inputs(model: Decoder, idx: Tensor) -> tuple[Any, list[Tensor]]:
    """One forward and backward of `idx`: the output, and what each sublayer's pre-norm got first."""
    seen: list[Tensor | None] = [None] * len(model.norms)
    hooks = []
    for site, norm in enumerate(model.norms):
        def grab(_module: Any, args: tuple[Tensor, ...], site: int = site) -> None:
            if seen[site] is None:
                seen[site] = args[0].detach()
        hooks.append(norm.register_forward_pre_hook(grab))
    try:
        out = model(idx[:, :-1], idx[:, 1:])
        objective(out).backward()
    finally:
        for h in hooks:
            h.remove()
    return out, [s for s in seen if s is not None]


def _quantities(model: Decoder, idx: Tensor) -> tuple[dict[str, Tensor | None], list[Tensor]]:
    """The logits, loss and every parameter's gradient of one forward and backward, and the sublayer inputs."""
    out, sites = _site_inputs(model, idx)
    found: dict[str, Tensor | None] = {"logits": out.logits, "loss": out.loss}
    found.update({f"gradient of {n}": p.grad for n, p in model.named_parameters()})
    return found, sites


def _errors(got: dict[str, Tensor | None], ref: dict[str, Tensor | None], floor: float = 0.0) -> dict[str, float]:
    """`rel` of each quantity, a gradient's relative to at least `floor` times the largest gradient entry of
    `ref`; infinite where one side has a gradient and the other none."""
    grads = [r.detach().abs().max().item() for k, r in ref.items() if r is not None and k.startswith("gradient")]
    scale = floor * max(grads, default=0.0)
    out = {}
    for key, r in ref.items():
        g = got.get(key)
        if (g is None) != (r is None):
            out[key] = math.inf
        elif g is not None and r is not None:
            out[key] = rel(g, r, scale if key.startswith("gradient") else 0.0)
    return out


def check_against_reference(case: Case, dtype_name: str) -> Check:
    """The implementation's forward and backward against the reference implementation's in `dtype_name`:
    float64 and float32 directly (`DTYPE_RTOL`); bfloat16 through the float64 reference, where the
    implementation's error may be at most `BF16_FACTOR` times the reference's own bfloat16 error plus
    `BF16_FLOOR` (two bfloat16 roundings of one sum differ by more than any fixed bound of their difference)."""
    if case.impl == "reference":
        return Check(dtype_name, None, "impl reference is the reference")
    if dtype_name == "float64" and case.precise != "float64":
        return Check(dtype_name, None, f"impl {case.impl} does not run float64 (its exact checks run in float32)")
    dtype, idx = DTYPES[dtype_name], tokens(*BATCH, device=case.device)
    ref_model = build(case, dtype, impl="reference")
    perturb(ref_model, 0.3)
    ref, ref_sites = _quantities(ref_model, idx)
    try:
        model = build(case, dtype)
        perturb(model, 0.3)
        got, sites = _quantities(model, idx)
    except Exception as exc:  # an implementation's refusal or crash is this check's verdict
        if dtype_name in str(exc):
            return Check(dtype_name, None, f"impl {case.impl} refuses {dtype_name}: {_line(exc)}")
        return Check(dtype_name, False, f"impl {case.impl} raised {_line(exc)}")
    tol = DTYPE_RTOL[dtype_name]
    where = next((f"; the first sublayer input that differs is site {s}" for s, (a, b) in
                  enumerate(zip(sites, ref_sites, strict=False)) if rel(a, b) > tol), "")
    if dtype_name != "bfloat16":
        key, worst = _worst(_errors(got, ref))
        if worst <= tol:
            return Check(dtype_name, True, f"logits, loss and {len(got) - 2} gradients (tolerance {tol:g})", worst, tol)
        return Check(dtype_name, False, f"{key} differs from the reference by {worst:.3g} (tolerance {tol:g}){where}",
                     worst, tol)
    # built in float32 as the bfloat16 models were (a float64 build draws other numbers from the same seed)
    exact = build(case, torch.float32, impl="reference").to(torch.float64)
    perturb(exact, 0.3)
    with default_dtype(torch.float64):
        truth, _ = _quantities(exact, idx)
    # a gradient near zero (a read of one source) is all rounding in bfloat16: errors relative to at least
    # 1% of the largest gradient entry
    mine, theirs = _errors(got, truth, 1e-2), _errors(ref, truth, 1e-2)
    excess = {k: mine[k] - (BF16_FACTOR * theirs.get(k, 0.0) + BF16_FLOOR) for k in mine}
    key = max(excess, key=lambda k: excess[k])
    bound = f"tolerance {BF16_FACTOR:g}x the reference's bfloat16 error + {BF16_FLOOR:g}"
    line = f"{key}: {mine[key]:.3g} from float64, the reference in bfloat16 {theirs.get(key, 0.0):.3g} ({bound})"
    if excess[key] <= 0:
        return Check(dtype_name, True, f"logits, loss and {len(got) - 2} gradients; worst {line}", max(mine.values()),
                     BF16_FLOOR)
    return Check(dtype_name, False, f"{key} differs from the reference by {mine[key]:.3g} from float64 against "
                 f"{theirs.get(key, 0.0):.3g} ({bound}){where}", mine[key], BF16_FLOOR)


def _line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def incremental(model: Decoder, idx: Tensor, prompt_len: int) -> Tensor:
    """Prefill idx[:, :prompt_len], then feed the rest one token at a time: logits [B, T, V]."""
    logits, state = model.prefill(idx[:, :prompt_len])
    steps = [model.decode_step(idx[:, t], state).unsqueeze(1) for t in range(prompt_len, idx.shape[1])]
    return torch.cat([logits, *steps], 1)


def check_decode(case: Case) -> Check:
    dtype, tol = DTYPES[case.precise], DECODE_RTOL[case.precise]
    model = build(case, dtype, n_layers=3).eval()
    perturb(model, 0.3)
    idx = tokens(2, 9, seed=2, device=case.device)
    worst = 0.0
    with default_dtype(dtype), torch.no_grad():
        full = model(idx).logits
        for prompt_len in (1, 4):
            got = incremental(model, idx, prompt_len)
            errs = [rel(got[:, t], full[:, t]) for t in range(idx.shape[1])]
            worst = max(worst, *errs)
            bad = next((t for t, e in enumerate(errs) if e > tol), None)
            if bad is not None:
                return Check("decode", False, _decode_miss(prompt_len, bad, errs[bad], tol, got, full), worst, tol)
    return Check("decode", True, f"prefill of 1 and of 4 tokens, then one token a step, at 9 positions "
                 f"({case.precise}, tolerance {tol:g})", worst, tol)


def _decode_miss(prompt_len: int, t: int, err: float, tol: float, got: Tensor, full: Tensor) -> str:
    where = "the prefill" if t < prompt_len else "the decode step"
    line = (f"prefill of {prompt_len}: position {t} ({where}) differs from the full forward by {err:.3g} "
            f"(tolerance {tol:g})")
    near = [s for s in (t - 1, t + 1) if 0 <= s < full.shape[1] and rel(got[:, t], full[:, s]) <= tol]
    if near:
        line += f"; it equals the full forward's position {near[0]}: one position off"
    return line


def check_decode_bytes(case: Case) -> Check:
    model = build(case, DTYPES[case.precise], n_layers=3).eval()
    with default_dtype(DTYPES[case.precise]):
        declared, measured = model.decode_state_bytes(), model.measure_decode_state_bytes()
    parts = [(k, getattr(declared, k), getattr(measured, k)) for k in ("pathway", "carry", "kv")]
    wrong = [f"{k}: declared {d} B, measured {m} B" for k, d, m in parts if d != m]
    if wrong:
        return Check("decode bytes", False, "; ".join(wrong))
    return Check("decode bytes", True, "per token in flight: " + ", ".join(f"{k} {d} B" for k, d, _ in parts))


def check_stage_bytes(case: Case) -> Check:
    model = build(case, DTYPES[case.precise])
    pathway = model.pathway
    errors = type(pathway).stage_errors(pathway.config, model.shape, case.impl)
    if errors:
        return Check("stage bytes", None, "the state cannot cross a stage boundary: " + "; ".join(errors))
    b, t = 2, 8
    idx = tokens(b, t, device=case.device)
    p, size, wrong, seen = model.pathway, model.embed.weight.element_size(), [], []
    with torch.no_grad(), default_dtype(DTYPES[case.precise]):
        positions = torch.arange(t, device=idx.device).expand(b, -1)
        state = p.resume(p.start(model.embed(idx)), None, positions)
        for site in range(model.shape.n_sites):
            if site and site % 2 == 0:
                sent = sum(x.numel() * x.element_size() for x in p.stage_send(state, site))
                per_token, per_batch = p.stage_state_elems(site)
                declared = (per_token * b * t + per_batch) * size
                seen.append(f"site {site} {sent} B")
                if sent != declared:
                    wrong.append(f"before site {site}: declared {declared} B, sent {sent} B")
            state = model.run_sites(state, range(site, site + 1))
    if wrong:
        return Check("stage bytes", False, "; ".join(wrong))
    return Check("stage bytes", True, f"batch {b}x{t}: " + ", ".join(seen))


def check_seed(case: Case) -> Check:
    dtype = DTYPES[case.precise]
    runs = []
    for _ in range(2):
        model = build(case, dtype, seed=3)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        idx = tokens(*BATCH, device=case.device)
        with default_dtype(dtype):
            out = model(idx[:, :-1], idx[:, 1:])
            objective(out).backward()
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p.sub_(0.1 * p.grad)
        runs.append((before, out.loss.item(), model.state_dict()))
    (w0, loss0, after0), (w1, loss1, after1) = runs
    differ = [k for k in w0 if not torch.equal(w0[k], w1[k])]
    if differ:
        return Check("seed", False, f"the same seed gave different initial weights: {', '.join(differ[:5])}")
    if loss0 != loss1:
        return Check("seed", False, f"the same seed and batch gave losses {loss0!r} and {loss1!r}")
    moved = [k for k in after0 if not torch.equal(after0[k], after1[k])]
    if moved:
        return Check("seed", False, f"one SGD step from the same weights differs in {', '.join(moved[:5])}")
    return Check("seed", True, f"weights, loss and weights after one SGD step equal bit for bit ({len(w0)} tensors)")


def check_checkpoint(case: Case) -> Check:
    dtype = DTYPES[case.precise]
    model = build(case, dtype)
    perturb(model, 0.3)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    other = build(case, dtype, seed=11)
    try:
        other.load_state_dict(torch.load(buffer, map_location=case.device, weights_only=True))
    except RuntimeError as exc:
        return Check("checkpoint", False, f"a saved state_dict does not load into the same variant: {_line(exc)}")
    idx = tokens(*BATCH, device=case.device)
    with torch.no_grad(), default_dtype(dtype):
        err = rel(other(idx).logits, model(idx).logits)
    if err != 0:
        return Check("checkpoint", False, f"the loaded model's logits differ by {err:.3g}", err, 0.0)
    return Check("checkpoint", True, "state_dict saved, loaded with weights_only=True into another seed's model: "
                 "the same logits bit for bit", 0.0, 0.0)


def check_from_prenorm(case: Case) -> Check:
    control = control_variant()
    claims = [i for i in declared_identities(get_variant(case.name)) if i.equals == control and not i.equals_options]
    if not claims:
        return Check("from prenorm", None, f"{case.name} declares no identity with {control}")
    dtype = DTYPES[case.precise]
    tol = IDENTITY_RTOL if case.precise == "float64" else DTYPE_RTOL[case.precise]
    trained = build(case, dtype, name=control, options={}, impl="reference")
    perturb(trained, 0.02, prefix="")  # the backbone moved off its init, as training leaves it
    idx = tokens(*BATCH, device=case.device)
    worst, lines = 0.0, []
    for identity in claims:
        model = build(case, dtype, seed=5, options=identity.options)
        missing, unexpected = model.load_state_dict(trained.state_dict(), strict=False)
        foreign = [k for k in missing if not k.startswith("pathway.")] + list(unexpected)
        if foreign:
            return Check("from prenorm", False, f"prenorm's weights do not fit the backbone: {', '.join(foreign[:5])}")
        with torch.no_grad(), default_dtype(dtype):
            err = rel(model(idx).logits, trained(idx).logits)
        worst = max(worst, err)
        if err > tol:
            lines.append(f"{_claim(case.name, identity)}: from trained prenorm weights the logits differ by {err:.3g}")
    detail = "; ".join(lines) or f"{len(claims)} declared, from trained prenorm weights"
    return Check("from prenorm", not lines, f"{detail} ({case.precise}, tolerance {tol:g})", worst, tol)


RUNNERS: dict[str, Callable[[Case], Check]] = {
    "identity": check_identity, "gradcheck": check_gradcheck,
    "float64": lambda c: check_against_reference(c, "float64"),
    "float32": lambda c: check_against_reference(c, "float32"),
    "bfloat16": lambda c: check_against_reference(c, "bfloat16"),
    "decode": check_decode, "decode bytes": check_decode_bytes, "stage bytes": check_stage_bytes,
    "seed": check_seed, "checkpoint": check_checkpoint, "from prenorm": check_from_prenorm,
}


def precise_dtype(case: Case) -> str:
    """"float64" when the implementation runs a float64 forward, else "float32" (the field's libraries compute
    in float32 whatever the dtype they are given: `kernels/field`)."""
    from reslab.kernels.field import FIELD_IMPLS

    if case.impl == "reference":
        return "float64"
    if case.impl in FIELD_IMPLS:
        return "float32"
    try:
        with torch.no_grad(), default_dtype(torch.float64):
            build(case, torch.float64)(tokens(1, 4, device=case.device))
    except Exception as exc:  # a refusal of float64 (the Triton kernels) means: check in float32
        if "float64" in str(exc):
            return "float32"
        raise
    return "float64"


def run_checks(variant: str, impl: str = "reference", options: dict[str, Any] | None = None, device: str = "cpu",
               only: Sequence[str] | None = None, layers: int | None = None) -> Report:
    """Every check of `only` (default: all of `CHECKS`) of `variant` with `options` and implementation `impl`
    on `device`, its models `layers` deep (default: `SMALL`'s). Raises `ConfigError` for an unknown variant,
    knob or check, or knobs that do not fit the model; a check that raises fails, and one whose own knobs (an
    identity's) the implementation refuses is skipped with the refusal as its reason."""
    from reslab.models.presets import resolve_model
    from reslab.models.residual import check_pathway_shape, resolve_residual

    resolved = resolve_residual(ResidualConfig(name=variant, options=dict(options or {})), "check")
    unknown = [c for c in (only or ()) if c not in RUNNERS]
    if unknown:
        raise ConfigError(f"check: unknown check {', '.join(map(repr, unknown))}; allowed: {', '.join(CHECKS)}")
    case = Case(variant, dict(options or {}), impl, device, layers=layers)
    report = Report(variant, impl, device, resolved.options)
    depth = {} if layers is None else {"n_layers": layers}
    shape = resolve_model(ModelConfig(**{**SMALL, **depth}), vocab_size=VOCAB)
    try:
        check_pathway_shape(resolved, shape, "check")
    except ConfigError as exc:
        raise ConfigError(f"{exc} (at {shape.n_layers} layers: --layers N checks a deeper model)") from None
    try:
        case = dataclasses.replace(case, precise=precise_dtype(case))
    except Exception as exc:  # an implementation that cannot even run a forward fails every check
        report.checks = [Check(name, False, f"impl {impl} raised {_line(exc)}") for name in only or CHECKS]
        return report
    for name in only or CHECKS:
        try:
            report.checks.append(RUNNERS[name](case))
        except ConfigError as exc:  # the check's own knobs (an identity's), refused by this implementation
            report.checks.append(Check(name, None, f"n/a: {_line(exc)}"))
        except Exception as exc:  # a crash in a check is that check's failure, with the exception's line
            report.checks.append(Check(name, False, f"raised {_line(exc)}"))
    return report
