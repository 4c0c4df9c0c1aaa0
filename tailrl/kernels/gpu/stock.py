"""Where the stock matmul is already batch invariant: cuBLAS for that weight shape, decided by
a measurement, once per process.

Why: the Triton matmul (matmul.py) is invariant by construction but slower than cuBLAS at
large M (an H100, one forward of the 0.5b stand-in: 1.8x at 512 rows, 2.5x at 2048), while
cuBLAS may well be invariant for a given shape (#34's author found, on an H100 with ordinary
random data, the qkv, gate/up and LM head shapes of a 0.5B model giving a row the same bits
for every M from 1 to 2048, and the down projection not, from M = 65 on). So each weight
shape is probed on first use: ``invariant`` runs the product at every M from 1 to ``ROWS`` on
operands built to expose any change in a sum's order (``probe_operands``; ordinary random
data hides most of them behind bfloat16's rounding), M rows at shifting offsets (so a row
meets other positions and alignments), each result compared bit for bit with the same rows
computed alone. A shape that passes takes cuBLAS (``stock_linear``: more than ``ROWS`` rows
run in pieces of ``ROWS``, each a probed M; the bias added after the product, as ``addmm``
takes another path for one row than for two), one that fails keeps the Triton kernel.

The decision is process-wide and final (every engine, scorer and drafter of a process must
compute a row alike), keyed by what cuBLAS chooses by: device, dtype, the weight's shape and
strides, and torch's reduced-precision flags. A shape first met inside a CUDA graph capture
(where a probe cannot run) keeps the Triton kernel for good; in practice the engine probes
its model's shapes at start-up (``Backend.prepare``), and every capture follows an eager run
of the same function (graph_pool.cuda_capture), which probes the rest (a drafter's).

``TAILRL_STOCK_ROWS`` sets ``ROWS`` (default 2048: up to 2 x 2048 products per shape at
start-up, well under a second on an H100 for a 0.5B model); ``0`` turns cuBLAS off (Triton
everywhere). Only CUDA tensors are probed (``DEVICES``): under Triton's CPU interpreter the
tests choose.
"""
from __future__ import annotations

import os
import weakref

import torch
import torch.nn.functional as F

ROWS = int(os.environ.get("TAILRL_STOCK_ROWS", "2048"))
DEVICES = ("cuda",)
PRODUCT = F.linear                   # the stock product (tests put others in its place)
_decided: dict[tuple, bool] = {}     # the process's decisions: key -> stock
_seen: dict[int, tuple[weakref.ref, bool]] = {}   # id(weight) -> (the weight, its key's decision)


def stock_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, rows: int | None = None,
                 linear=None) -> torch.Tensor:
    """x [M, K] @ w^T (+ b): ``linear`` (default ``PRODUCT``) on pieces of at most ``rows``
    (default ``ROWS``), the bias added to the rounded product."""
    rows, linear = rows or ROWS, linear or PRODUCT
    x = x.contiguous()                   # the probed layout: rows K apart
    if 0 < x.shape[0] <= rows:
        y = linear(x, w)
    else:
        y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
        for i in range(0, x.shape[0], rows):
            y[i:i + rows] = linear(x[i:i + rows], w)
    return y.add_(b) if b is not None else y


def probe_operands(rows: int, w: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` rows x and a weight of ``w``'s shape, dtype, strides and device whose products
    show any change in the order of a row's sum: half of K's positions, in random pairs, hold
    large values that cancel exactly (x equal at both, the weight negated), the other half
    ordinary ones. Each large term adds a rounding error of the float32 running sum about as
    big as the row's true result, so a sum taken in another order (another kernel, another
    split of K) ends on other bits, even after rounding to bfloat16. Ordinary random data hides
    most such changes behind the output's rounding (measured: the CPU's bfloat16 product at
    [M, 512] x [512, 64] changes one element in thousands)."""
    n, k = w.shape
    dev, big = w.device, 2.0 ** (7 if w.dtype == torch.float16 else 12)   # float16: products stay finite
    g = torch.Generator(device=dev).manual_seed(seed)
    pairs = torch.randperm(k, generator=g, device=dev)[:k // 4 * 2].view(-1, 2)
    x = torch.randn(rows, k, generator=g, device=dev)
    wf = torch.randn(n, k, generator=g, device=dev)
    x[:, pairs[:, 1]] = x[:, pairs[:, 0]] = big * torch.randn(rows, len(pairs), generator=g, device=dev)
    v = big * torch.randn(n, len(pairs), generator=g, device=dev)
    wf[:, pairs[:, 0]], wf[:, pairs[:, 1]] = v, -v
    wp = torch.empty_strided(w.shape, w.stride(), dtype=w.dtype, device=dev)
    wp.copy_(wf)
    return x.to(w.dtype), wp


def invariant(w: torch.Tensor, rows: int, linear=None, seed: int = 0) -> bool:
    """Whether ``linear`` (default ``PRODUCT``) gives every row the bits it has alone, for
    every M from 1 to ``rows``, on a weight of ``w``'s shape and layout (``probe_operands``):
    M rows taken at offset (M * 7919) mod (rows - M + 1), so that rows meet many positions;
    one host synchronisation at the end."""
    linear = linear or PRODUCT
    x, wp = probe_operands(rows, w, seed)
    alone = torch.cat([linear(x[i:i + 1], wp) for i in range(rows)])
    bad = torch.zeros((), dtype=torch.int64, device=w.device)
    for m in range(2, rows + 1):
        off = (m * 7919) % (rows - m + 1)
        bad += (linear(x[off:off + m], wp) != alone[off:off + m]).sum()
    return int(bad) == 0


def _key(w: torch.Tensor) -> tuple:
    m = torch.backends.cuda.matmul
    return (str(w.device), w.dtype, tuple(w.shape), w.stride(), m.allow_tf32,
            m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction)


def use_stock(w: torch.Tensor) -> bool:
    """The decision for this weight's shape: probed on first use (outside a capture). A
    weight remembers its decision (``_seen``: an eager step asks ~100 times, and building the
    key costs microseconds), so torch's flags are read when a weight is first seen."""
    hit = _seen.get(id(w))
    if hit is not None and hit[0]() is w:
        return hit[1]
    if ROWS <= 0 or w.device.type not in DEVICES:
        return False
    key = _key(w)
    if key not in _decided:
        capturing = w.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        _decided[key] = False if capturing else invariant(w, ROWS)
    _seen[id(w)] = (weakref.ref(w), _decided[key])
    return _decided[key]


def decisions() -> list[dict]:
    """The process's decisions so far, for reports: shape, dtype, kernel ("stock": cuBLAS on
    a GPU)."""
    return [{"n": k[2][0], "k": k[2][1], "dtype": str(k[1]).removeprefix("torch."),
             "kernel": "stock" if v else "triton"} for k, v in _decided.items()]
