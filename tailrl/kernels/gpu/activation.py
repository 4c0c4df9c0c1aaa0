"""The gated MLP's activation in Triton: out = silu(gate) * up from the fused gate/up
projection's rows [gate | up], one launch where PyTorch takes three (chunk's views aside:
silu, multiply, and the copy a strided input costs). Each element alone, rounded as PyTorch
rounds: silu's result to the dtype, then the product (the exponential is Triton's, so the
last bit of silu may differ from PyTorch's; the GPU path uses this kernel in every step,
so a row's bits never depend on its batch)."""
from __future__ import annotations

import triton
import triton.language as tl

from tailrl.kernels.gpu.rounding import round_to


@triton.jit
def silu_times(g, u, dtype: tl.constexpr):
    """silu(g) * u in ``dtype``, from g and u in ``dtype``: each op rounded as PyTorch rounds
    it. No multiply feeds an add, so no compiler can contract it into an FMA: the same bits in
    every kernel that calls it (this one, and the matmul that computes the activation as it
    reads it: matmul.py)."""
    g = g.to(tl.float32)
    s = round_to(g / (1.0 + tl.exp(-g)), dtype).to(tl.float32)
    return round_to(s * u.to(tl.float32), dtype)


@triton.jit
def silu_mul_kernel(gu_ptr, out_ptr, I, BLOCK: tl.constexpr):
    """Program (row r, block j): columns [j * BLOCK, (j + 1) * BLOCK) of out [rows, I]."""
    r, j = tl.program_id(0), tl.program_id(1)
    c = j * BLOCK + tl.arange(0, BLOCK)
    ok = c < I
    g = tl.load(gu_ptr + r * 2 * I + c, mask=ok, other=0.0)
    u = tl.load(gu_ptr + r * 2 * I + I + c, mask=ok, other=0.0)
    tl.store(out_ptr + r * I + c, silu_times(g, u, out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def swiglu_clamped_kernel(gu_ptr, out_ptr, I, alpha, limit, BLOCK: tl.constexpr):
    """gpt-oss's activation (``Backend.swiglu_clamped``), program (row r, block j) as
    silu_mul_kernel's: gate clamped above at ``limit``, up to [-limit, limit], then (up + 1) *
    gate * sigmoid(alpha * gate), each operation rounded to the dtype as PyTorch rounds it."""
    r, j = tl.program_id(0), tl.program_id(1)
    c = j * BLOCK + tl.arange(0, BLOCK)
    ok = c < I
    dtype = out_ptr.dtype.element_ty
    g = tl.minimum(tl.load(gu_ptr + r * 2 * I + c, mask=ok, other=0.0).to(tl.float32), limit)
    u = tl.load(gu_ptr + r * 2 * I + I + c, mask=ok, other=0.0).to(tl.float32)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    t = round_to(g * alpha, dtype).to(tl.float32)
    s = round_to(1.0 / (1.0 + tl.exp(-t)), dtype).to(tl.float32)
    glu = round_to(g * s, dtype).to(tl.float32)
    tl.store(out_ptr + r * I + c, round_to(round_to(u + 1.0, dtype).to(tl.float32) * glu, dtype), mask=ok)
