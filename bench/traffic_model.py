"""Analytic memory traffic of the depth read per training step, per kernel design, against the floor.

Counts the bytes the routing of one training step (forward and backward) reads and writes in
device memory, for the routing sites of Full AttnRes, Block AttnRes and MHAR at a model shape.
Sublayers, norms and Block's partial sums cost the same in every design and are left out; what
is counted is the routing op, the depth history it reads (copies into a buffer included) and
the source gradients it produces up to the tensor each sublayer's backward receives.

The floor reads each source once per site in the forward and once in the backward, reads each
site's `dout` once and writes each output once (the site's out in the forward, one gradient per
source it read in the backward): `(3N + 2) M D E` bytes for a site reading N sources.

Designs (M = B*T rows, E = element bytes); `today` and `pull` are built, the rest are the
issue's steps, each adding one change to the one before, modelled to decide what to build:

- `today`: the list-of-tensors kernels (kernels/depth_read/triton.py): two backward passes over
  the sources, one gradient tensor per (site, source) pair summed by autograd (an in-place add
  reads two and writes one), float32 weights and inverse RMS saved for the backward;
- `history`: the same kernels reading a preallocated `[N_max, M, D]` buffer (each source copied
  in once: read E + write E) instead of an address table; same bytes plus the copies;
- `+inplace`: gradients accumulated in a float32 `[N_max, M, D]` buffer (zeroed once; each
  (site, source) pair reads and writes 4 bytes; each source's row handed to its sublayer as one
  float32 read and one E write), no per-site gradient tensors and no autograd sum;
- `+onepass`: the backward reads each source once, taking `S_h = <dout_h, out_h>` from the saved
  out (E per site) and the weights from the saved log-sum-exp (float32 [M, H] per site); no
  weights or RMS written unless recorded;
- `+prelogits`: precomputed logits for static queries: each source's logits for every later site
  written once as float32 `[M, H]` per (site, source) pair and read by the forward (and the
  backward) instead of being recomputed from the source, which the weighted sum reads anyway;
- `pull` (kept, kernels/depth_history): the history buffer and the one-pass backward, but no
  gradient is accumulated: each site's backward stores its `dout` (E) and its float32 dlogits
  ([M, H] per pair) and writes no source gradient; a source's gradient is formed once, when
  complete, by a transposed depth read over the later sites' douts (E per pair, the weights
  recomputed from the source and each site's log-sum-exp) plus one read of the source and one E
  write; the dout and dlogit tables are zeroed once, so a site whose read got no gradient adds
  nothing. Per (site, source) pair it moves 6 E bytes like the floor; the in-place float32
  accumulation moves 2 E + 8 for the same pair, which is why `+inplace` cannot reach the floor.

FLOPs (per pair, in units of M*D): forward RMS 2, logit 2, weighted sum 2; backward one-pass
recomputes RMS and logit (4), dot with dout 2, key gradient 6, value gradient 1, query
partials 2. Precomputed logits save the forward RMS and logit of every pair but one (4 per pair)
and move them into one `[M, D] x [D, sites]` product per source.

    python bench/traffic_model.py                     # gpt2-124m, B16 x T1024, bf16, H = 1 and 8
    python bench/traffic_model.py --batch 8 --block-size 6
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

DESIGNS = ("today", "history", "+inplace", "+onepass", "+prelogits", "pull")
KEPT = "pull"


@dataclass(frozen=True)
class Shape:
    rows: int  # M = B*T
    dim: int  # D
    heads: int  # H
    elem: int  # E, bytes per element of the model dtype


def site_sources(variant: str, n_layers: int, block_size: int = 4) -> list[int]:
    """N, the sources each routing site reads (2L sublayer sites, then the final readout)."""
    sites = 2 * n_layers
    if variant in ("attnres", "mhar"):
        return [s + 1 for s in range(sites + 1)]
    if variant == "block_attnres":
        # the embedding, every completed block, and the current partial block when non-empty
        return [1 + s // block_size + (1 if s % block_size else 0) for s in range(sites + 1)]
    raise ValueError(f"variant: {variant!r} is not modelled; allowed: attnres, block_attnres, mhar")


def readers(ns: list[int]) -> list[int]:
    """K per written source: how many sites read it (sources in write order)."""
    return [sum(1 for n in ns if n > i) for i in range(max(ns))]


def floor_bytes(ns: list[int], s: Shape) -> int:
    plane = s.rows * s.dim * s.elem
    return sum((3 * n + 2) * plane for n in ns)


def design_bytes(design: str, ns: list[int], s: Shape, n_written: int) -> int:
    """Bytes one training step's routing reads and writes under `design`.

    `n_written`: sources written into the history (Block writes every partial state too).
    """
    if design not in DESIGNS:
        raise ValueError(f"design: {design!r} is unknown; allowed: {', '.join(DESIGNS)}")
    t = s.rows * s.dim
    e = s.elem
    pairs = sum(ns)
    small = 4 * s.rows  # one float32 per row
    fwd = pairs * t * e + len(ns) * t * e  # sources, out
    if design in ("today", "history", "+inplace"):
        fwd += pairs * small * (s.heads + 1)  # weights and inverse RMS written
        bwd = len(ns) * t * e  # dout
        bwd += 2 * pairs * t * e  # two passes over the sources
        bwd += pairs * small * (2 * s.heads + 1)  # weights read in both passes, RMS in the second
    else:
        fwd += len(ns) * small * s.heads  # log-sum-exp written
        bwd = len(ns) * (2 * t * e + small * s.heads)  # dout, saved out, log-sum-exp
        bwd += pairs * t * e  # one pass over the sources
    if design in ("today", "history"):
        bwd += pairs * t * e  # one gradient per (site, source) pair
        bwd += sum(max(k - 1, 0) for k in readers(ns)) * 3 * t * e  # autograd's in-place adds
    if design != "today":
        fwd += n_written * 2 * t * e  # each source copied into the buffer once
    if design in ("+inplace", "+onepass", "+prelogits"):
        bwd += n_written * 4 * t  # zero the float32 gradient buffer
        bwd += pairs * 8 * t  # read-modify-write of a float32 row per pair
        bwd += n_written * (4 + e) * t  # hand-off: float32 read, model-dtype write
    if design == "+prelogits":
        logits = pairs * small * s.heads
        fwd += 2 * logits  # each pair's logits written once (at the source's write) and read by the site
        bwd += logits  # and read again by the backward
    if design == "pull":
        fwd += len(ns) * (t * e + n_written * small * s.heads)  # dout and dlogit tables zeroed at allocation
        bwd += len(ns) * t * e  # each site's dout stored for the later pull
        bwd += pairs * small * s.heads * 3  # dlogits written by the site and read by the pull, log-sum-exp read
        bwd += pairs * t * e  # the pull reads one dout per (site, source) pair
        bwd += n_written * 2 * t * e  # the pull reads the source once and writes its gradient once
    return fwd + bwd


def design_flops(design: str, ns: list[int], s: Shape) -> int:
    """Arithmetic of the routing per step (multiply-adds count 2), in FLOPs."""
    t = s.rows * s.dim
    pairs = sum(ns)
    fwd = 6 * pairs * t
    bwd = (17 if design in ("+onepass", "+prelogits", "pull") else 19) * pairs * t
    if design == "+prelogits":
        sources = len(readers(ns))
        fwd += -4 * pairs * t + 2 * sources * t  # logits in one product per source, RMS once per source
    return fwd + bwd


def table(variant: str, ns: list[int], s: Shape, n_written: int) -> list[dict]:
    floor = floor_bytes(ns, s)
    rows = []
    for d in DESIGNS:
        b = design_bytes(d, ns, s, n_written)
        rows.append({"variant": variant, "H": s.heads, "design": d, "GB": b / 1e9, "x_floor": b / floor,
                     "GFLOP": design_flops(d, ns, s) / 1e9, "floor_GB": floor / 1e9})
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--block-size", type=int, default=3, help="sublayers per block (24 / 8 blocks, as bench_training)")
    p.add_argument("--elem", type=int, default=2, help="bytes per element of the model dtype (bf16: 2)")
    args = p.parse_args(argv)
    rows = args.batch * args.seq
    cases = [("attnres", 1), ("block_attnres", 1), ("mhar", 8)]
    print(f"# depth-read memory traffic per training step: B={args.batch} T={args.seq} D={args.dim} "
          f"L={args.layers} E={args.elem} (block_size={args.block_size})\n")
    print("| variant | H | sites | pairs | design | GB / step | x floor | GFLOP / step |")
    print("|---|---|---|---|---|---|---|---|")
    for variant, heads in cases:
        ns = site_sources(variant, args.layers, args.block_size)
        shape = Shape(rows, args.dim, heads, args.elem)
        for r in table(variant, ns, shape, n_written=2 * args.layers + 1):
            mark = " (kept)" if r["design"] == KEPT else ""
            print(f"| {variant} | {heads} | {len(ns)} | {sum(ns)} | {r['design']}{mark} | {r['GB']:.2f} | "
                  f"{r['x_floor']:.2f} | {r['GFLOP']:.1f} |")
        print(f"| {variant} | {heads} | {len(ns)} | {sum(ns)} | floor | {floor_bytes(ns, shape) / 1e9:.2f} | 1.00 | |")


if __name__ == "__main__":
    main()
