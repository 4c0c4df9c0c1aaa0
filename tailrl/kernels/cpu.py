"""The CPU backend: the native kernels of ``_attention.cpp`` (see its header for why a kernel of
our own, and for batch invariance): row attention for decode, verify (chains and trees) and
prefill chunks, fused with RoPE and the K/V writes, and RMS norm. OpenMP inside; tensors are
handed over as raw pointers with element strides, checked here.

Available when the extension is built (``NATIVE``; ``TAILRL_PURE_PYTHON=1`` turns it off) for
bfloat16, float32 and float64; otherwise ``tailrl.kernels.select`` picks the reference.
"""
from __future__ import annotations

import importlib
import logging
import os

import torch
import torch.nn.functional as F

from tailrl.kernels.backend import Backend, Rope, RopeTables
from tailrl.kernels.layout import AttentionMeta, check_caches

try:
    if os.environ.get("TAILRL_PURE_PYTHON"):
        raise ImportError("TAILRL_PURE_PYTHON is set")
    _native = importlib.import_module("tailrl.kernels._attention")
    NATIVE = True
except ImportError as exc:                 # not built (no compiler at install time)
    logging.getLogger(__name__).warning("tailrl.kernels: native row attention unavailable (%s); using the "
                                        "PyTorch reference (slower)", exc)
    _native = None
    NATIVE = False

_DTYPE_CODE = {torch.bfloat16: 0, torch.float32: 1, torch.float64: 2}


def supports(dtype: torch.dtype) -> bool:
    return NATIVE and dtype in _DTYPE_CODE


def _vis(meta: AttentionMeta) -> tuple[int, ...]:
    return (meta.q_row.data_ptr(), meta.prefix.data_ptr(), meta.estart.data_ptr(), meta.ecount.data_ptr(),
            meta.extra.data_ptr())


def _strides(k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, q_strides=(0, 0)) -> tuple[int, ...]:
    return (*q_strides, *k_cache.stride()[:2], *v_cache.stride()[:3], out.stride(0), out.stride(1))


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
    """q: [N, H, D] (RoPE applied, last dim contiguous); k_cache [rows, KV, cap * D] (key blocks)
    and v_cache [rows, KV, cap, D] already hold this step's K/V. Returns [N, H*D]."""
    n, heads, d = q.shape
    if q.stride(-1) != 1:
        raise ValueError("attend: q's head dimension must be contiguous")
    check_caches(k_cache, v_cache)
    out = torch.empty(n, heads, d, dtype=q.dtype, device=q.device)
    if n:
        _native.attend(_DTYPE_CODE[q.dtype], q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                       (n, heads, k_cache.shape[1], d), _strides(k_cache, v_cache, out, (q.stride(0), q.stride(1))),
                       _vis(meta), d ** -0.5, torch.get_num_threads())
    return out.view(n, heads * d)


class CpuBackend(Backend):
    name = "cpu"

    def rope(self, tables: RopeTables, positions: torch.Tensor) -> Rope:
        return Rope(positions, tables.cos_acc, tables.sin_acc)             # full tables, accumulation type

    def rope_attend(self, qkv: torch.Tensor, rope: Rope, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMeta, heads: int) -> torch.Tensor:
        """In one native call: RoPE in the accumulation type, the K/V writes, ``attend``."""
        n = qkv.shape[0]
        kv_heads, d = v_cache.shape[1], v_cache.shape[3]
        if qkv.stride(-1) != 1 or rope.positions.dtype != torch.long:
            raise ValueError("rope_attend: qkv rows must be contiguous and positions int64")
        check_caches(k_cache, v_cache)
        out = torch.empty(n, heads, d, dtype=qkv.dtype, device=qkv.device)
        if n:
            _native.rope_attend(_DTYPE_CODE[qkv.dtype], qkv.data_ptr(), qkv.stride(0), rope.cos.data_ptr(),
                                rope.sin.data_ptr(), rope.positions.data_ptr(), meta.write_rows.data_ptr(),
                                meta.write_pos.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                                (n, heads, kv_heads, d), _strides(k_cache, v_cache, out), _vis(meta), d ** -0.5,
                                torch.get_num_threads())
        return out.view(n, heads * d)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Row-local (batch invariant): a fixed reduction per row."""
        if x.dim() != 2 or x.stride(-1) != 1 or not weight.is_contiguous():
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        _native.rms_norm(_DTYPE_CODE[x.dtype], x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(),
                         x.shape[0], x.shape[1], eps, torch.get_num_threads())
        return out


CPU = CpuBackend()
