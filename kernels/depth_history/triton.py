"""Triton kernels of the depth-history read: sources in one buffer, one backward pass, gradients pulled.

Derivation and byte counts in README.md. Three kernels, each one program per block of BT rows
(M = B*T rows of width D, seen as an [H, D/H] tile padded to [BH, BDH]):

- `history_fwd_kernel`: a site's read of the slots `0..n_prefix-1` (and `extra` when >= 0) of the
  buffer `[n_slots, M, D]`; online softmax over depth per head; writes out and the per-row,
  per-head log-sum-exp of the logits (float32), and the weights only when asked;
- `history_bwd_kernel`: the site's backward in one pass over its sources: `S_h = <dout_h, out_h>`
  comes from the saved out, the weights from the saved log-sum-exp; it writes the site's dlogits
  `[n_sites, n_slots, M, H]` and stores its dout `[n_sites, M, D]` for the pull, and per program
  a partial of the query/gain reduction; it writes no source gradient;
- `history_pull_kernel`: a source's whole gradient, once, when every site that read it is done:
  `sum_s w_s dout_s` (a depth read over the later sites' douts, the weights recomputed from the
  source and each site's log-sum-exp) plus the RMSNorm-key term of `sum_s dlogit_s (q g)_s`.

The ops are `torch.library` custom ops, with fake implementations, so `torch.compile` treats each
launch as one opaque node; every index is a Python int and every buffer is preallocated, so no
launch uploads anything from the host.
"""


import torch
import triton
import triton.language as tl
from torch import Tensor

from reslab.kernels.triton_common import AUTOTUNE_CONFIGS, block_shape, require_launchable, row_layout

__all__ = ["history_alloc", "history_pull", "history_read_bwd", "history_read_fwd", "history_write"]

@triton.jit
def _slot(i_n, NP, EXTRA):
    """The buffer slot of a site's i_n-th source: the prefix, then the extra slot."""
    return tl.where(i_n < NP, i_n, EXTRA).to(tl.int64)


@triton.jit
def _inv_rms(b_k, eps, D: tl.constexpr):
    """r [BT] = (mean_d k^2 + eps)^-1/2, over the full width of each row."""
    return tl.rsqrt(tl.sum(tl.sum(b_k * b_k, axis=2), axis=1) / D + eps)


@triton.jit
def _logits(b_k, b_r, b_qg):
    """[BT, BH]: r * sum_{j in head} (q g)_j k_j; the normalised key is never formed."""
    return tl.sum(b_k * b_qg[None, :, :], axis=2) * b_r[:, None]


@triton.autotune(configs=AUTOTUNE_CONFIGS, key=["D", "H", "BT", "NEED_W"])
@triton.jit(do_not_specialize=["M", "NP", "N", "EXTRA"])
def history_fwd_kernel(p_buf, p_qg, p_o, p_lse, p_w, M, NP, N, EXTRA, eps,
                       D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, BT: tl.constexpr,
                       BH: tl.constexpr, BDH: tl.constexpr, NEED_W: tl.constexpr):
    i_t = tl.program_id(0)
    _, _, o_c, m_c, o_x, m_x, o_w, m_w = row_layout(i_t, M, D, H, DH, BT, BH, BDH)
    s_x = M.to(tl.int64) * D
    s_w = M.to(tl.int64) * H
    b_qg = tl.load(p_qg + o_c, mask=m_c, other=0.0)  # [BH, BDH]
    b_m = tl.full([BT, BH], float("-inf"), tl.float32)
    b_l = tl.zeros([BT, BH], dtype=tl.float32)
    b_acc = tl.zeros([BT, BH, BDH], dtype=tl.float32)
    for i_n in range(0, N):
        b_v = tl.load(p_buf + _slot(i_n, NP, EXTRA) * s_x + o_x, mask=m_x, other=0.0).to(tl.float32)
        b_s = _logits(b_v, _inv_rms(b_v, eps, D), b_qg)  # [BT, BH]
        if NEED_W:
            tl.store(p_w + i_n * s_w + o_w, b_s, mask=m_w)
        b_mn = tl.maximum(b_m, b_s)
        b_a = tl.exp(b_m - b_mn)
        b_p = tl.exp(b_s - b_mn)
        b_l = b_l * b_a + b_p
        b_acc = b_acc * b_a[:, :, None] + b_p[:, :, None] * b_v
        b_m = b_mn
    tl.store(p_o + o_x, (b_acc / b_l[:, :, None]).to(p_o.dtype.element_ty), mask=m_x)
    b_lse = b_m + tl.log(b_l)
    tl.store(p_lse + o_w, b_lse, mask=m_w)
    if NEED_W:
        # the raw logits written above must be visible before this program reads them back
        tl.debug_barrier()
        for i_n in range(0, N):
            p_wn = p_w + i_n * s_w + o_w
            tl.store(p_wn, tl.exp(tl.load(p_wn, mask=m_w, other=0.0) - b_lse), mask=m_w)


@triton.autotune(configs=AUTOTUNE_CONFIGS, key=["D", "H", "BT", "HAS_DW"])
@triton.jit(do_not_specialize=["M", "NP", "N", "EXTRA", "SITE", "N_SLOTS"])
def history_bwd_kernel(p_buf, p_qg, p_do, p_o, p_lse, p_dw, p_sdw, p_gd, p_dl, p_a, M, NP, N, EXTRA, SITE,
                       N_SLOTS, eps, D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, BT: tl.constexpr,
                       BH: tl.constexpr, BDH: tl.constexpr, HAS_DW: tl.constexpr):
    i_t = tl.program_id(0)
    _, _, o_c, m_c, o_x, m_x, o_w, m_w = row_layout(i_t, M, D, H, DH, BT, BH, BDH)
    s_x = M.to(tl.int64) * D
    s_w = M.to(tl.int64) * H
    b_qg = tl.load(p_qg + o_c, mask=m_c, other=0.0)
    b_do = tl.load(p_do + o_x, mask=m_x, other=0.0).to(tl.float32)  # [BT, BH, BDH]
    tl.store(p_gd + SITE * s_x + o_x, b_do.to(p_gd.dtype.element_ty), mask=m_x)
    # S_h = sum_n w_nh <dout_h, v_nh> = <dout_h, out_h> (plus sum_n w_nh dweights_nh, done outside)
    b_sum = tl.sum(b_do * tl.load(p_o + o_x, mask=m_x, other=0.0).to(tl.float32), axis=2)  # [BT, BH]
    if HAS_DW:
        b_sum += tl.load(p_sdw + o_w, mask=m_w, other=0.0)
    b_lse = tl.load(p_lse + o_w, mask=m_w, other=0.0)
    b_acc = tl.zeros([BH, BDH], dtype=tl.float32)
    for i_n in range(0, N):
        slot = _slot(i_n, NP, EXTRA)
        b_v = tl.load(p_buf + slot * s_x + o_x, mask=m_x, other=0.0).to(tl.float32)
        b_r = _inv_rms(b_v, eps, D)
        b_s = _logits(b_v, b_r, b_qg)
        b_dot = tl.sum(b_do * b_v, axis=2)  # [BT, BH]
        if HAS_DW:
            b_dot += tl.load(p_dw + i_n * s_w + o_w, mask=m_w, other=0.0)
        b_dl = tl.exp(b_s - b_lse) * (b_dot - b_sum)  # [BT, BH]
        tl.store(p_dl + (SITE * N_SLOTS + slot) * s_w + o_w, b_dl, mask=m_w)
        b_acc += tl.sum(b_dl[:, :, None] * b_v * b_r[:, None, None], axis=0)
    # stage 1 of the query/gain reduction, summed over programs outside (fixed order, no atomics)
    tl.store(p_a + i_t.to(tl.int64) * D + o_c, b_acc, mask=m_c)


@triton.autotune(configs=AUTOTUNE_CONFIGS, key=["D", "H", "BT"])
@triton.jit(do_not_specialize=["M", "SLOT", "S0", "S1", "N_SLOTS"])
def history_pull_kernel(p_buf, p_qg, p_lse, p_gd, p_dl, p_dx, M, SLOT, S0, S1, N_SLOTS, eps,
                        D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, BT: tl.constexpr,
                        BH: tl.constexpr, BDH: tl.constexpr):
    i_t = tl.program_id(0)
    _, _, o_c, m_c, o_x, m_x, o_w, m_w = row_layout(i_t, M, D, H, DH, BT, BH, BDH)
    s_x = M.to(tl.int64) * D
    s_w = M.to(tl.int64) * H
    b_k = tl.load(p_buf + SLOT * s_x + o_x, mask=m_x, other=0.0).to(tl.float32)  # [BT, BH, BDH]
    b_dv = tl.zeros([BT, BH, BDH], dtype=tl.float32)
    # u = sum_s dlogit_s (q g)_s per head: the key gradient is linear in it
    b_u = tl.zeros([BT, BH, BDH], dtype=tl.float32)
    b_r = _inv_rms(b_k, eps, D)
    for s in range(S0, S1):
        b_qg = tl.load(p_qg + s * D + o_c, mask=m_c, other=0.0)
        b_w = tl.exp(_logits(b_k, b_r, b_qg) - tl.load(p_lse + s * s_w + o_w, mask=m_w, other=0.0))  # [BT, BH]
        b_dv += b_w[:, :, None] * tl.load(p_gd + s * s_x + o_x, mask=m_x, other=0.0).to(tl.float32)
        b_dl = tl.load(p_dl + (s * N_SLOTS + SLOT) * s_w + o_w, mask=m_w, other=0.0)
        b_u += b_dl[:, :, None] * b_qg[None, :, :]
    b_uk = tl.sum(tl.sum(b_u * b_k, axis=2), axis=1)  # [BT]
    b_dk = b_r[:, None, None] * b_u - (b_r * b_r * b_r * b_uk / D)[:, None, None] * b_k
    tl.store(p_dx + o_x, (b_dv + b_dk).to(p_dx.dtype.element_ty), mask=m_x)


def _tile(dim: int, heads: int) -> dict:
    bt, bh, bdh = block_shape(dim, heads)
    return dict(D=dim, H=heads, DH=dim // heads, BT=bt, BH=bh, BDH=bdh)


def _require_launchable(device: torch.device) -> None:
    require_launchable(device, "depth_history")


def _token(like: Tensor) -> Tensor:
    """An ordering token: its value is never read, only the dataflow through it."""
    return torch.empty((), dtype=torch.float32, device=like.device)


# The ops below write into the buffer and the tables without declaring it (mutates_args=()): the
# history is written once per slot and per site, every read and pull is ordered after the writes
# it needs by a token argument (the write's output, the gradients of the reads), so the compiler
# sees plain dataflow and neither copies the buffer per write nor reorders a read before its write.
# The writes go through `.data`, so autograd's version counters (saved buffers) do not move.
@torch.library.custom_op("reslab::history_alloc", mutates_args=())
def history_alloc(like: Tensor, n_slots: int, n_sites: int, heads: int) -> tuple[Tensor, Tensor, Tensor, Tensor,
                                                                                 Tensor, Tensor]:
    """The buffer [n_slots, M, D] (like's dtype, uninitialised), the backward tables (zeros, so a
    site whose read got no gradient adds nothing): douts [n_sites, M, D], dlogits [n_sites,
    n_slots, M, H], log-sum-exps [n_sites, M, H], q*g [n_sites, D] (float32), and a token."""
    dim = like.shape[-1]
    rows = like.numel() // dim
    f32, dev = torch.float32, like.device
    return (torch.empty((n_slots, rows, dim), dtype=like.dtype, device=dev),
            torch.zeros((n_sites, rows, dim), dtype=like.dtype, device=dev),
            torch.zeros((n_sites, n_slots, rows, heads), dtype=f32, device=dev),
            torch.zeros((n_sites, rows, heads), dtype=f32, device=dev),
            torch.zeros((n_sites, dim), dtype=f32, device=dev), _token(like))


@history_alloc.register_fake
def _(like, n_slots, n_sites, heads):
    dim = like.shape[-1]
    rows = like.numel() // dim
    f32 = torch.float32
    return (like.new_empty((n_slots, rows, dim)), like.new_empty((n_sites, rows, dim)),
            like.new_empty((n_sites, n_slots, rows, heads), dtype=f32),
            like.new_empty((n_sites, rows, heads), dtype=f32), like.new_empty((n_sites, dim), dtype=f32),
            like.new_empty((), dtype=f32))


@torch.library.custom_op("reslab::history_write", mutates_args=())
def history_write(buf: Tensor, x: Tensor, token: Tensor, slot: int) -> Tensor:
    """Copies x [B, T, D] into buf[slot]; returns the token every later read and write takes."""
    buf.data[slot].copy_(x.reshape(buf.shape[1:]))
    return _token(buf)


@history_write.register_fake
def _(buf, x, token, slot):
    return buf.new_empty((), dtype=torch.float32)


@torch.library.custom_op("reslab::history_read_fwd", mutates_args=())
def history_read_fwd(buf: Tensor, token: Tensor, qg: Tensor, n_prefix: int, extra: int, heads: int, eps: float,
                     need_weights: bool) -> tuple[Tensor, Tensor, Tensor]:
    """One site's read of `buf` [n_slots, M, D]: slots 0..n_prefix-1, then `extra` if >= 0.

    `qg` [D] float32 is the query times the key gain. Returns out [M, D] (buf's dtype), the
    log-sum-exp of the logits [M, H] and the weights [N, M, H] (float32; [0] unless asked).
    """
    _require_launchable(buf.device)
    _, rows, dim = buf.shape
    n_src = n_prefix + (extra >= 0)
    tile = _tile(dim, heads)
    out = torch.empty((rows, dim), dtype=buf.dtype, device=buf.device)
    lse = torch.empty((rows, heads), dtype=torch.float32, device=buf.device)
    weights = torch.empty((n_src, rows, heads) if need_weights else (0,), dtype=torch.float32, device=buf.device)
    history_fwd_kernel[(triton.cdiv(rows, tile["BT"]),)](
        buf, qg, out, lse, weights, rows, n_prefix, n_src, extra, eps, NEED_W=need_weights, **tile,
    )
    return out, lse, weights


@history_read_fwd.register_fake
def _(buf, token, qg, n_prefix, extra, heads, eps, need_weights):
    _, rows, dim = buf.shape
    n_src = n_prefix + (extra >= 0)
    return (buf.new_empty((rows, dim)), buf.new_empty((rows, heads), dtype=torch.float32),
            buf.new_empty((n_src, rows, heads) if need_weights else (0,), dtype=torch.float32))


@torch.library.custom_op("reslab::history_read_bwd", mutates_args=())
def history_read_bwd(buf: Tensor, dout_table: Tensor, dlogit_table: Tensor, lse_table: Tensor, qg_table: Tensor,
                     qg: Tensor, dout: Tensor, out: Tensor, lse: Tensor, dweights: Tensor | None,
                     sum_dweights: Tensor | None, site: int, n_prefix: int, extra: int, heads: int,
                     eps: float) -> tuple[Tensor, Tensor]:
    """The backward of one site's read, in one pass over its sources.

    Stores dout [M, D] in `dout_table[site]`, the dlogits [M, H] of each source slot in
    `dlogit_table[site, slot]`, `lse` and `qg` in their tables. `dweights` [N, M, H] and
    `sum_dweights` = sum_n w dweights [M, H] come together or not at all. Returns A [D] float32
    (dquery = g A, dgain = q A) and the token the pulls of this site's sources wait for.
    """
    _require_launchable(buf.device)
    _, rows, dim = buf.shape
    tile = _tile(dim, heads)
    n_prog = triton.cdiv(rows, tile["BT"])
    partial = torch.empty((n_prog, dim), dtype=torch.float32, device=buf.device)
    history_bwd_kernel[(n_prog,)](
        buf, qg, dout, out, lse, lse if dweights is None else dweights, lse if sum_dweights is None else sum_dweights,
        dout_table.data, dlogit_table.data, partial, rows, n_prefix, n_prefix + (extra >= 0), extra, site,
        dlogit_table.shape[1], eps, HAS_DW=dweights is not None, **tile,
    )
    lse_table.data[site].copy_(lse)
    qg_table.data[site].copy_(qg)
    return partial.sum(0), _token(buf)


@history_read_bwd.register_fake
def _(buf, dout_table, dlogit_table, lse_table, qg_table, qg, dout, out, lse, dweights, sum_dweights, site, n_prefix,
      extra, heads, eps):
    return buf.new_empty((buf.shape[-1],), dtype=torch.float32), buf.new_empty((), dtype=torch.float32)


@torch.library.custom_op("reslab::history_pull", mutates_args=())
def history_pull(buf: Tensor, dout_table: Tensor, dlogit_table: Tensor, lse_table: Tensor, qg_table: Tensor,
                 token: Tensor, slot: int, first_site: int, last_site: int, heads: int,
                 eps: float) -> tuple[Tensor, Tensor]:
    """The gradient [M, D] of the source in `slot`, read by the sites first_site..last_site, once
    `token` says their backward is done; and a token for the pulls after it."""
    _require_launchable(buf.device)
    _, rows, dim = buf.shape
    tile = _tile(dim, heads)
    dx = torch.empty((rows, dim), dtype=buf.dtype, device=buf.device)
    history_pull_kernel[(triton.cdiv(rows, tile["BT"]),)](
        buf, qg_table, lse_table, dout_table, dlogit_table, dx, rows, slot, first_site, last_site + 1,
        dlogit_table.shape[1], eps, **tile,
    )
    return dx, _token(buf)


@history_pull.register_fake
def _(buf, dout_table, dlogit_table, lse_table, qg_table, token, slot, first_site, last_site, heads, eps):
    return buf.new_empty(buf.shape[1:]), buf.new_empty((), dtype=torch.float32)
