"""Fused Triton depth read: the depth history is read through an address table, never stacked.

Design (MHAR, arXiv 2607.27230, appendix; variants.md 2.3), derivation in README.md:

- forward: one program per block of BT token rows loops over the N sources through a table of
  their int64 addresses, fuses the key RMSNorm (fp32, full-width RMS sliced per head), runs an
  online softmax over depth per head and writes out, the weights [N, M, H] and the inverse RMS
  [N, M] of every key row (M = B*T);
- backward: pass 1 accumulates S_h = sum_n w_nh <dout_h, v_nh>, pass 2 re-reads each source,
  forms dlogit = w (<dout_h, v_nh> - S_h) and writes that source's gradient to its own tensor;
  query and gain gradients come from per-program partials summed afterwards (no atomics).

One kernel pair serves both entry points: `depth_read_triton` (one route) and
`depth_read2_triton` (RD-AttnRes, two routes with their own query and gain over the same sources,
read once). The ops are `torch.library` custom ops, so `torch.compile` traces through them.
"""

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from reslab.kernels.triton_common import AUTOTUNE_CONFIGS, block_shape, require_launchable, row_layout

__all__ = ["depth_read_triton", "depth_read2_triton"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
@triton.jit
def _table_ptr(p_tab, i_n, p_like, ALIGNED: tl.constexpr):
    """The i_n-th address of a pointer table, typed like `p_like`."""
    p = tl.load(p_tab + i_n).to(p_like.dtype)
    if ALIGNED:
        p = tl.multiple_of(p, 16)
    return p


@triton.jit
def _load_row(p_tab, i_n, p_like, o_x, m_x, ALIGNED: tl.constexpr):
    """Rows of the i_n-th tensor of a pointer table, in float32."""
    return tl.load(_table_ptr(p_tab, i_n, p_like, ALIGNED) + o_x, mask=m_x, other=0.0).to(tl.float32)


@triton.autotune(configs=AUTOTUNE_CONFIGS, key=["D", "H", "BT", "HAS_KEYS", "HAS_RES", "TWO"])
@triton.jit(do_not_specialize=["M", "N"])
def depth_read_fwd_kernel(
    p_vtab,
    p_ktab,
    p_q,
    p_g,
    p_res,
    p_o,
    p_w,
    p_r,
    M,
    N,
    eps,
    D: tl.constexpr,
    H: tl.constexpr,
    DH: tl.constexpr,
    BT: tl.constexpr,
    BH: tl.constexpr,
    BDH: tl.constexpr,
    HAS_KEYS: tl.constexpr,
    HAS_RES: tl.constexpr,
    TWO: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    i_t = tl.program_id(0)
    o_t, m_t, o_c, m_c, o_x, m_x, o_w, m_w = row_layout(i_t, M, D, H, DH, BT, BH, BDH)
    s_r = M.to(tl.int64)
    s_w = s_r * H

    # the logit is r * sum_j (q g)_j k_j, so the normalised key is never formed
    b_qg = tl.load(p_q + o_c, mask=m_c, other=0.0) * tl.load(p_g + o_c, mask=m_c, other=0.0)  # [BH, BDH]
    b_m = tl.full([BT, BH], float("-inf"), tl.float32)
    b_l = tl.zeros([BT, BH], dtype=tl.float32)
    b_acc = tl.zeros([BT, BH, BDH], dtype=tl.float32)
    if TWO:
        b_qg2 = tl.load(p_q + D + o_c, mask=m_c, other=0.0) * tl.load(p_g + D + o_c, mask=m_c, other=0.0)
        b_m2 = tl.full([BT, BH], float("-inf"), tl.float32)
        b_l2 = tl.zeros([BT, BH], dtype=tl.float32)
        b_acc2 = tl.zeros([BT, BH, BDH], dtype=tl.float32)

    for i_n in range(0, N):
        b_v = _load_row(p_vtab, i_n, p_o, o_x, m_x, ALIGNED)  # [BT, BH, BDH]
        if HAS_KEYS:  # noqa: SIM108 - a constexpr branch of a JIT kernel, a statement like the others
            b_k = _load_row(p_ktab, i_n, p_o, o_x, m_x, ALIGNED)  # [BT, BH, BDH]
        else:
            b_k = b_v
        b_r = tl.rsqrt(tl.sum(tl.sum(b_k * b_k, axis=2), axis=1) / D + eps)  # [BT]
        tl.store(p_r + i_n * s_r + o_t, b_r, mask=m_t)

        # raw logits go into the weight buffer and are normalised after the loop
        b_s = tl.sum(b_k * b_qg[None, :, :], axis=2) * b_r[:, None]  # [BT, BH]
        tl.store(p_w + i_n * s_w + o_w, b_s, mask=m_w)
        b_mn = tl.maximum(b_m, b_s)
        b_a = tl.exp(b_m - b_mn)
        b_p = tl.exp(b_s - b_mn)
        b_l = b_l * b_a + b_p
        b_acc = b_acc * b_a[:, :, None] + b_p[:, :, None] * b_v
        b_m = b_mn
        if TWO:
            b_s2 = tl.sum(b_k * b_qg2[None, :, :], axis=2) * b_r[:, None]  # [BT, BH]
            tl.store(p_w + (N + i_n) * s_w + o_w, b_s2, mask=m_w)
            b_mn2 = tl.maximum(b_m2, b_s2)
            b_a2 = tl.exp(b_m2 - b_mn2)
            b_p2 = tl.exp(b_s2 - b_mn2)
            b_l2 = b_l2 * b_a2 + b_p2
            b_acc2 = b_acc2 * b_a2[:, :, None] + b_p2[:, :, None] * b_v
            b_m2 = b_mn2

    b_il = 1.0 / b_l  # [BT, BH]
    b_o = b_acc * b_il[:, :, None]  # [BT, BH, BDH]
    if TWO:
        b_il2 = 1.0 / b_l2
        b_o2 = b_acc2 * b_il2[:, :, None]
    if HAS_RES:
        b_res = tl.load(p_res + o_x, mask=m_x, other=0.0).to(tl.float32)
        b_o += b_res
        if TWO:
            b_o2 += b_res
    tl.store(p_o + o_x, b_o.to(p_o.dtype.element_ty), mask=m_x)
    if TWO:
        tl.store(p_o + s_r * D + o_x, b_o2.to(p_o.dtype.element_ty), mask=m_x)

    # the logits written above must be visible before this program reads them back
    tl.debug_barrier()
    for i_n in range(0, N):
        p_wn = p_w + i_n * s_w + o_w
        tl.store(p_wn, tl.exp(tl.load(p_wn, mask=m_w, other=0.0) - b_m) * b_il, mask=m_w)
        if TWO:
            p_wn2 = p_w + (N + i_n) * s_w + o_w
            tl.store(p_wn2, tl.exp(tl.load(p_wn2, mask=m_w, other=0.0) - b_m2) * b_il2, mask=m_w)


@triton.autotune(configs=AUTOTUNE_CONFIGS, key=["D", "H", "BT", "HAS_KEYS", "HAS_DW", "TWO"])
@triton.jit(do_not_specialize=["M", "N"])
def depth_read_bwd_kernel(
    p_vtab,
    p_ktab,
    p_dvtab,
    p_dktab,
    p_q,
    p_g,
    p_do,
    p_dw,
    p_w,
    p_r,
    p_a,
    M,
    N,
    D: tl.constexpr,
    H: tl.constexpr,
    DH: tl.constexpr,
    BT: tl.constexpr,
    BH: tl.constexpr,
    BDH: tl.constexpr,
    HAS_KEYS: tl.constexpr,
    HAS_DW: tl.constexpr,
    TWO: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    i_t = tl.program_id(0)
    o_t, m_t, o_c, m_c, o_x, m_x, o_w, m_w = row_layout(i_t, M, D, H, DH, BT, BH, BDH)
    s_r = M.to(tl.int64)
    s_w = s_r * H
    s_o = s_r * D

    b_qg = tl.load(p_q + o_c, mask=m_c, other=0.0) * tl.load(p_g + o_c, mask=m_c, other=0.0)  # [BH, BDH]
    b_do = tl.load(p_do + o_x, mask=m_x, other=0.0).to(tl.float32)  # [BT, BH, BDH]
    b_sum = tl.zeros([BT, BH], dtype=tl.float32)
    if TWO:
        b_qg2 = tl.load(p_q + D + o_c, mask=m_c, other=0.0) * tl.load(p_g + D + o_c, mask=m_c, other=0.0)
        b_do2 = tl.load(p_do + s_o + o_x, mask=m_x, other=0.0).to(tl.float32)
        b_sum2 = tl.zeros([BT, BH], dtype=tl.float32)

    # pass 1: S_h = sum_n w_nh (<dout_h, v_nh> + dweight_nh)
    for i_n in range(0, N):
        b_v = _load_row(p_vtab, i_n, p_do, o_x, m_x, ALIGNED)  # [BT, BH, BDH]
        p_wn = p_w + i_n * s_w + o_w
        b_dot = tl.sum(b_do * b_v, axis=2)  # [BT, BH]
        if HAS_DW:
            b_dot += tl.load(p_dw + i_n * s_w + o_w, mask=m_w, other=0.0)
        b_sum += tl.load(p_wn, mask=m_w, other=0.0) * b_dot
        if TWO:
            b_dot2 = tl.sum(b_do2 * b_v, axis=2)
            if HAS_DW:
                b_dot2 += tl.load(p_dw + (N + i_n) * s_w + o_w, mask=m_w, other=0.0)
            b_sum2 += tl.load(p_wn + N * s_w, mask=m_w, other=0.0) * b_dot2

    # pass 2: per source, dlogit, then the value and RMSNorm-key paths of its gradient
    b_acc = tl.zeros([BH, BDH], dtype=tl.float32)
    if TWO:
        b_acc2 = tl.zeros([BH, BDH], dtype=tl.float32)
    for i_n in range(0, N):
        b_v = _load_row(p_vtab, i_n, p_do, o_x, m_x, ALIGNED)  # [BT, BH, BDH]
        if HAS_KEYS:  # noqa: SIM108 - a constexpr branch of a JIT kernel, a statement like the others
            b_k = _load_row(p_ktab, i_n, p_do, o_x, m_x, ALIGNED)  # [BT, BH, BDH]
        else:
            b_k = b_v
        b_r = tl.load(p_r + i_n * s_r + o_t, mask=m_t, other=0.0)  # [BT]
        b_kr = b_k * b_r[:, None, None]  # [BT, BH, BDH]
        p_wn = p_w + i_n * s_w + o_w

        b_wn = tl.load(p_wn, mask=m_w, other=0.0)  # [BT, BH]
        b_dot = tl.sum(b_do * b_v, axis=2)
        if HAS_DW:
            b_dot += tl.load(p_dw + i_n * s_w + o_w, mask=m_w, other=0.0)
        b_dl = b_wn * (b_dot - b_sum)  # [BT, BH]
        b_acc += tl.sum(b_dl[:, :, None] * b_kr, axis=0)
        # u = g * dk_hat with dk_hat = dlogit q, per head
        b_u = b_dl[:, :, None] * b_qg[None, :, :]  # [BT, BH, BDH]
        b_dv = b_wn[:, :, None] * b_do  # [BT, BH, BDH]
        if TWO:
            b_wn2 = tl.load(p_wn + N * s_w, mask=m_w, other=0.0)
            b_dot2 = tl.sum(b_do2 * b_v, axis=2)
            if HAS_DW:
                b_dot2 += tl.load(p_dw + (N + i_n) * s_w + o_w, mask=m_w, other=0.0)
            b_dl2 = b_wn2 * (b_dot2 - b_sum2)
            b_acc2 += tl.sum(b_dl2[:, :, None] * b_kr, axis=0)
            b_u += b_dl2[:, :, None] * b_qg2[None, :, :]
            b_dv += b_wn2[:, :, None] * b_do2
        b_uk = tl.sum(tl.sum(b_u * b_k, axis=2), axis=1)  # [BT]
        b_dk = b_r[:, None, None] * b_u - (b_r * b_r * b_r * b_uk / D)[:, None, None] * b_k

        p_dv = _table_ptr(p_dvtab, i_n, p_do, ALIGNED)
        if HAS_KEYS:
            p_dk = _table_ptr(p_dktab, i_n, p_do, ALIGNED)
            tl.store(p_dk + o_x, b_dk.to(p_do.dtype.element_ty), mask=m_x)
            tl.store(p_dv + o_x, b_dv.to(p_do.dtype.element_ty), mask=m_x)
        else:
            tl.store(p_dv + o_x, (b_dv + b_dk).to(p_do.dtype.element_ty), mask=m_x)

    # stage 1 of the query/gain reduction: this program's partial of sum_{t,n} dlogit * k r
    tl.store(p_a + i_t.to(tl.int64) * D + o_c, b_acc, mask=m_c)
    if TWO:
        tl.store(p_a + (tl.num_programs(0) + i_t).to(tl.int64) * D + o_c, b_acc2, mask=m_c)


# BT override for tuning sweeps (bench/bench_depth_read.py --sweep-rows); None keeps the heuristic
ROWS_PER_PROGRAM: int | None = None


def _block_shape(dim: int, heads: int) -> tuple[int, int, int]:
    return block_shape(dim, heads, ROWS_PER_PROGRAM)


def _pointer_tables(*groups: Sequence[Tensor], device: torch.device) -> list[Tensor]:
    """One int64 address table per group, uploaded in a single copy."""
    # an even length per group keeps every table 16-byte aligned, so one specialisation serves all N
    sizes = [len(g) + len(g) % 2 for g in groups]
    table = torch.tensor([t.data_ptr() for g in groups for t in [*g, *g[: len(g) % 2]]], dtype=torch.int64)
    if device.type == "cuda":
        # pinned and non_blocking: the upload is stream-ordered instead of a host sync per call
        table = table.pin_memory().to(device, non_blocking=True)
    return list(table.split(sizes))


def _aligned(tensors: Sequence[Tensor]) -> bool:
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def _require_launchable(device: torch.device) -> None:
    require_launchable(device, "depth_read_triton")


# the address tables are uploaded inside the op, so a captured CUDA graph would replay stale addresses
@torch.library.custom_op("reslab::depth_read_fwd", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def depth_read_fwd(
    sources: list[Tensor],
    keys: list[Tensor],
    query: Tensor,
    key_gain: Tensor,
    residual: Tensor | None,
    heads: int,
    eps: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """R routes (query, key_gain [R, D], R in {1, 2}) over N sources [B, T, D] in one pass.

    Returns out [R, B, T, D] (sources' dtype), weights [R, N, B, T, H] and the keys' inverse
    RMS [N, B, T] (float32). `keys=[]` scores the sources themselves.
    """
    src = [s.contiguous() for s in sources]
    kys = [k.contiguous() for k in keys]
    batch, seq, dim = src[0].shape
    rows, n_src, routes, device = batch * seq, len(src), query.shape[0], src[0].device
    _require_launchable(device)
    bt, bh, bdh = _block_shape(dim, heads)
    out = torch.empty((routes, batch, seq, dim), dtype=src[0].dtype, device=device)
    weights = torch.empty((routes, n_src, batch, seq, heads), dtype=torch.float32, device=device)
    inv_rms = torch.empty((n_src, batch, seq), dtype=torch.float32, device=device)
    res = out if residual is None else residual.contiguous()
    vtab, ktab = _pointer_tables(src, kys or src, device=device)
    depth_read_fwd_kernel[(triton.cdiv(rows, bt),)](
        vtab,
        ktab,
        query.float().contiguous(),
        key_gain.float().contiguous(),
        res,
        out,
        weights,
        inv_rms,
        rows,
        n_src,
        eps,
        D=dim,
        H=heads,
        DH=dim // heads,
        BT=bt,
        BH=bh,
        BDH=bdh,
        HAS_KEYS=bool(kys),
        HAS_RES=residual is not None,
        TWO=routes == 2,
        ALIGNED=_aligned(src + kys),
    )
    return out, weights, inv_rms


@depth_read_fwd.register_fake
def _depth_read_fwd_fake(sources, keys, query, key_gain, residual, heads, eps):
    s0 = sources[0]
    routes, n_src = query.shape[0], len(sources)
    return (
        s0.new_empty((routes, *s0.shape)),
        s0.new_empty((routes, n_src, *s0.shape[:-1], heads), dtype=torch.float32),
        s0.new_empty((n_src, *s0.shape[:-1]), dtype=torch.float32),
    )


@torch.library.custom_op("reslab::depth_read_bwd", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def depth_read_bwd(
    dout: Tensor,
    dweights: Tensor | None,
    sources: list[Tensor],
    keys: list[Tensor],
    query: Tensor,
    key_gain: Tensor,
    weights: Tensor,
    inv_rms: Tensor,
    heads: int,
) -> tuple[list[Tensor], list[Tensor], Tensor, Tensor]:
    """Gradients of `depth_read_fwd` for dout [R, B, T, D] and optional dweights [R, N, B, T, H].

    Returns one gradient per source, one per key (empty when `keys=[]`), dquery and dkey_gain
    [R, D] in the dtypes of query and key_gain.
    """
    src = [s.contiguous() for s in sources]
    kys = [k.contiguous() for k in keys]
    batch, seq, dim = src[0].shape
    rows, n_src, routes, device = batch * seq, len(src), query.shape[0], src[0].device
    _require_launchable(device)
    bt, bh, bdh = _block_shape(dim, heads)
    n_prog = triton.cdiv(rows, bt)
    dsrc = [torch.empty((batch, seq, dim), dtype=src[0].dtype, device=device) for _ in src]
    dkeys = [torch.empty((batch, seq, dim), dtype=src[0].dtype, device=device) for _ in kys]
    partial = torch.empty((routes, n_prog, dim), dtype=torch.float32, device=device)
    q, g = query.float().contiguous(), key_gain.float().contiguous()
    vtab, ktab, dvtab, dktab = _pointer_tables(src, kys or src, dsrc, dkeys or dsrc, device=device)
    depth_read_bwd_kernel[(n_prog,)](
        vtab,
        ktab,
        dvtab,
        dktab,
        q,
        g,
        dout.to(src[0].dtype).contiguous(),
        weights if dweights is None else dweights.float().contiguous(),
        weights.contiguous(),
        inv_rms.contiguous(),
        partial,
        rows,
        n_src,
        D=dim,
        H=heads,
        DH=dim // heads,
        BT=bt,
        BH=bh,
        BDH=bdh,
        HAS_KEYS=bool(kys),
        HAS_DW=dweights is not None,
        TWO=routes == 2,
        ALIGNED=_aligned(src + kys + dsrc + dkeys),
    )
    # stage 2: a fixed-order sum over programs keeps dquery and dkey_gain deterministic
    acc = partial.sum(1)  # [R, D]
    return dsrc, dkeys, (acc * g).to(query.dtype), (acc * q).to(key_gain.dtype)


@depth_read_bwd.register_fake
def _depth_read_bwd_fake(dout, dweights, sources, keys, query, key_gain, weights, inv_rms, heads):
    return (
        [s.new_empty(s.shape) for s in sources],
        [k.new_empty(k.shape) for k in keys],
        query.new_empty(query.shape),
        key_gain.new_empty(key_gain.shape),
    )


def _fwd_setup_context(ctx, inputs, output):
    sources, keys, query, key_gain, residual, heads, _ = inputs
    _, weights, inv_rms = output
    # grads of unused outputs (weights, inv_rms) arrive as None, so dweights is read only when used
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(inv_rms)
    ctx.n_src, ctx.n_keys, ctx.heads = len(sources), len(keys), heads
    ctx.residual_dtype = None if residual is None else residual.dtype
    ctx.save_for_backward(*sources, *keys, query, key_gain, weights, inv_rms)


def _fwd_backward(ctx, dout, dweights, _dinv_rms):
    saved = ctx.saved_tensors
    sources = list(saved[: ctx.n_src])
    keys = list(saved[ctx.n_src : ctx.n_src + ctx.n_keys])
    query, key_gain, weights, inv_rms = saved[ctx.n_src + ctx.n_keys :]
    if dout is None:
        dout = torch.zeros((query.shape[0], *sources[0].shape), dtype=sources[0].dtype, device=sources[0].device)
    dsrc, dkeys, dquery, dgain = torch.ops.reslab.depth_read_bwd(
        dout, dweights, sources, keys, query, key_gain, weights, inv_rms, ctx.heads
    )
    dres = None
    if ctx.residual_dtype is not None:
        dres = (dout[0] if dout.shape[0] == 1 else dout.sum(0)).to(ctx.residual_dtype)
    return dsrc, dkeys, dquery, dgain, dres, None, None


depth_read_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


def _validate(
    sources: Sequence[Tensor],
    queries: Sequence[tuple[str, Tensor]],
    heads: int,
    keys: Sequence[Tensor] | None,
    residual: Tensor | None,
) -> None:
    if isinstance(sources, Tensor) or not isinstance(sources, Sequence):
        raise ValueError("depth_read: sources must be a list of [B, T, D] tensors, not a stacked tensor")
    if len(sources) == 0:
        raise ValueError("depth_read: sources is empty; at least one [B, T, D] tensor is needed")
    first = sources[0]
    if first.dim() != 3:
        raise ValueError(f"depth_read: sources[0] must be [B, T, D], got shape {tuple(first.shape)}")
    if first.dtype not in _DTYPES:
        raise ValueError(
            f"depth_read_triton: dtype {first.dtype} is not supported (float32, bfloat16, float16); "
            "use impl='reference' for float64"
        )
    dim = first.shape[-1]
    if not isinstance(heads, int) or heads < 1:
        raise ValueError(f"depth_read: heads must be a positive int, got {heads!r}")
    if dim % heads:
        raise ValueError(f"depth_read: width D={dim} is not divisible by heads={heads}")

    def check_like(name: str, t: Tensor) -> None:
        if t.shape != first.shape:
            raise ValueError(f"depth_read: {name} has shape {tuple(t.shape)}, sources[0] has {tuple(first.shape)}")
        if t.dtype != first.dtype:
            raise ValueError(f"depth_read: {name} has dtype {t.dtype}, sources[0] has {first.dtype}")
        if t.device != first.device:
            raise ValueError(f"depth_read: {name} is on {t.device}, sources[0] is on {first.device}")

    for i, s in enumerate(sources[1:], start=1):
        check_like(f"sources[{i}]", s)
    if keys is not None:
        if len(keys) != len(sources):
            raise ValueError(f"depth_read: {len(keys)} keys for {len(sources)} sources; need one key per source")
        for i, k in enumerate(keys):
            check_like(f"keys[{i}]", k)
    if residual is not None:
        check_like("residual", residual)
    for name, t in queries:
        if t.shape != (dim,):
            raise ValueError(f"depth_read: {name} must have shape ({dim},), got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"depth_read: {name} must be floating point, got {t.dtype}")
        if t.device != first.device:
            raise ValueError(f"depth_read: {name} is on {t.device}, sources[0] is on {first.device}")


def depth_read_triton(
    sources: Sequence[Tensor],
    query: Tensor,
    key_gain: Tensor,
    *,
    heads: int = 1,
    eps: float = 1e-6,
    keys: Sequence[Tensor] | None = None,
    residual: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Route over `sources` (N tensors [B, T, D]) with the fused kernels.

    Same math and signature as `depth_read_reference`, except that `sources` and `keys` are
    lists (never stacked). Float32, bfloat16 and float16 inputs; the query and gain may have any
    floating dtype (the math runs in float32).

    Returns:
        out [B, T, D] in the sources' dtype, and the depth weights [N, B, T, H] in float32.
    """
    _validate(sources, (("query", query), ("key_gain", key_gain)), heads, keys, residual)
    out, weights, _ = torch.ops.reslab.depth_read_fwd(
        list(sources), [] if keys is None else list(keys),
        query.unsqueeze(0), key_gain.unsqueeze(0), residual, heads, float(eps),
    )
    return out.squeeze(0), weights.squeeze(0)


def depth_read2_triton(
    sources: Sequence[Tensor],
    query: Tensor,
    key_gain: Tensor,
    query_v: Tensor,
    key_gain_v: Tensor,
    *,
    heads: int = 1,
    eps: float = 1e-6,
    keys: Sequence[Tensor] | None = None,
    residual: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Two routes over the same sources in one pass (RD-AttnRes, variants.md 4).

    The query-key route uses (`query`, `key_gain`), the value route (`query_v`, `key_gain_v`);
    both read the same keys and values, and `residual` is added to both outputs.

    Returns:
        out, out_v [B, T, D] in the sources' dtype, and weights, weights_v [N, B, T, H] float32.
    """
    named = (("query", query), ("key_gain", key_gain), ("query_v", query_v), ("key_gain_v", key_gain_v))
    _validate(sources, named, heads, keys, residual)
    out, weights, _ = torch.ops.reslab.depth_read_fwd(
        list(sources), [] if keys is None else list(keys),
        torch.stack([query.float(), query_v.float()]), torch.stack([key_gain.float(), key_gain_v.float()]),
        residual, heads, float(eps),
    )
    out_qk, out_v = out.unbind(0)
    weights_qk, weights_v = weights.unbind(0)
    return out_qk, out_v, weights_qk, weights_v
