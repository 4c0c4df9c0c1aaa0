"""Triton kernels of the GPU backend: RoPE with the K/V write, and row attention through block tables.

The same semantics as the CPU kernel (tailrl/kernels/_attention.cpp): query t sees its row's
positions [0, prefix[t]) then extra[estart[t] : estart[t] + ecount[t]], read through the row's
block table from the pool (keys [blocks, KV, BLOCK * D] in [D/2][BLOCK][2] blocks, values
[blocks, KV, BLOCK, D]). A query's visible positions, in chunks of ``KEYS`` (a multiple of the
pool's BLOCK: one step of a lane's walk gathers KEYS keys through the block table at once), are
dealt to ``LANES`` lanes in turn (chunk c to lane c mod LANES); each lane runs an online
softmax over its chunks in order, and the lanes' states are merged in lane order. Either one
program per (query group, KV head) runs every lane itself (``WHOLE``: steps with programs
enough to fill the GPU), or one program per lane stores its state and the group's last lane to
finish merges them all (few tokens: a decode step of one row reads its context with LANES x KV
programs instead of KV, each walking 1/LANES of it; arrivals.py).

A query group (``QT`` > 1, steps where a row has several queries: chains of drafts, prefill
chunks) is up to QT consecutive queries of one row that see their prefixes alone, at
consecutive positions: they walk the row's K/V once, together, instead of once each, every
query masked to its own prefix. A query's arithmetic is the same in a group, alone, in either
mode, in a launch of any size or QT: per element, an exact max, or a dot whose every element
is its own in-order sum (float32 "ieee" dots are FMA loops), and a chunk that a query does not
see leaves its state untouched. So its bits depend on its own row alone (row-invariant by
construction).
"""
from __future__ import annotations

import triton
import triton.language as tl

from tailrl.kernels.gpu.arrivals import arrive
from tailrl.kernels.gpu.rounding import round_to


@triton.jit
def _projected(row, b_ptr, col, HAS_BIAS: tl.constexpr):
    """Elements ``col`` of a token's fused projection, plus the projection's bias where it has
    one, rounded to the projection's dtype as PyTorch's add rounds it (so the bits of a product
    whose bias cuBLAS left to a separate add)."""
    x = tl.load(row + col)
    if HAS_BIAS:
        x = round_to(x.to(tl.float32) + tl.load(b_ptr + col).to(tl.float32), row.dtype.element_ty)
    return x


@triton.jit
def rope_write_kernel(qkv_ptr, qkv_s0, b_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_ptr, k_ptr, v_ptr,
                      k_s0, k_s1, v_s0, v_s1,
                      H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                      HAS_BIAS: tl.constexpr):
    """Program (t, h): head h of token t (plus its bias, ``HAS_BIAS``). Query heads (h < H)
    rotated into q [N, H, D] (float32, as the attention reads them); key heads rotated into the
    pool at the token's slot, value heads copied there."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    half: tl.constexpr = D // 2
    row = qkv_ptr + t * qkv_s0
    if h < H + KV:
        p = tl.load(pos_ptr + t)
        x = _projected(row, b_ptr, h * D + d, HAS_BIAS).to(tl.float32)
        partner = _projected(row, b_ptr, h * D + (d + half) % D, HAS_BIAS).to(tl.float32)
        c = tl.load(cos_ptr + p * D + d)
        s = tl.load(sin_ptr + p * D + d)
        y = x * c + tl.where(d < half, -partner, partner) * s
        if h < H:
            tl.store(q_ptr + (t * H + h) * D + d, y.to(q_ptr.dtype.element_ty))
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
        val = _projected(row, b_ptr, (H + KV + kh) * D + d, HAS_BIAS)
        tl.store(v_ptr + blk * v_s0 + kh * v_s1 + lane * D + d, val)


@triton.jit
def _dot16(a, b, WIDEN: tl.constexpr):
    """a @ b of 16-bit floats on tensor cores, float32 sums. ``WIDEN``: as float32 FMA dots
    instead (the same products, exact in float32), for Triton's interpreter, whose dot of
    bfloat16 multiplies the values' bits as integers (triton 3.9.0)."""
    if WIDEN:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _soft_cap(s, cap):
    """cap * tanh(s / cap) of each element alone (Gemma 2's scores), tanh from one exponential
    (Triton's interpreter has no tanh): sign(x) (1 - e) / (1 + e), e = exp(-2 |x|)."""
    x = s / cap
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(x < 0, -t, t)


@triton.jit
def _lane(q, rtot, rlo, k_ptr, v_ptr, table_ptr, extra_ptr, row, pre, es, total, kh, lane, k_s0, k_s1, v_s0, v_s1,
          t_s0, scale, softcap, LANES: tl.constexpr, MP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
          KEYS: tl.constexpr, TC: tl.constexpr, WIDEN: tl.constexpr, WINDOW: tl.constexpr, CAP: tl.constexpr):
    """Online softmax of the query rows q [MP, D] over the walk's chunks lane, lane + LANES,
    lane + 2 LANES, ... (KEYS visible indices each, of ``total``: the positions [0, pre), then
    extra[es:]), in order: (max [MP], sum [MP], weighted values [MP, D]); ``CAP``: the scores
    soft-capped at ``softcap`` (``_soft_cap``) before the softmax. Row r sees the indices
    below rtot[r] (``WINDOW``: and from rlo[r] on, a sliding window's origin; the walk skips the
    lane's chunks below every row's); in a chunk where it sees none its state is kept as it was,
    so its bits are those of a walk that stopped at its own end. Every operation is either per element, an
    exact max, or a dot, whose every element is its own sum over K in order: the FMA dot of
    float32 at "ieee" precision, or (``TC``: q, K and V in the pool's 16-bit dtype, the
    weights rounded to it) tensor cores' mma.sync m16n8k16 with float32 sums, the same
    instructions in the same order at any MP below 64 (wgmma, Hopper's other form, needs
    tiles of 64 rows: the backend keeps MP at 32 or fewer). A row's bits do not depend on the
    other rows or on MP."""
    d = tl.arange(0, D)
    j = tl.arange(0, KEYS)
    if TC:
        ones = tl.full([KEYS, 16], 1.0, k_ptr.dtype.element_ty)
    else:
        ones = tl.full([KEYS, 16], 1.0, tl.float32)
    m = tl.full([MP], float("-inf"), tl.float32)
    l = tl.zeros([MP], tl.float32)
    acc = tl.zeros([MP, D], tl.float32)
    start = lane * KEYS
    if WINDOW:                          # the lane's first chunk (c = lane mod LANES) at or above the lowest origin
        c_lo = tl.min(rlo, 0) // KEYS
        start = (c_lo + (lane + LANES - c_lo % LANES) % LANES) * KEYS
    for b0 in range(start, total, LANES * KEYS):
        vis = b0 + j                                            # visible indices of this chunk
        ok = vis < total
        ex = tl.load(extra_ptr + es + vis - pre, mask=ok & (vis >= pre), other=0)
        pos = tl.where(vis < pre, vis, ex)
        blk = tl.load(table_ptr + row * t_s0 + pos // BLOCK, mask=ok, other=0).to(tl.int64)   # no overflow: big pools
        lane_pos = pos % BLOCK
        koff = (blk[:, None] * k_s0 + kh * k_s1 + (d[None, :] // 2) * (2 * BLOCK) + lane_pos[:, None] * 2
                + d[None, :] % 2)
        k = tl.load(k_ptr + koff, mask=ok[:, None], other=0.0)                           # [KEYS, D]
        if TC:
            s = _dot16(q, tl.trans(k), WIDEN) * scale                                    # [MP, KEYS]
        else:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")            # q holds the scale
        if CAP:
            s = _soft_cap(s, softcap)
        see = ok[None, :] & (vis[None, :] < rtot[:, None])
        live = b0 < rtot                                        # rows that see some of this chunk
        if WINDOW:
            see = see & (vis[None, :] >= rlo[:, None])
            live = live & (b0 + KEYS > rlo)
        s = tl.where(see, s, float("-inf"))
        mnew = tl.where(live, tl.maximum(m, tl.max(s, 1)), m)
        mref = tl.where(live, mnew, 0.0)                        # live rows' max is finite; others: no NaN
        c = tl.where(live, tl.exp(m - mref), 1.0)
        p = tl.where(see, tl.exp(s - mref[:, None]), 0.0)
        # the row sums as a dot (each its own sum in order), not tl.sum: a reduction's order follows
        # the tile's layout, which changes with MP
        voff = blk[:, None] * v_s0 + kh * v_s1 + lane_pos[:, None] * D + d[None, :]
        v = tl.load(v_ptr + voff, mask=ok[:, None], other=0.0)                           # [KEYS, D]
        if TC:                          # the weights as the values' dtype: sums and values from the same
            p = p.to(v.dtype)
            pv = _dot16(p, v, WIDEN)
            ps = _dot16(p, ones, WIDEN)
        else:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            ps = tl.dot(p, ones, input_precision="ieee")
        l = tl.where(live, l * c + tl.max(ps, 1), l)
        acc = tl.where(live[:, None], acc * c[:, None] + pv, acc)
        m = mnew
    return m, l, acc


@triton.jit
def _merge(m, l, acc, m2, l2, acc2):
    """Two softmax states over disjoint keys as one; an empty one (max -inf) changes nothing."""
    mn = tl.maximum(m, m2)
    live = mn > float("-inf")
    ref = tl.where(live, mn, 0.0)                               # no -inf - -inf where both are empty
    a = tl.where(live, tl.exp(m - ref), 0.0)
    b = tl.where(live, tl.exp(m2 - ref), 0.0)
    return mn, l * a + l2 * b, acc * a[:, None] + acc2 * b[:, None]


@triton.jit
def _merge_stored(state, valid, MP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, LANES: tl.constexpr):
    """The LANES states stored from ``state`` (lane 0's, per row; lanes GP * (D + 2) apart),
    merged in lane order, read at L2 (arrivals.py). Unrolled: the loads need not wait for the
    merges. Returns (max, sum, weighted values)."""
    d = tl.arange(0, D)
    m = tl.full([MP], float("-inf"), tl.float32)
    l = tl.zeros([MP], tl.float32)
    acc = tl.zeros([MP, D], tl.float32)
    for lane in tl.static_range(0, LANES):
        at = state + lane * GP * (D + 2)
        acc2 = tl.load(at[:, None] + d[None, :], mask=valid[:, None], other=0.0, cache_modifier=".cg")
        m2 = tl.load(at + D, mask=valid, other=float("-inf"), cache_modifier=".cg")
        l2 = tl.load(at + D + 1, mask=valid, other=0.0, cache_modifier=".cg")
        m, l, acc = _merge(m, l, acc, m2, l2, acc2)
    return m, l, acc


@triton.jit
def _with_sink(m, l, acc, sinks_ptr, head, valid):
    """A softmax state (max, sum, weighted values) with its head's sink (gpt-oss's) joined: one
    more score, weighing no value. Returns (sum, weighted values)."""
    s = tl.load(sinks_ptr + head, mask=valid, other=0.0).to(tl.float32)
    mn = tl.maximum(m, s)
    c = tl.exp(m - mn)                                          # 0 where the state is empty (m -inf)
    return l * c + tl.exp(s - mn), acc * c[:, None]


@triton.jit
def _store(out_ptr, o_s0, token, head, m, l, acc, valid, sinks_ptr, D: tl.constexpr, SINK: tl.constexpr):
    """Rows (token, head) of the attention's output: the weighted values over their sums (``SINK``:
    with the head's sink joined first, ``_with_sink``)."""
    if SINK:
        l, acc = _with_sink(m, l, acc, sinks_ptr, head, valid)
    d = tl.arange(0, D)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + token[:, None] * o_s0 + head[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=valid[:, None])


@triton.jit
def _group(qrow_ptr, prefix_ptr, ecount_ptr, t, n, QT: tl.constexpr):
    """How many tokens program t attends for: 0 where token t continues the group of the token
    before it, else its group's size. Token u continues u - 1 where both are in one row, see
    their prefixes alone (no extra), and u's prefix is one more and not a multiple of QT (a
    chain of drafts, a prefill chunk: groups of up to QT tokens, aligned to positions)."""
    if QT == 1:
        count = 1
    else:
        i = tl.arange(0, QT)
        w = t - 1 + i                                           # the token before t, then t's window
        inw = (w >= 0) & (w < n)
        wrow = tl.load(qrow_ptr + w, mask=inw, other=-1)
        wpre = tl.load(prefix_ptr + w, mask=inw, other=-1)
        wec = tl.load(ecount_ptr + w, mask=inw, other=1)
        inx = t + i < n
        xrow = tl.load(qrow_ptr + t + i, mask=inx, other=-1)
        xpre = tl.load(prefix_ptr + t + i, mask=inx, other=-1)
        xec = tl.load(ecount_ptr + t + i, mask=inx, other=1)
        # cont[i]: token t + i continues token t + i - 1 (i = 0: t continues the token before it)
        cont = inx & inw & (xrow == wrow) & (xec == 0) & (wec == 0) & (xpre == wpre + 1) & (xpre % QT != 0)
        continues = tl.max(tl.where(i == 0, cont.to(tl.int32), 0), 0)
        size = tl.min(tl.where(cont | (i == 0), QT, i), 0)      # t, then the tokens that continue it
        count = tl.where(continues > 0, 0, size)
    return count


# n (the step's tokens) is never specialised: one binary whatever a step's size (Triton would
# compile variants for n == 1 and n % 16 == 0; an eager step of a new kind compiled in the rollout)
@triton.jit(do_not_specialize=["n"])
def attend_kernel(q_ptr, k_ptr, v_ptr, out_ptr, part_ptr, count_ptr, table_ptr, qrow_ptr, prefix_ptr, estart_ptr,
                  ecount_ptr, extra_ptr, origin_ptr, sinks_ptr, k_s0, k_s1, v_s0, v_s1, o_s0, t_s0, n, scale,
                  softcap, H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, MP: tl.constexpr, D: tl.constexpr,
                  BLOCK: tl.constexpr, KEYS: tl.constexpr, LANES: tl.constexpr, QT: tl.constexpr,
                  WHOLE: tl.constexpr, TC: tl.constexpr, WIDEN: tl.constexpr, WINDOW: tl.constexpr,
                  CAP: tl.constexpr, SINK: tl.constexpr):
    """Program (t, kh[, lane]): token t's group (``_group``: t alone where QT is 1, or t and
    the tokens of its row's chain or prefill that follow it, up to QT; nothing where t is not
    the first of its group), the G query heads of KV head kh of each of its tokens as rows
    i * G + g of one tile of MP rows. They walk the row's positions once, together, each
    masked to its own. ``WHOLE``: every lane here, merged in lane order, and the results stored;
    else this lane's states stored in part [N, KV, LANES, GP, D + 2] (values, max, sum), and the
    group's last lane to arrive at its counter (``count_ptr``, t * KV + kh) merges the LANES
    states in lane order, as WHOLE does, and stores the results. ``WINDOW``: each token sees no
    position of its prefix below its origin (``origin_ptr`` [N] int32, a sliding window's).
    ``CAP``: scores soft-capped at ``softcap`` (Gemma 2's). ``SINK``: each head's sink
    (``sinks_ptr`` [H], gpt-oss's) joined to the merged state before the store."""
    t = tl.program_id(0)
    kh = tl.program_id(1)
    row = tl.load(qrow_ptr + t)
    es = tl.load(estart_ptr + t)
    ec = tl.load(ecount_ptr + t)
    count = _group(qrow_ptr, prefix_ptr, ecount_ptr, t, n, QT)
    if count > 0:
        r = tl.arange(0, MP)
        i = r // G                                              # the row's token (t + i) and head (g)
        g = r % G
        valid = (i < count) & (r < QT * G)
        d = tl.arange(0, D)
        q = tl.load(q_ptr + ((t + i[:, None]) * H + kh * G + g[:, None]) * D + d[None, :], mask=valid[:, None],
                    other=0.0)
        if not TC:                                              # float32 q: the scale applied once, here
            q = q * scale
        # a row sees its token's prefix, then its extras (a token with extras is alone)
        rtot = tl.where(valid, tl.load(prefix_ptr + t + i, mask=valid, other=0) + ec, 0)
        total = tl.max(rtot, 0)
        walk_pre = total - ec                                   # the walk's positions: [0, walk_pre), then extras
        # an origin past the prefix hides the prefix; rows past the group's: past every chunk
        if WINDOW:
            rlo = tl.where(valid, tl.minimum(tl.load(origin_ptr + t + i, mask=valid, other=0), rtot - ec), total)
        else:
            rlo = tl.zeros([MP], tl.int32)
        if WHOLE:
            m = tl.full([MP], float("-inf"), tl.float32)
            l = tl.zeros([MP], tl.float32)
            acc = tl.zeros([MP, D], tl.float32)
            for lane in range(0, LANES):
                m2, l2, acc2 = _lane(q, rtot, rlo, k_ptr, v_ptr, table_ptr, extra_ptr, row, walk_pre, es, total, kh,
                                     lane, k_s0, k_s1, v_s0, v_s1, t_s0, scale, softcap, LANES, MP, D, BLOCK, KEYS,
                                     TC, WIDEN, WINDOW, CAP)
                m, l, acc = _merge(m, l, acc, m2, l2, acc2)
            _store(out_ptr, o_s0, t + i, kh * G + g, m, l, acc, valid, sinks_ptr, D, SINK)
        else:
            lane = tl.program_id(2)
            m, l, acc = _lane(q, rtot, rlo, k_ptr, v_ptr, table_ptr, extra_ptr, row, walk_pre, es, total, kh, lane,
                              k_s0, k_s1, v_s0, v_s1, t_s0, scale, softcap, LANES, MP, D, BLOCK, KEYS, TC, WIDEN,
                              WINDOW, CAP)
            kv = tl.num_programs(1)
            state = part_ptr + (((t + i) * kv + kh) * LANES) * GP * (D + 2) + g * (D + 2)   # lane 0's
            mine = state + lane * GP * (D + 2)
            tl.store(mine[:, None] + d[None, :], acc, mask=valid[:, None])
            tl.store(mine + D, m, mask=valid)
            tl.store(mine + D + 1, l, mask=valid)
            if arrive(count_ptr + t * kv + kh, LANES):          # the last lane merges them all, in lane order
                m, l, acc = _merge_stored(state, valid, MP, GP, D, LANES)
                _store(out_ptr, o_s0, t + i, kh * G + g, m, l, acc, valid, sinks_ptr, D, SINK)
