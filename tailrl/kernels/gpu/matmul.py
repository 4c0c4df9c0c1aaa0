"""A batch-invariant matmul in Triton: y [M, N] = x [M, K] w[N, K]^T (+ b), float32 accumulation.

Why: cuBLAS picks its kernel (tile shape, split over K) by the problem's M, so a row's bits can
change with the number of rows in the step (measured on an H100, bfloat16: the down projection
of a 0.5B model, [M, 4864] x [4864, 896], differs at M = 65, 256, 512, ...), and a verify step
has more rows than the plain step it replaces. Here an output element's arithmetic depends on
K alone:

- tiles of fixed shape (BM x BN outputs, BK positions of K per ``tl.dot``), whatever M;
- K split into ``splits(N, K)`` ranges fixed per weight shape (more ranges when N has few
  tiles, so that small-M steps still occupy the GPU), each range reduced in order, BK at a
  time;
- the ranges' float32 partial sums added in range order by the tile's last range to finish
  (arrivals.py: no second kernel), which also adds the bias and rounds to the output dtype
  (one range: its program does that itself, the same arithmetic: 0 + x is x); where M alone
  gives tiles enough to occupy the GPU, each program sums its tile's ranges itself, in the
  same order from the same zero (``ALL``): the same bits without the partial sums' trip
  through memory (at M = 2048 on the down projection, 8 ranges: 117 MB written and read back,
  four times the operands' bytes).

So a row computes the same bits alone or in any batch; only the tile it lands in changes, and
the instructions that compute a tile treat its rows alike. The tiles (``TILES``: 64 x 64 outputs,
128 positions of K per step, 4 warps, 3 stages) are the best of six measured on an H100 by
benchmarks/matmul_tiles.py (one forward of the 0.5b stand-in at M = 1, 64, 512 and 2048: 1.10,
1.07, 1.82 and 2.50 times cuBLAS; the previous 16 x 64 x 64 tiles: 1.17, 1.21, 3.49, 5.10), and
one choice per process: ``TAILRL_MATMUL_TILES="BM,BN,BK,WARPS,STAGES"`` sets another (every
engine of the process must use the same, or rows differ between them).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tailrl.kernels.gpu.activation import silu_times
from tailrl.kernels.gpu.arrivals import arrive, counters

MAX_SPLITS = 8
TARGET_PROGRAMS = 132          # an H100's SMs: below this many (N tiles x splits) the GPU idles
WHOLE_PROGRAMS = TARGET_PROGRAMS   # from this many tiles (M tiles x N tiles) a program sums all its ranges


@dataclass(frozen=True)
class Tiles:
    bm: int = 64
    bn: int = 64
    bk: int = 128
    warps: int = 4
    stages: int = 3

    @staticmethod
    def parse(text: str) -> "Tiles":
        try:
            values = [int(v) for v in text.split(",")]
            t = Tiles(*values) if len(values) == 5 else None
        except ValueError:
            t = None
        if t is None or any(v < 16 or v & (v - 1) for v in (t.bm, t.bn, t.bk)) or t.warps not in (1, 2, 4, 8, 16) \
                or not 1 <= t.stages <= 8:
            raise ValueError(f"TAILRL_MATMUL_TILES must be 'BM,BN,BK,WARPS,STAGES' (tile sides powers of two >= 16, "
                             f"warps 1-16, stages 1-8), got {text!r}")
        return t


TILES = Tiles.parse(os.environ["TAILRL_MATMUL_TILES"]) if os.environ.get("TAILRL_MATMUL_TILES") else Tiles()
# Triton's CPU interpreter multiplies bfloat16 tiles as their raw bits: there the tiles are
# widened to float32 first (exact: the products and float32 sums are the same numbers)
WIDEN = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def splits(n: int, k: int, tiles: Tiles = TILES) -> int:
    """Ranges of K for a [N, K] weight: enough N tiles x ranges to occupy the GPU at small M,
    each range at least 4 x BK long; a function of the shape alone."""
    count = -(-n // tiles.bn)
    return max(1, min(MAX_SPLITS, -(-TARGET_PROGRAMS // count), k // (4 * tiles.bk)))


@triton.jit
def range_sum(x_ptr, w_ptr, rm, rn, M, N, K, k0, k1, x_s0, w_s0,
              IEEE: tl.constexpr, WIDEN: tl.constexpr, ACT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
              BK: tl.constexpr):
    """Rows ``rm`` x columns ``rn`` summed over K's range [k0, k1), BK at a time, in order.
    ``ACT``: x's rows are [gate | up], K wide each, and the product reads silu(gate) * up,
    computed as each tile is loaded (activation.silu_times: silu_mul_kernel's bits)."""
    rk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    for k in range(k0, k1, BK):
        kk = k + rk
        xmask = (rm[:, None] < M) & (kk[None, :] < k1)
        x = tl.load(x_ptr + rm[:, None] * x_s0 + kk[None, :], mask=xmask, other=0.0)
        if ACT:
            up = tl.load(x_ptr + rm[:, None] * x_s0 + K + kk[None, :], mask=xmask, other=0.0)
            x = silu_times(x, up, x_ptr.dtype.element_ty)
        w = tl.load(w_ptr + rn[None, :] * w_s0 + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < k1), other=0.0)
        acc = dot_add(acc, x, w, IEEE, WIDEN)
    return acc


@triton.jit
def dot_add(acc, x, w, IEEE: tl.constexpr, WIDEN: tl.constexpr):
    """acc + x @ w, float32 sums: float32 FMA dots where ``IEEE`` (float32 operands), the tiles
    widened first under the interpreter (``WIDEN``), else the dtype's tensor-core dot. Inlined
    where it is called: the same instructions as the add written there."""
    if WIDEN:
        acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    elif IEEE:
        acc += tl.dot(x, w, input_precision="ieee")
    else:
        acc += tl.dot(x, w)
    return acc


# M is never specialised (Triton compiles variants for M == 1 and M % 16 == 0 otherwise): one
# binary per weight shape, whatever the number of rows
@triton.jit(do_not_specialize=["M"])
def partial_kernel(x_ptr, w_ptr, part_ptr, count_ptr, b_ptr, y_ptr, M, N, K, x_s0, w_s0, span, S,
                   IEEE: tl.constexpr, WIDEN: tl.constexpr, FINAL: tl.constexpr, ALL: tl.constexpr,
                   HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr):
    """Program (m tile, n tile, range s): the range's partial sums, in K order, stored in
    part; the tile's last range to finish (arrivals.py: its counter ``count_ptr``, pm * N
    tiles + pn) adds the S ranges' sums in range order from zero, then the bias, and rounds
    them into y. ``FINAL``: the only range: its sums plus the bias, rounded into y (0 + x is
    x: the same arithmetic). ``ALL``: every range in this program, added in the same order:
    the same bits without the partial sums' round trip through memory (for steps with tiles
    enough to occupy the GPU unsplit)."""
    pm, pn, ps = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    if ALL:
        acc = tl.zeros([BM, BN], tl.float32)
        for s in range(0, S):
            acc += range_sum(x_ptr, w_ptr, rm, rn, M, N, K, s * span, tl.minimum(K, s * span + span), x_s0, w_s0,
                             IEEE, WIDEN, ACT, BM, BN, BK)
    else:
        acc = range_sum(x_ptr, w_ptr, rm, rn, M, N, K, ps * span, tl.minimum(K, ps * span + span), x_s0, w_s0,
                        IEEE, WIDEN, ACT, BM, BN, BK)
    ok = (rm[:, None] < M) & (rn[None, :] < N)
    if not (FINAL or ALL):              # this range's sums; the tile's last range to finish adds them all
        tl.store(part_ptr + (ps * M + rm[:, None]) * N + rn[None, :], acc, mask=ok)
        if arrive(count_ptr + pm * tl.num_programs(1) + pn, S):
            acc = tl.zeros([BM, BN], tl.float32)
            for s in range(0, S):
                acc += tl.load(part_ptr + (s * M + rm[:, None]) * N + rn[None, :], mask=ok, other=0.0,
                               cache_modifier=".cg")
            _finish(acc, b_ptr, y_ptr, rm, rn, N, ok, HAS_BIAS)
    else:
        _finish(acc, b_ptr, y_ptr, rm, rn, N, ok, HAS_BIAS)


@triton.jit
def _finish(acc, b_ptr, y_ptr, rm, rn, N, ok, HAS_BIAS: tl.constexpr):
    """The tile's sums plus the bias, rounded once into y."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=ok)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, tiles: Tiles = TILES,
           act: bool = False) -> torch.Tensor:
    """x [M, K] (rows contiguous) @ w [N, K]^T (+ b [N]) -> [M, N] in x's dtype. ``act``: x is
    [M, 2K], rows [gate | up], and the product is silu(gate) * up's (never stored)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape[0], x.shape[1] // 2 if act else x.shape[1]
    if act and x.shape[1] != 2 * k:
        raise ValueError(f"linear: act needs rows [gate | up] of an even width, got {tuple(x.shape)}")
    n = w.shape[0]
    if w.shape[1] != k or w.stride(-1) != 1 or w.dtype != x.dtype:
        raise ValueError(f"linear: x {tuple(x.shape)} {x.dtype} does not fit weight {tuple(w.shape)} {w.dtype}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    bk = tiles.bk
    s = splits(n, k, tiles)
    span = -(-k // (s * bk)) * bk                       # a range: whole BK chunks
    s = -(-k // span)
    tiles_m, tiles_n = triton.cdiv(m, tiles.bm), triton.cdiv(n, tiles.bn)
    whole = s > 1 and tiles_m * tiles_n >= WHOLE_PROGRAMS      # the GPU is full unsplit: sum in place
    split = s > 1 and not whole                                # ranges in programs of their own
    part = torch.empty(s, m, n, dtype=torch.float32, device=x.device) if split else y
    count = counters(x.device, tiles_m * tiles_n) if split else y
    bias = b if b is not None else y
    partial_kernel[(tiles_m, tiles_n, 1 if whole else s)](
        x, w, part, count, bias, y, m, n, k, x.stride(0), w.stride(0), span, s, IEEE=x.dtype == torch.float32,
        WIDEN=WIDEN, FINAL=s == 1, ALL=whole, HAS_BIAS=b is not None, ACT=act, BM=tiles.bm, BN=tiles.bn, BK=bk,
        num_warps=tiles.warps, num_stages=tiles.stages)
    return y
