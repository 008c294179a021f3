"""The depth history: sources written once into one buffer, read by every later routing site.

`DepthHistory` is what a routing variant holds for one forward pass: `write(slot, x, readers)`
puts a source (the embedding, a sublayer output, a block's partial sum) into slot `slot` of a
preallocated `[n_slots, M, D]` buffer, and `read(site, n_prefix, query, key_gain, extra=...)`
routes over the slots `0..n_prefix-1` (and `extra`): Full AttnRes and MHAR read a prefix, Block
AttnRes its completed blocks plus the slot of its current partial block. The math is the depth
read's (kernels/depth_read/reference.py); the design and its derivation are in README.md.

`impl="triton"` runs the kernels of `triton.py`: one backward pass per site and each source's
gradient formed once, when complete. `impl="reference"` keeps the sources as a list and calls
`depth_read_reference` (the CPU path and the float64 check).
"""

from __future__ import annotations

import torch
from torch import Tensor

from reslab.kernels.depth_read.reference import depth_read_reference

__all__ = ["DepthHistory"]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class DepthHistory:
    """The sources of one forward pass and the routing sites that read them.

    Args:
        n_slots: sources that will be written (Full AttnRes: 2L + 1; Block: 2L + 1 too, one slot
            per completed block and one per partial-block state).
        n_sites: routing sites that will read (2L, + 1 for a readout route).
        like: a [B, T, D] tensor giving the shape, dtype and device of every source.
        heads: H, depth-softmax heads per site (MHAR); must divide D.
        impl: "triton" (the kernels; CUDA, or CPU under TRITON_INTERPRET=1) or "reference".

    Each slot is written once, with the range of sites that will read it (`readers`); every site
    in that range must read it, and no other site may. With the kernels, every buffer is
    allocated here and every index is a Python int: nothing is uploaded per launch, and the ops
    trace under torch.compile(fullgraph=True). Built without gradient (evaluation, decoding), it
    allocates the source buffer alone, and `reset` readies it for the next pass of the same shape.
    """

    def __init__(self, n_slots: int, n_sites: int, like: Tensor, *, heads: int = 1, eps: float = 1e-6,
                 impl: str = "triton") -> None:
        if impl not in ("triton", "reference"):
            raise ValueError(f"DepthHistory.impl: {impl!r} is not allowed; expected 'triton' or 'reference'")
        if like.dim() != 3:
            raise ValueError(f"DepthHistory.like: expected a [B, T, D] tensor, got shape {tuple(like.shape)}")
        dim = like.shape[-1]
        if heads < 1 or dim % heads:
            raise ValueError(f"DepthHistory.heads: {heads} must be a positive divisor of D={dim}")
        if n_slots < 1 or n_sites < 1:
            raise ValueError(f"DepthHistory: n_slots={n_slots} and n_sites={n_sites} must be >= 1")
        if impl == "triton" and like.dtype not in _KERNEL_DTYPES:
            raise ValueError(f"DepthHistory.like: dtype {like.dtype} is not supported by the kernels "
                             "(float32, bfloat16, float16); use impl='reference'")
        self.impl, self.heads, self.eps = impl, heads, float(eps)
        self.n_slots, self.n_sites = n_slots, n_sites
        self.shape, self.dtype, self.device = tuple(like.shape), like.dtype, like.device
        self.readers: dict[int, tuple[int, int]] = {}  # slot -> (first, last) site reading it
        self.read_sites: set[int] = set()
        self.sources: dict[int, Tensor] = {}  # the reference keeps the sources themselves, by slot
        self.buf: Tensor | None = None
        self.tables: tuple[Tensor, ...] = ()
        if impl == "triton":
            from reslab.kernels.depth_history import triton as _kernels  # noqa: F401  (registers the ops)

            if torch.is_grad_enabled():
                # the token orders each read after the writes before it, each pull after its readers
                self.buf, *tables, self.token = torch.ops.reslab.history_alloc(like.detach(), n_slots, n_sites,
                                                                               heads)
                self.tables = tuple(tables)
            else:
                # no backward will run (evaluation, decoding): the source buffer alone, no backward tables
                self.buf = torch.empty((n_slots, like.numel() // dim, dim), dtype=like.dtype, device=like.device)
                self.token = torch.empty((), dtype=torch.float32, device=like.device)

    def fits(self, like: Tensor) -> bool:
        """Whether a pass over sources like `like` [B, T, D] can reuse this history (`reset`)."""
        return (not self.tables and tuple(like.shape) == self.shape and like.dtype == self.dtype
                and like.device == self.device)

    def reset(self) -> None:
        """Forget every write and read and keep the buffer: the next pass of the same shape (the next
        decode step) writes it anew, without allocating. Only for a history built without gradient: a
        pending backward would read the sources this overwrites."""
        if self.tables:
            raise ValueError("DepthHistory.reset: this history has backward tables (built with gradient "
                             "enabled), whose backward reads its sources; allowed: a history built without gradient")
        self.readers.clear()
        self.read_sites.clear()
        self.sources.clear()

    def write(self, slot: int, x: Tensor, readers: tuple[int, int]) -> None:
        """Put source `x` [B, T, D] into `slot`, to be read by the sites readers[0]..readers[1]."""
        if not 0 <= slot < self.n_slots:
            raise ValueError(f"DepthHistory.write: slot {slot} is out of range 0..{self.n_slots - 1}")
        if slot in self.readers:
            raise ValueError(f"DepthHistory.write: slot {slot} is already written; each slot is written once")
        first, last = readers
        if not 0 <= first <= last < self.n_sites or any(s in self.read_sites for s in range(first, last + 1)):
            raise ValueError(f"DepthHistory.write: readers {readers} of slot {slot} must be sites that have not "
                             f"read yet, first <= last, within 0..{self.n_sites - 1}")
        if tuple(x.shape) != self.shape or x.dtype != self.dtype or x.device != self.device:
            raise ValueError(f"DepthHistory.write: source has shape {tuple(x.shape)}, {x.dtype} on {x.device}; "
                             f"expected {self.shape}, {self.dtype} on {self.device}")
        self.readers[slot] = (first, last)
        if self.impl == "reference":
            self.sources[slot] = x
        else:
            self.token = _Write.apply(self.token, x, self.buf, *self.tables, slot, first, last, self.heads, self.eps)

    def read(self, site: int, n_prefix: int, query: Tensor, key_gain: Tensor, *, extra: int = -1,
             need_weights: bool = False) -> tuple[Tensor, Tensor | None]:
        """Route over slots 0..n_prefix-1 (then `extra` when >= 0) with `query`, `key_gain` [D].

        Returns out [B, T, D] and, when `need_weights`, the depth weights [N, B, T, H] float32.
        """
        slots = self._check_read(site, n_prefix, extra, query, key_gain)
        self.read_sites.add(site)
        if self.impl == "reference":
            chosen = torch.stack([self.sources[s] for s in slots])
            out, weights = depth_read_reference(chosen, query, key_gain, heads=self.heads, eps=self.eps)
            return out, weights if need_weights else None
        out, weights = _Read.apply(self.token, query, key_gain, self.buf, *self.tables, site, n_prefix, extra,
                                   self.heads, self.eps, need_weights)
        if not need_weights:
            return out.view(self.shape), None
        return out.view(self.shape), weights.view(-1, *self.shape[:-1], self.heads)

    def source(self, slot: int) -> Tensor:
        """The source in `slot` [B, T, D], for reading without gradient (diagnostics, the stream):
        with the kernels it is a view of the buffer, which carries no gradient to the source."""
        if slot not in self.readers:
            raise ValueError(f"DepthHistory.source: slot {slot} is not written")
        if self.impl == "reference":
            return self.sources[slot]
        assert self.buf is not None
        return self.buf[slot].view(self.shape)

    def _check_read(self, site: int, n_prefix: int, extra: int, query: Tensor, key_gain: Tensor) -> list[int]:
        if not 0 <= site < self.n_sites:
            raise ValueError(f"DepthHistory.read: site {site} is out of range 0..{self.n_sites - 1}")
        if site in self.read_sites:
            raise ValueError(f"DepthHistory.read: site {site} has already read; each site reads once")
        slots = list(range(n_prefix)) + ([extra] if extra >= 0 else [])
        if not slots:
            raise ValueError("DepthHistory.read: no sources (n_prefix=0 and no extra slot)")
        if 0 <= extra < n_prefix:
            raise ValueError(f"DepthHistory.read: extra slot {extra} is inside the prefix 0..{n_prefix - 1}")
        missing = [s for s in slots if s not in self.readers]
        if missing:
            raise ValueError(f"DepthHistory.read: site {site} reads slots {missing} that are not written")
        declared = sorted(s for s, (first, last) in self.readers.items() if first <= site <= last)
        if declared != sorted(slots):
            raise ValueError(f"DepthHistory.read: site {site} reads slots {sorted(slots)}, but the writes declared "
                             f"it a reader of slots {declared}")
        dim = self.shape[-1]
        for name, t in (("query", query), ("key_gain", key_gain)):
            if tuple(t.shape) != (dim,) or not t.is_floating_point() or t.device != self.device:
                raise ValueError(f"DepthHistory.read: {name} must be a floating ({dim},) tensor on {self.device}, "
                                 f"got {tuple(t.shape)} {t.dtype} on {t.device}")
        return slots


class _Write(torch.autograd.Function):
    """Copies a source into its slot; its backward hands the source its pulled gradient.

    The token it returns feeds every later read and write, and each read's backward returns a
    token as the token's gradient, so autograd (and a compiled graph, as dataflow) runs this
    backward only after the backward of every site that read the slot.
    """

    @staticmethod
    def forward(ctx, token, x, buf, *args):
        *tables, slot, first, last, heads, eps = args
        ctx.save_for_backward(buf, *tables)
        ctx.slot, ctx.first, ctx.last, ctx.heads, ctx.eps, ctx.shape = slot, first, last, heads, eps, x.shape
        return torch.ops.reslab.history_write(buf, x, token, slot)

    @staticmethod
    def backward(ctx, dtoken):
        buf, *tables = ctx.saved_tensors
        dx, token = torch.ops.reslab.history_pull(buf, *tables, dtoken, ctx.slot, ctx.first, ctx.last, ctx.heads,
                                                  ctx.eps)
        return (token, dx.view(ctx.shape), *[None] * (len(tables) + 6))


class _Read(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token, query, key_gain, buf, *args):
        *tables, site, n_prefix, extra, heads, eps, need_weights = args
        qg = (query.float() * key_gain.float()).contiguous()
        out, lse, weights = torch.ops.reslab.history_read_fwd(buf, token, qg, n_prefix, extra, heads, eps,
                                                              need_weights)
        ctx.save_for_backward(query, key_gain, out, lse, weights, buf, *tables)
        ctx.site, ctx.n_prefix, ctx.extra, ctx.heads, ctx.eps = site, n_prefix, extra, heads, eps
        ctx.need_weights = need_weights
        if not need_weights:
            ctx.mark_non_differentiable(weights)
        return out, weights

    @staticmethod
    def backward(ctx, dout, dweights):
        query, key_gain, out, lse, weights, buf, *tables = ctx.saved_tensors
        dw = sdw = None
        if ctx.need_weights:
            dw = dweights.float().contiguous()
            sdw = (weights * dw).sum(0)
        q, g = query.float(), key_gain.float()
        acc, token = torch.ops.reslab.history_read_bwd(
            buf, *tables, (q * g).contiguous(), dout.to(buf.dtype).contiguous(), out, lse, dw, sdw, ctx.site,
            ctx.n_prefix, ctx.extra, ctx.heads, ctx.eps,
        )
        return (token, (acc * g).to(query.dtype), (acc * q).to(key_gain.dtype), *[None] * (len(tables) + 7))
