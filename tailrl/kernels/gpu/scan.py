"""The sampler's row sums in Triton: one program per row, the row walked in blocks of a fixed
size, in order (row-local, so batch invariant).

PyTorch's CUDA ``cumsum`` is not: one row goes through CUB's device-wide scan, several rows
through a kernel whose threads per row depend on the number of rows (more than ~512 rows of a
152k vocabulary take half as many), so a row's running sums, its total and the log-probability
taken from it change with the batch; its ``logsumexp`` picks its reduction by the number of
rows too. Here row r's sums are the same whatever else is in the launch.

``EXP``: the running sums of exp(x - max(x)) (the unnormalised CDF the sampler inverts) and the
max; else of x itself. The total is the last running sum as stored (the inverse CDF's guard
looks for it in the row). ``WRITE``: store the running sums (else the total alone).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def row_scan_kernel(x_ptr, x_s0, out_ptr, total_ptr, mx_ptr, V, BLOCK: tl.constexpr, EXP: tl.constexpr,
                    WRITE: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    row = x_ptr + r * x_s0
    offs = tl.arange(0, BLOCK)
    mx = 0.0
    if EXP:
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        for start in range(0, V, BLOCK):
            v = tl.load(row + start + offs, mask=start + offs < V, other=float("-inf")).to(tl.float32)
            m = tl.maximum(m, v)
        mx = tl.max(m, 0)
    run = 0.0
    for start in range(0, V, BLOCK):
        ok = start + offs < V
        v = tl.load(row + start + offs, mask=ok, other=0.0).to(tl.float32)
        if EXP:
            v = tl.where(ok, tl.exp(v - mx), 0.0)
        cs = tl.cumsum(v, 0) + run
        if WRITE:
            tl.store(out_ptr + r * V + start + offs, cs.to(out_ptr.dtype.element_ty), mask=ok)
        # the carry: the block's last running sum as stored (one value plus zeros: exact)
        last = tl.minimum(V - start, BLOCK) - 1
        run = tl.sum(tl.where(offs == last, cs.to(out_ptr.dtype.element_ty).to(tl.float32), 0.0), 0)
    tl.store(total_ptr + r, run.to(total_ptr.dtype.element_ty))
    if EXP:
        tl.store(mx_ptr + r, mx.to(mx_ptr.dtype.element_ty))
