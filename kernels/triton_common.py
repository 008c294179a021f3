"""What every Triton kernel of reslab shares: the row layout of a program, the launch configs, the
row-block size and the launch check. Imported only by the kernel modules (it imports triton).
"""

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# the interpreter ignores warps and stages, so one config avoids re-running every launch
AUTOTUNE_CONFIGS = (
    [triton.Config({}, num_warps=4)]
    if INTERPRET
    else [triton.Config({}, num_warps=w, num_stages=s) for w in (4, 8) for s in (1, 2)]
)


@triton.jit
def row_layout(i_t, M, D: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, BT: tl.constexpr,
               BH: tl.constexpr, BDH: tl.constexpr):
    """Offsets and masks of this program's BT rows, a row of width D seen as [BH, BDH]."""
    o_t = i_t.to(tl.int64) * BT + tl.arange(0, BT)  # [BT]
    o_h = tl.arange(0, BH)
    o_j = tl.arange(0, BDH)
    m_t = o_t < M
    # head h, offset j inside the head
    o_c = o_h[:, None] * DH + o_j[None, :]  # [BH, BDH]
    m_c = (o_h[:, None] < H) & (o_j[None, :] < DH)
    o_x = o_t[:, None, None] * D + o_c[None, :, :]  # [BT, BH, BDH]
    m_x = m_t[:, None, None] & m_c[None, :, :]
    o_w = o_t[:, None] * H + o_h[None, :]  # [BT, BH]
    m_w = m_t[:, None] & (o_h[None, :] < H)
    return o_t, m_t, o_c, m_c, o_x, m_x, o_w, m_w


def block_shape(dim: int, heads: int, rows: int | None = None) -> tuple[int, int, int]:
    """(BT, BH, BDH): rows per program (`rows` when given) and the padded [heads, head width] tile of one row."""
    bh = triton.next_power_of_2(heads)
    bdh = triton.next_power_of_2(dim // heads)
    if rows is not None:
        return rows, bh, bdh
    # the interpreter pays per program, not per element, so it takes bigger row blocks
    budget = 16384 if INTERPRET else 4096
    return max(1, min(16, budget // (bh * bdh))), bh, bdh


def require_launchable(device: torch.device, op: str) -> None:
    if device.type != "cuda" and not INTERPRET:
        raise RuntimeError(
            f"{op} needs CUDA tensors (got {device.type}); set TRITON_INTERPRET=1 before importing triton to run "
            "the kernels in Triton's CPU interpreter, or use impl='reference'"
        )
