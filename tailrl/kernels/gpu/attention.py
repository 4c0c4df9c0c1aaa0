"""Triton kernels of the GPU backend: RoPE with the K/V write, and row attention through block tables.

The same semantics as the CPU kernel (tailrl/kernels/_attention.cpp): query t sees its row's
positions [0, prefix[t]) then extra[estart[t] : estart[t] + ecount[t]], read through the row's
block table from the pool (keys [blocks, KV, BLOCK * D] in [D/2][BLOCK][2] blocks, values
[blocks, KV, BLOCK, D]). A query's visible positions, in chunks of ``KEYS`` (a multiple of the
pool's BLOCK: one step of a lane's walk gathers KEYS keys through the block table at once), are
dealt to ``LANES`` lanes in turn (chunk c to lane c mod LANES); each lane runs an online
softmax over its chunks in order, and the lanes' states are merged in lane order. Either one program per
(query token, KV head) runs every lane itself (``WHOLE``: steps with programs enough to fill
the GPU), or one program per lane stores its state and a second kernel merges them (few
tokens: a decode step of one row reads its context with LANES x KV programs instead of KV,
each walking 1/LANES of it). The two are the same arithmetic in the same order (the same
functions, float32 states stored and read back exactly), so a query's bits depend on its own
row alone: not on another program, on the number of tokens, on the mode, or on where the
blocks lie (row-invariant by construction).
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
def _lane(q, k_ptr, v_ptr, table_ptr, extra_ptr, row, pre, es, total, kh, lane, k_s0, k_s1, v_s0, v_s1, t_s0,
          LANES: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, KEYS: tl.constexpr):
    """Online softmax of q [GP, D] over the visible chunks lane, lane + LANES, lane + 2 LANES, ...
    (KEYS visible positions each), in order: (max [GP], sum [GP], weighted values [GP, D])."""
    d = tl.arange(0, D)
    j = tl.arange(0, KEYS)
    m = tl.full([GP], float("-inf"), tl.float32)
    l = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for b0 in range(lane * KEYS, total, LANES * KEYS):
        vis = b0 + j                                            # visible indices of this chunk
        ok = vis < total
        ex = tl.load(extra_ptr + es + vis - pre, mask=ok & (vis >= pre), other=0)
        pos = tl.where(vis < pre, vis, ex)
        blk = tl.load(table_ptr + row * t_s0 + pos // BLOCK, mask=ok, other=0).to(tl.int64)   # no overflow: big pools
        lane_pos = pos % BLOCK
        koff = (blk[:, None] * k_s0 + kh * k_s1 + (d[None, :] // 2) * (2 * BLOCK) + lane_pos[:, None] * 2
                + d[None, :] % 2)
        k = tl.load(k_ptr + koff, mask=ok[:, None], other=0.0).to(tl.float32)           # [KEYS, D]
        s = tl.dot(q, tl.trans(k), input_precision="ieee")                               # [GP, KEYS]
        s = tl.where(ok[None, :], s, float("-inf"))
        mnew = tl.maximum(m, tl.max(s, 1))
        c = tl.exp(m - mnew)
        p = tl.exp(s - mnew[:, None])
        l = l * c + tl.sum(p, 1)
        voff = blk[:, None] * v_s0 + kh * v_s1 + lane_pos[:, None] * D + d[None, :]
        v = tl.load(v_ptr + voff, mask=ok[:, None], other=0.0).to(tl.float32)            # [KEYS, D]
        acc = acc * c[:, None] + tl.dot(p, v, input_precision="ieee")
        m = mnew
    return m, l, acc


@triton.jit
def _merge(m, l, acc, m2, l2, acc2):
    """Two softmax states over disjoint keys as one; an empty one (max -inf) changes nothing."""
    mn = tl.maximum(m, m2)
    live = mn > float("-inf")
    a = tl.where(live, tl.exp(m - mn), 0.0)
    b = tl.where(live, tl.exp(m2 - mn), 0.0)
    return mn, l * a + l2 * b, acc * a[:, None] + acc2 * b[:, None]


@triton.jit
def _store(out_ptr, o_s0, t, kh, l, acc, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr):
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + t * o_s0 + (kh * G + g[:, None]) * D + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(g < G)[:, None])


@triton.jit
def attend_kernel(q_ptr, k_ptr, v_ptr, out_ptr, part_ptr, table_ptr, qrow_ptr, prefix_ptr, estart_ptr, ecount_ptr,
                  extra_ptr, k_s0, k_s1, v_s0, v_s1, o_s0, t_s0, scale,
                  H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                  KEYS: tl.constexpr, LANES: tl.constexpr, WHOLE: tl.constexpr):
    """Program (t, kh[, lane]): the G query heads of KV head kh of token t (padded to GP rows).
    ``WHOLE``: every lane here, merged in lane order, and the result stored; else this lane's
    state stored in part [N, KV, LANES, GP, D + 2] (values, max, sum) for merge_kernel."""
    t = tl.program_id(0)
    kh = tl.program_id(1)
    row = tl.load(qrow_ptr + t)
    pre = tl.load(prefix_ptr + t)
    es = tl.load(estart_ptr + t)
    total = pre + tl.load(ecount_ptr + t)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (t * H + kh * G + g[:, None]) * D + d[None, :], mask=(g < G)[:, None], other=0.0) * scale
    if WHOLE:
        m = tl.full([GP], float("-inf"), tl.float32)
        l = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for lane in range(0, LANES):
            m2, l2, acc2 = _lane(q, k_ptr, v_ptr, table_ptr, extra_ptr, row, pre, es, total, kh, lane,
                                 k_s0, k_s1, v_s0, v_s1, t_s0, LANES, GP, D, BLOCK, KEYS)
            m, l, acc = _merge(m, l, acc, m2, l2, acc2)
        _store(out_ptr, o_s0, t, kh, l, acc, G, GP, D)
    else:
        lane = tl.program_id(2)
        m, l, acc = _lane(q, k_ptr, v_ptr, table_ptr, extra_ptr, row, pre, es, total, kh, lane,
                          k_s0, k_s1, v_s0, v_s1, t_s0, LANES, GP, D, BLOCK, KEYS)
        base = part_ptr + ((t * tl.num_programs(1) + kh) * LANES + lane) * GP * (D + 2)
        tl.store(base + g[:, None] * (D + 2) + d[None, :], acc)
        tl.store(base + g * (D + 2) + D, m)
        tl.store(base + g * (D + 2) + D + 1, l)


@triton.jit
def merge_kernel(part_ptr, out_ptr, o_s0, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                 LANES: tl.constexpr):
    """Program (t, kh): attend_kernel's lane states merged in lane order (as WHOLE merges them).
    The loop is unrolled, so that the lanes' loads need not wait for one another's merges."""
    t = tl.program_id(0)
    kh = tl.program_id(1)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    m = tl.full([GP], float("-inf"), tl.float32)
    l = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for lane in tl.static_range(0, LANES):
        base = part_ptr + ((t * tl.num_programs(1) + kh) * LANES + lane) * GP * (D + 2)
        acc2 = tl.load(base + g[:, None] * (D + 2) + d[None, :])
        m2 = tl.load(base + g * (D + 2) + D)
        l2 = tl.load(base + g * (D + 2) + D + 1)
        m, l, acc = _merge(m, l, acc, m2, l2, acc2)
    _store(out_ptr, o_s0, t, kh, l, acc, G, GP, D)
