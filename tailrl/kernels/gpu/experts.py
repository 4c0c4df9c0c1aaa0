"""A mixture of experts' routed products in Triton, grouped by expert on the device.

A step's (token, j) pairs (each token's j-th expert of its k) are sorted by expert (stably: by
pair within an expert) and dealt into blocks of at most ``BM`` pairs of one expert each; a
program computes one block's rows of one tile of ``BN`` output columns, reading that expert's
weights once for its rows. Where the blocks start, which expert each holds and how many pairs,
are computed by PyTorch operations on the device (a sort, a scatter-add, prefix sums, a
search): no host synchronisation, so a step through it can be captured into a CUDA graph. The
grid is the most blocks any routing can need (``ceil(P / BM) + min(E, P)``); the blocks a step
does not use return at once.

Batch invariance: a pair's output element is its row of x times its expert's weight column,
summed over K in BK chunks in order, ``tl.dot`` on a tile whose other rows (other pairs of the
same expert) change nothing in it, as in matmul.py; no split of K. So a token's experts compute
the same bits alone or among any others.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tailrl.kernels.gpu.matmul import WIDEN, dot_add

BM, BN, BK, WARPS, STAGES = 16, 64, 128, 4, 3


@triton.jit
def expert_rows_kernel(x_ptr, w_ptr, y_ptr, pairs_ptr, expert_ptr, start_ptr, count_ptr, N, K, DIV, x_s0, w_se,
                       w_s0, IEEE: tl.constexpr, WIDEN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr):
    """Program (block b, n tile): for the block's pairs p (``pairs_ptr[start:start + count]``),
    y[p, tile] = x[p // DIV] @ w[expert]^T over the tile's columns, float32 sums rounded once."""
    b, pn = tl.program_id(0), tl.program_id(1)
    count = tl.load(count_ptr + b)
    if count > 0:
        e = tl.load(expert_ptr + b).to(tl.int64)
        i = tl.arange(0, BM)
        ok_m = i < count
        pair = tl.load(pairs_ptr + tl.load(start_ptr + b) + i, mask=ok_m, other=0).to(tl.int64)
        src = pair // DIV
        rn = pn * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros([BM, BN], tl.float32)
        for k in range(0, K, BK):
            kk = k + rk
            x = tl.load(x_ptr + src[:, None] * x_s0 + kk[None, :], mask=ok_m[:, None] & (kk[None, :] < K), other=0.0)
            w = tl.load(w_ptr + e * w_se + rn[None, :] * w_s0 + kk[:, None],
                        mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
            acc = dot_add(acc, x, w, IEEE, WIDEN)
        tl.store(y_ptr + pair[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=ok_m[:, None] & (rn[None, :] < N))


def expert_blocks(ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, ...]:
    """For each token's experts ``ids`` [T, k]: the pairs sorted by expert [T * k], and per block
    slot (``ceil(P / BM) + min(E, P)`` of them) its expert, its first place in that order and its
    pair count (0: unused). Device operations only."""
    flat = ids.reshape(-1)
    p = flat.numel()
    pairs = torch.argsort(flat, stable=True)
    counts = torch.zeros(experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + BM - 1) // BM
    blocks_end, rows_end = torch.cumsum(blocks, 0), torch.cumsum(counts, 0)
    slot = torch.arange(triton.cdiv(p, BM) + min(experts, p), device=ids.device)
    e = torch.searchsorted(blocks_end, slot, right=True).clamp_(max=experts - 1)
    local = slot - (blocks_end[e] - blocks[e])                 # the block's place among its expert's
    count = (counts[e] - local * BM).clamp_(0, BM)             # 0 past the last block (local >= blocks[e])
    start = rows_end[e] - counts[e] + local * BM
    return pairs, e, start, count


def expert_products(x: torch.Tensor, w: torch.Tensor, blocks: tuple[torch.Tensor, ...], pairs: int,
                    div: int) -> torch.Tensor:
    """y [pairs, N]: each pair p's row x[p // div] times its expert's weight w[e] [N, K]^T, in
    x's dtype (``blocks``: ``expert_blocks``)."""
    order, expert, start, count = blocks
    n, k = w.shape[1], w.shape[2]
    y = torch.empty(pairs, n, dtype=x.dtype, device=x.device)
    if pairs:
        expert_rows_kernel[(count.shape[0], triton.cdiv(n, BN))](
            x, w, y, order, expert, start, count, n, k, div, x.stride(0), w.stride(0), w.stride(1),
            IEEE=x.dtype == torch.float32, WIDEN=WIDEN, BM=BM, BN=BN, BK=BK, num_warps=WARPS, num_stages=STAGES)
    return y
