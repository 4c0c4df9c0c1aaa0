"""float32 -> a kernel's storage dtype, rounded to nearest, ties to even, as PyTorch rounds.

Why not ``x.to(tl.bfloat16)`` alone: Triton's CPU interpreter truncates that cast where a GPU
rounds, so the interpreter could not check bit for bit what a fused kernel stores against
PyTorch's ops. Rounding the bits first (add 0x7FFF plus the lowest kept bit, clear the low 16)
leaves a value the cast keeps exactly, on either. Finite values only (the residual stream and
activations are)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr):
    if dtype == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + (0x7FFF + ((b >> 16) & 1))) & 0xFFFF0000
        return b.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        return x.to(dtype)
