"""RMS norm in Triton: one program per row, the sum of squares over the whole row in one fixed
reduction (row-local, so batch invariant); and the residual add fused with it (one launch
where two were: the sum rounded to the stream's dtype as PyTorch's add rounds it, then
normed by the same code, so the bits are the two separate kernels')."""
from __future__ import annotations

import triton
import triton.language as tl

from tailrl.kernels.gpu.rounding import round_to


@triton.jit
def _normed(x, w_ptr, c, ok, C, eps):
    """float32 row ``x`` times the rsqrt of its mean square (+ eps) times the weight."""
    inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / C + eps)
    w = tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
    return x * inv * w


@triton.jit
def rms_norm_kernel(x_ptr, x_s0, w_ptr, out_ptr, C, eps, BC: tl.constexpr):
    r = tl.program_id(0)
    c = tl.arange(0, BC)
    ok = c < C
    x = tl.load(x_ptr + r * x_s0 + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * C + c, _normed(x, w_ptr, c, ok, C, eps).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def add_rms_norm_kernel(x_ptr, y_ptr, sum_ptr, w_ptr, out_ptr, C, eps, BC: tl.constexpr):
    """Row r: sum = x + y (rounded to the dtype), out = rms_norm(sum) * w."""
    r = tl.program_id(0)
    c = tl.arange(0, BC)
    ok = c < C
    x = tl.load(x_ptr + r * C + c, mask=ok, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + r * C + c, mask=ok, other=0.0).to(tl.float32)
    s = round_to(x + y, sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + r * C + c, s, mask=ok)
    tl.store(out_ptr + r * C + c, _normed(s.to(tl.float32), w_ptr, c, ok, C, eps).to(out_ptr.dtype.element_ty),
             mask=ok)
