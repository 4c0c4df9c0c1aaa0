"""Triton kernels of the GPU backend: RoPE with the K/V write, and row attention through block tables.

The same semantics as the CPU kernel (tailrl/kernels/_attention.cpp): query t sees its row's
positions [0, prefix[t]) then extra[estart[t] : estart[t] + ecount[t]], read through the row's
block table from the pool (keys [blocks, KV, BLOCK * D] in [D/2][BLOCK][2] blocks, values
[blocks, KV, BLOCK, D]). One program per (query token, KV head) runs an online softmax over
its visible keys in blocks of BLOCK visible positions, in order; nothing it computes depends
on another program, on the number of tokens or on where the blocks lie (row-invariant by
construction: the launch configuration is fixed, never tuned per batch).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rope_write_kernel(qkv_ptr, qkv_s0, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_ptr, k_ptr, v_ptr,
                      k_s0, k_s1, v_s0, v_s1,
                      H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    """Program (t, h): head h of token t. Query heads (h < H) rotated into q [N, H, D]
    (float32, as the attention reads them); key heads rotated into the pool at the token's
    slot, value heads copied there."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    half: tl.constexpr = D // 2
    row = qkv_ptr + t * qkv_s0
    if h < H + KV:
        p = tl.load(pos_ptr + t)
        x = tl.load(row + h * D + d).to(tl.float32)
        partner = tl.load(row + h * D + (d + half) % D).to(tl.float32)
        c = tl.load(cos_ptr + p * D + d)
        s = tl.load(sin_ptr + p * D + d)
        y = x * c + tl.where(d < half, -partner, partner) * s
        if h < H:
            tl.store(q_ptr + (t * H + h) * D + d, y)
        else:
            slot = tl.load(slot_ptr + t)
            blk = slot // BLOCK
            lane = slot % BLOCK
            kh = h - H
            koff = blk * k_s0 + kh * k_s1 + (d // 2) * (2 * BLOCK) + lane * 2 + d % 2
            tl.store(k_ptr + koff, y.to(k_ptr.dtype.element_ty))
    else:
        kh = h - H - KV
        slot = tl.load(slot_ptr + t)
        blk = slot // BLOCK
        lane = slot % BLOCK
        val = tl.load(row + (H + KV + kh) * D + d)
        tl.store(v_ptr + blk * v_s0 + kh * v_s1 + lane * D + d, val)


@triton.jit
def attend_kernel(q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, qrow_ptr, prefix_ptr, estart_ptr, ecount_ptr, extra_ptr,
                  k_s0, k_s1, v_s0, v_s1, o_s0, t_s0, scale,
                  H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    """Program (t, kh): the G query heads of KV head kh of token t (padded to GP rows)."""
    t = tl.program_id(0)
    kh = tl.program_id(1)
    row = tl.load(qrow_ptr + t)
    pre = tl.load(prefix_ptr + t)
    es = tl.load(estart_ptr + t)
    total = pre + tl.load(ecount_ptr + t)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    j = tl.arange(0, BLOCK)
    gm = g < G
    q = tl.load(q_ptr + (t * H + kh * G + g[:, None]) * D + d[None, :], mask=gm[:, None], other=0.0) * scale
    m = tl.full([GP], float("-inf"), tl.float32)
    l = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for b0 in range(0, total, BLOCK):
        vis = b0 + j                                            # visible indices of this block
        ok = vis < total
        ex = tl.load(extra_ptr + es + vis - pre, mask=ok & (vis >= pre), other=0)
        pos = tl.where(vis < pre, vis, ex)
        blk = tl.load(table_ptr + row * t_s0 + pos // BLOCK, mask=ok, other=0).to(tl.int64)   # no overflow: big pools
        lane = pos % BLOCK
        koff = blk[:, None] * k_s0 + kh * k_s1 + (d[None, :] // 2) * (2 * BLOCK) + lane[:, None] * 2 + d[None, :] % 2
        k = tl.load(k_ptr + koff, mask=ok[:, None], other=0.0).to(tl.float32)           # [BLOCK, D]
        s = tl.dot(q, tl.trans(k), input_precision="ieee")                               # [GP, BLOCK]
        s = tl.where(ok[None, :], s, float("-inf"))
        mnew = tl.maximum(m, tl.max(s, 1))
        c = tl.exp(m - mnew)
        p = tl.exp(s - mnew[:, None])
        l = l * c + tl.sum(p, 1)
        voff = blk[:, None] * v_s0 + kh * v_s1 + lane[:, None] * D + d[None, :]
        v = tl.load(v_ptr + voff, mask=ok[:, None], other=0.0).to(tl.float32)            # [BLOCK, D]
        acc = acc * c[:, None] + tl.dot(p, v, input_precision="ieee")
        m = mnew
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + t * o_s0 + (kh * G + g[:, None]) * D + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=gm[:, None])
