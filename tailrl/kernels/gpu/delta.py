"""Gated DeltaNet's recurrence in Triton (Qwen3.5's linear attention; kernels/delta.py says what it
computes and what a step's rows are). Three launches a layer, each program a fixed piece of one
row, so a row's bits never depend on the others:

- ``delta_conv_kernel``, program (row, block of channels): the causal conv of width 4 over the
  row's tokens in order, its window in registers, then SiLU, each rounded to the dtype; the
  conv states written after the row's committed tokens, the snapshot where asked;
- ``delta_rule_kernel``, program (row, value head, block of BV values): that block of the head's
  state [DK, BV] in registers through the row's tokens in order (decay, the delta rule, the
  read by q), written back after the committed tokens (the draft nodes after them go on in
  registers: the states keep the committed tokens') and to the snapshot where asked;
- ``gated_norm_kernel``, program (token, head): the gated RMS norm.

Not yet run on a GPU: tested under Triton's interpreter against the reference
(tests/kernels/test_delta.py).
"""
from __future__ import annotations

import triton
import triton.language as tl

from tailrl.kernels.gpu.rounding import round_to


@triton.jit
def _silu(x):
    return x / (1.0 + tl.exp(-x))


@triton.jit
def _at(like, x, y):
    """``x == y`` (scalars) as a block shaped ``like``: a mask the interpreter takes too."""
    return (tl.zeros(like.shape, tl.int32) + x) == y


@triton.jit
def delta_conv_kernel(mixed_ptr, m_s0, w_ptr, conv_ptr, seqs_ptr, co_ptr, C, BC: tl.constexpr):
    """Width 4: a channel's output is w0 x[t-3] + w1 x[t-2] + w2 x[t-1] + w3 x[t], in that order."""
    s, cb = tl.program_id(0), tl.program_id(1)
    row, t0, cnt = tl.load(seqs_ptr + s * 6), tl.load(seqs_ptr + s * 6 + 1), tl.load(seqs_ptr + s * 6 + 2)
    done, fresh, snap = tl.load(seqs_ptr + s * 6 + 3), tl.load(seqs_ptr + s * 6 + 4), tl.load(seqs_ptr + s * 6 + 5)
    c = cb * BC + tl.arange(0, BC)
    ok = c < C
    st = conv_ptr + row * 2 * C * 3 + c * 3                  # the live states; the snapshot C * 3 further
    keep = ok & _at(c, fresh, 0)
    a0 = tl.load(st, mask=keep, other=0.0).to(tl.float32)
    a1 = tl.load(st + 1, mask=keep, other=0.0).to(tl.float32)
    a2 = tl.load(st + 2, mask=keep, other=0.0).to(tl.float32)
    w0 = tl.load(w_ptr + c * 4, mask=ok, other=0.0).to(tl.float32)
    w1 = tl.load(w_ptr + c * 4 + 1, mask=ok, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + c * 4 + 2, mask=ok, other=0.0).to(tl.float32)
    w3 = tl.load(w_ptr + c * 4 + 3, mask=ok, other=0.0).to(tl.float32)
    dt = mixed_ptr.dtype.element_ty
    for j in range(0, cnt):
        x = tl.load(mixed_ptr + (t0 + j) * m_s0 + c, mask=ok, other=0.0).to(tl.float32)
        acc = w0 * a0
        acc = acc + w1 * a1
        acc = acc + w2 * a2
        acc = acc + w3 * x
        y = round_to(_silu(round_to(acc, dt).to(tl.float32)), dt).to(tl.float32)
        tl.store(co_ptr + (t0 + j) * C + c, y, mask=ok)
        a0, a1, a2 = a1, a2, x
        at_done, at_snap = ok & _at(c, j + 1, done), ok & _at(c, j + 1, snap)
        tl.store(st, a0.to(dt), mask=at_done)
        tl.store(st + 1, a1.to(dt), mask=at_done)
        tl.store(st + 2, a2.to(dt), mask=at_done)
        tl.store(st + C * 3, a0.to(dt), mask=at_snap)
        tl.store(st + C * 3 + 1, a1.to(dt), mask=at_snap)
        tl.store(st + C * 3 + 2, a2.to(dt), mask=at_snap)


@triton.jit
def delta_rule_kernel(co_ptr, C, b_ptr, a_ptr, b_s0, nega_ptr, dtb_ptr, ssm_ptr, seqs_ptr, out_ptr, VH, qf,
                      KH: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, WRITE: tl.constexpr):
    s, vh, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row, t0, cnt = tl.load(seqs_ptr + s * 6), tl.load(seqs_ptr + s * 6 + 1), tl.load(seqs_ptr + s * 6 + 2)
    done, fresh, snap = tl.load(seqs_ptr + s * 6 + 3), tl.load(seqs_ptr + s * 6 + 4), tl.load(seqs_ptr + s * 6 + 5)
    kh = vh // (VH // KH)
    i = tl.arange(0, DK)
    v = vb * BV + tl.arange(0, BV)
    vok = v < DV
    tile = i[:, None] * DV + v[None, :]
    ok = (i[:, None] < DK) & vok[None, :]
    live = ssm_ptr + (row * 2 * VH + vh) * DK * DV
    state = tl.load(live + tile, mask=ok & _at(tile, fresh, 0), other=0.0)
    nega, dtb = tl.load(nega_ptr + vh), tl.load(dtb_ptr + vh)
    dt = b_ptr.dtype.element_ty
    for j in range(0, cnt):
        t = t0 + j
        q = tl.load(co_ptr + t * C + kh * DK + i)
        k = tl.load(co_ptr + t * C + KH * DK + kh * DK + i)
        x = tl.load(co_ptr + t * C + 2 * KH * DK + vh * DV + v, mask=vok, other=0.0)
        q = q * (1.0 / tl.sqrt(tl.sum(q * q, 0) + 1e-6)) * qf
        k = k * (1.0 / tl.sqrt(tl.sum(k * k, 0) + 1e-6))
        b = tl.load(b_ptr + t * b_s0 + vh).to(tl.float32)
        beta = round_to(1.0 / (1.0 + tl.exp(-b)), dt).to(tl.float32)
        a = tl.load(a_ptr + t * b_s0 + vh).to(tl.float32) + dtb
        g = nega * tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))
        state = state * tl.exp(g)
        mem = tl.sum(state * k[:, None], 0)
        state = state + k[:, None] * ((x - mem) * beta)[None, :]
        if WRITE:
            o = tl.sum(state * q[:, None], 0)
            tl.store(out_ptr + t * VH * DV + vh * DV + v, o.to(out_ptr.dtype.element_ty), mask=vok)
        tl.store(live + tile, state, mask=ok & _at(tile, j + 1, done))
        tl.store(live + VH * DK * DV + tile, state, mask=ok & _at(tile, j + 1, snap))


@triton.jit
def gated_norm_kernel(o_ptr, z_ptr, z_s0, w_ptr, out_ptr, H, eps, DV: tl.constexpr):
    """Program r = token * H + head: its DV values normed, times the weight, times SiLU(z)."""
    r = tl.program_id(0)
    t, h = r // H, r % H
    d = tl.arange(0, DV)
    dt = out_ptr.dtype.element_ty
    x = tl.load(o_ptr + r * DV + d).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / DV + eps)
    y = round_to(round_to(x * inv, dt).to(tl.float32) * tl.load(w_ptr + d).to(tl.float32), dt).to(tl.float32)
    z = tl.load(z_ptr + t * z_s0 + h * DV + d).to(tl.float32)
    tl.store(out_ptr + r * DV + d, round_to(y * _silu(z), dt))
