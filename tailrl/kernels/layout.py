"""What every attention kernel agrees on: the K/V cache layout and the per-query visibility.

The tokens of one step are flattened, row after row ([N, ...]); row r owns cache row r and its
new tokens are written at cache positions start_r .. start_r + n_r - 1 before attention runs.
Each query token then attends to keys of its own row only, described per query by

* ``prefix``: it sees cache positions [0, prefix) (a committed token or a chain draft node at
  cache position p: prefix = p + 1), followed by
* ``extra[estart : estart + ecount]``: further cache positions in order (a tree draft node: the
  committed prefix, then its ancestors and itself, which sit at cache positions other than
  their depths).

No mask tensor, no padding: a row's K/V is read once for all of its queries.

Cache layout: values are [rows, KV, cap, D]; keys are [rows, KV, cap * D] in blocks of
``BLOCK`` positions, each block [D/2][BLOCK][2] (pairs of dimensions side by side per key), so
a block is one contiguous read and bfloat16 blocks are scored with pairwise dot products.
``cap`` is a whole number of blocks. ``pack_keys`` / ``unpack_keys`` convert from / to the
plain [rows, KV, D, cap] view; ``key_index`` addresses single positions.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

BLOCK = 32                              # key positions per block (the native kernel's BLOCK)


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


def check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    rows, kv, cap, dim = v_cache.shape
    if k_cache.dim() != 3 or k_cache.shape != (rows, kv, cap * dim) or cap % BLOCK:
        raise ValueError(f"attend: keys must be [rows, KV, cap * D] blocks for values [rows, KV, cap, D] with cap a "
                         f"multiple of {BLOCK}, got keys {tuple(k_cache.shape)}, values {tuple(v_cache.shape)}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("attend: the key blocks and the values' head dimension must be contiguous")
