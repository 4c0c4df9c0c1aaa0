"""Attention over a per-row KV cache for a step that mixes prefill chunks, decodes and drafts.

The tokens of one step are flattened, row after row ([N, ...]); row r owns cache row r and its
new tokens are written at cache positions start_r .. start_r + n_r - 1 before attention runs.
Each query token then attends to keys of its own row only, described per query by

* ``prefix``: it sees cache positions [0, prefix) (a committed token or a chain draft node at
  cache position p: prefix = p + 1), followed by
* ``extra[estart : estart + ecount]``: further cache positions in order (a tree draft node: the
  committed prefix, then its ancestors and itself, which sit at cache positions other than
  their depths).

No mask tensor, no padding: a row's K/V is read once for all of its queries. The work is done
by a native kernel (``_attention.cpp``, see its header for why and for batch invariance); the
reference below (SDPA over gathered keys) is used when the extension is not built and in tests.

Cache layout: values are [rows, KV, cap, D]; keys are [rows, KV, cap * D] in blocks of
``BLOCK`` positions, each block [D/2][BLOCK][2] (pairs of dimensions side by side per key), so
a block is one contiguous read and bfloat16 blocks are scored with pairwise dot products.
``cap`` is a whole number of blocks. ``pack_keys`` / ``unpack_keys`` convert from / to the
plain [rows, KV, D, cap] view; ``key_index`` addresses single positions.
"""
from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:
    if os.environ.get("TAILRL_PURE_PYTHON"):
        raise ImportError("TAILRL_PURE_PYTHON is set")
    _native = importlib.import_module("tailrl.model._attention")
    NATIVE = True
except ImportError as exc:                 # not built (no compiler at install time)
    logging.getLogger(__name__).warning("tailrl.model: native row attention unavailable (%s); using the "
                                        "SDPA reference (slower)", exc)
    _native = None
    NATIVE = False

_DTYPE_CODE = {torch.bfloat16: 0, torch.float32: 1, torch.float64: 2}
BLOCK = 32                              # key positions per block (the kernel's BLOCK)


def blocks(positions: int) -> int:
    """``positions`` rounded up to whole key blocks."""
    return -(-positions // BLOCK) * BLOCK


def key_index(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """[n, D] offsets of each position's keys (dimension order) inside a row's key blocks."""
    p = positions.long()[:, None]
    d = torch.arange(dim, device=positions.device)[None, :]
    return (p // BLOCK) * (BLOCK * dim) + (d // 2) * (2 * BLOCK) + (p % BLOCK) * 2 + d % 2


def _blocked(k: torch.Tensor, dim: int) -> torch.Tensor:
    """[..., cap * D] key blocks viewed as [..., D/2, 2, cap/BLOCK, BLOCK] (dimension pair and
    half, block, lane): the plain [D, cap] layout up to two reshapes."""
    *lead, flat = k.shape
    n = len(lead)
    v = k.view(*lead, flat // (BLOCK * dim), dim // 2, BLOCK, 2)         # block, pair, lane, half
    return v.permute(*range(n), n + 1, n + 3, n, n + 2)


def pack_keys(keys: torch.Tensor) -> torch.Tensor:
    """Plain keys [..., D, cap] -> key blocks [..., blocks(cap) * D] (new tensor, zero-padded)."""
    *lead, dim, cap = keys.shape
    if dim % 2:
        raise ValueError(f"pack_keys: the head dimension must be even, got {dim}")
    out = keys.new_zeros(*lead, blocks(cap) * dim)
    view = _blocked(out, dim)
    view.copy_(F.pad(keys, (0, blocks(cap) - cap)).reshape(*view.shape))
    return out


def unpack_keys(k: torch.Tensor, dim: int) -> torch.Tensor:
    """Key blocks [..., cap * D] -> plain keys [..., D, cap] (a copy)."""
    view = _blocked(k, dim)
    *lead, half, two, nb, lanes = view.shape
    return view.reshape(*lead, half * two, nb * lanes)


@dataclass
class AttentionMeta:
    """Where each flat token goes and what it may see; built once per step, used by every layer."""

    write_rows: torch.Tensor            # [N] long: cache row of each new token
    write_pos: torch.Tensor             # [N] long: cache position of each new token
    q_row: torch.Tensor                 # [N] int32: its row (non-decreasing: rows in flat order)
    prefix: torch.Tensor                # [N] int32: it sees cache positions [0, prefix) ...
    estart: torch.Tensor                # [N] int32: ... then extra[estart : estart + ecount]
    ecount: torch.Tensor                # [N] int32
    extra: torch.Tensor                 # [E] int32 (at least one element)
    kv_len: int                         # largest cache position any query sees, plus one
    reads: int                          # (row, key position) pairs read: the K/V traffic
    work: int                           # (query, key position) pairs scored

    @property
    def num_tokens(self) -> int:
        return self.write_rows.shape[0]


def _vis(meta: AttentionMeta) -> tuple[int, ...]:
    return (meta.q_row.data_ptr(), meta.prefix.data_ptr(), meta.estart.data_ptr(), meta.ecount.data_ptr(),
            meta.extra.data_ptr())


def _strides(k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, q_strides=(0, 0)) -> tuple[int, ...]:
    return (*q_strides, *k_cache.stride()[:2], *v_cache.stride()[:3], out.stride(0), out.stride(1))


def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    rows, kv, cap, dim = v_cache.shape
    if k_cache.dim() != 3 or k_cache.shape != (rows, kv, cap * dim) or cap % BLOCK:
        raise ValueError(f"attend: keys must be [rows, KV, cap * D] blocks for values [rows, KV, cap, D] with cap a "
                         f"multiple of {BLOCK}, got keys {tuple(k_cache.shape)}, values {tuple(v_cache.shape)}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("attend: the key blocks and the values' head dimension must be contiguous")


def write_keys(k_cache: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, k: torch.Tensor) -> None:
    """k [N, KV, D] into key blocks [rows, KV, cap * D] at (rows, positions)."""
    idx = key_index(positions, k.shape[-1])                             # [N, D]
    k_cache[rows[:, None, None], torch.arange(k.shape[1])[None, :, None], idx[:, None, :]] = k


def use_native(dtype: torch.dtype, native: bool | None = None) -> bool:
    return (NATIVE if native is None else native) and dtype in _DTYPE_CODE


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMeta,
           native: bool | None = None) -> torch.Tensor:
    """q: [N, H, D] (RoPE applied, last dim contiguous); k_cache [rows, KV, cap * D] (key blocks)
    and v_cache [rows, KV, cap, D] already hold this step's K/V. Returns [N, H*D]."""
    n, heads, d = q.shape
    if not use_native(q.dtype, native):
        return reference_attend(q, k_cache, v_cache, meta)
    if q.stride(-1) != 1:
        raise ValueError("attend: q's head dimension must be contiguous")
    _check_caches(k_cache, v_cache)
    out = torch.empty(n, heads, d, dtype=q.dtype, device=q.device)
    if n:
        _native.attend(_DTYPE_CODE[q.dtype], q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                       (n, heads, k_cache.shape[1], d), _strides(k_cache, v_cache, out, (q.stride(0), q.stride(1))),
                       _vis(meta), d ** -0.5, torch.get_num_threads())
    return out.view(n, heads * d)


def rope_attend(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMeta, heads: int) -> torch.Tensor:
    """A layer's attention from its fused projection ``qkv`` [N, (H + 2 KV) * D] in one native
    call: RoPE on query and key heads (``cos``/``sin`` [max_len, D] in float32, float64 for a
    float64 model), this step's K/V written at (``meta.write_rows``, ``meta.write_pos``), then
    ``attend``. Returns [N, H*D]. Needs the native extension (``NATIVE``)."""
    n = qkv.shape[0]
    kv_heads, d = v_cache.shape[1], v_cache.shape[3]
    if qkv.stride(-1) != 1 or positions.dtype != torch.long:
        raise ValueError("rope_attend: qkv rows must be contiguous and positions int64")
    _check_caches(k_cache, v_cache)
    out = torch.empty(n, heads, d, dtype=qkv.dtype, device=qkv.device)
    if n:
        _native.rope_attend(_DTYPE_CODE[qkv.dtype], qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(),
                            positions.data_ptr(), meta.write_rows.data_ptr(), meta.write_pos.data_ptr(),
                            k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), (n, heads, kv_heads, d),
                            _strides(k_cache, v_cache, out), _vis(meta), d ** -0.5, torch.get_num_threads())
    return out.view(n, heads * d)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm over the last dim of a 2-D ``x`` (row-local, so batch invariant): native when
    built, else PyTorch's."""
    if not use_native(x.dtype) or x.dim() != 2 or x.stride(-1) != 1 or not weight.is_contiguous():
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _native.rms_norm(_DTYPE_CODE[x.dtype], x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(),
                     x.shape[0], x.shape[1], eps, torch.get_num_threads())
    return out


def visibility(meta: AttentionMeta) -> torch.Tensor:
    """[N, kv_len] bool: which cache positions of its row each query sees."""
    n, s = meta.num_tokens, meta.kv_len
    vis = torch.arange(s)[None, :] < meta.prefix.long()[:, None]
    for t in range(n):
        c = int(meta.ecount[t])
        if c:
            e0 = int(meta.estart[t])
            vis[t, meta.extra[e0:e0 + c].long()] = True
    return vis


def reference_attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMeta) -> torch.Tensor:
    """The same attention with PyTorch's SDPA over each query's gathered row (slow, simple)."""
    n, heads, d = q.shape
    kv = k_cache.shape[1]
    s = meta.kv_len
    rows = meta.q_row.long()
    k = unpack_keys(k_cache, d)[rows, :, :, :s].transpose(-1, -2)      # [N, KV, S, D]
    v = v_cache[rows, :, :s]
    mask = visibility(meta).to(q.device)[:, None, None, :]             # [N, 1, 1, S]
    o = F.scaled_dot_product_attention(q.view(n, kv, heads // kv, d), k, v, attn_mask=mask)
    return o.reshape(n, heads * d)
