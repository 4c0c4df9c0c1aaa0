"""What every attention kernel agrees on: the K/V cache layout and the per-query visibility.

The tokens of one step are flattened, row after row ([N, ...]); row r's new tokens are written
at its positions start_r .. start_r + n_r - 1 before attention runs. Each query token then
attends to keys of its own row only, described per query by

* ``prefix``: it sees cache positions [0, prefix) (a committed token or a chain draft node at
  cache position p: prefix = p + 1), followed by
* ``extra[estart : estart + ecount]``: further cache positions in order (a tree draft node: the
  committed prefix, then its ancestors and itself, which sit at cache positions other than
  their depths).

No mask tensor, no padding: a row's K/V is read once for all of its queries. A sliding-window
layer (``Rope.origin``) also gives each query the first position of its prefix it sees; its
extras, its own draft's positions, are inside the window (the engine keeps drafts shorter).

Cache layout: a pool of blocks of ``BLOCK`` positions, allocated once (tailrl/engine/kv/cache.py):
keys [blocks, KV, BLOCK * D], values [blocks, KV, BLOCK, D]. Row r's position p lives in block
``block_table[r, p // BLOCK]`` at lane p % BLOCK; a new token is written at its *slot*
block * BLOCK + lane. A block's keys for one KV head are [D/2][BLOCK][2] (pairs of dimensions
side by side per key), so a block is one contiguous read and bfloat16 blocks are scored with
pairwise dot products; ``key_index`` addresses single lanes. ``pack_keys`` / ``unpack_keys``
convert plain keys [..., D, n] from / to consecutive key blocks [..., blocks(n) * D] (a row's
blocks in order: what ``gather_rows`` returns).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tailrl.kernels.delta import StatePlan

BLOCK = 32                              # key positions per block (the native kernel's BLOCK)


def blocks(positions: int) -> int:
    """``positions`` rounded up to whole key blocks."""
    return -(-positions // BLOCK) * BLOCK


def key_index(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """[n, D] offsets of each position's keys (dimension order) inside consecutive key blocks
    (a lane < BLOCK: inside one block)."""
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

    write_slot: torch.Tensor            # [N] long: where each new token's K/V goes (block * BLOCK + lane)
    q_row: torch.Tensor                 # [N] int32: its row of block_table (a row's tokens consecutive)
    prefix: torch.Tensor                # [N] int32: it sees its row's positions [0, prefix) ...
    estart: torch.Tensor                # [N] int32: ... then extra[estart : estart + ecount]
    ecount: torch.Tensor                # [N] int32
    extra: torch.Tensor                 # [E] int32 (at least one element)
    block_table: torch.Tensor           # [rows, max blocks] int32: row r's position p is in block [r, p // BLOCK]
    kv_len: int                         # largest position any query sees, plus one
    reads: int                          # (row, key position) pairs read: the K/V traffic
    work: int                           # (query, key position) pairs scored
    multi: bool = False                 # some row has several queries (chains, prefill): kernels may group them
    states: "StatePlan | None" = None   # a model with recurrent layers (Qwen3.5's): the step's rows (delta.py)

    @property
    def num_tokens(self) -> int:
        return self.write_slot.shape[0]


def check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMeta) -> None:
    nb, kv, lanes, dim = v_cache.shape
    if k_cache.dim() != 3 or k_cache.shape != (nb, kv, BLOCK * dim) or lanes != BLOCK:
        raise ValueError(f"attend: keys must be a pool [blocks, KV, {BLOCK} * D] for values [blocks, KV, {BLOCK}, D], "
                         f"got keys {tuple(k_cache.shape)}, values {tuple(v_cache.shape)}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or v_cache.stride(-2) != dim:
        raise ValueError("attend: the key blocks and the values' positions must be contiguous")
    t = meta.block_table
    if t.dtype != torch.int32 or t.dim() != 2 or t.stride(-1) != 1 or t.shape[1] * BLOCK < meta.kv_len:
        raise ValueError(f"attend: block_table must be [rows, >= {-(-meta.kv_len // BLOCK)}] int32 with contiguous "
                         f"rows, got {tuple(t.shape)} {t.dtype}")


def gather_rows(k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                rows: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V of ``rows``' first ``length`` positions, each row's blocks in order: keys
    [len(rows), KV, blocks(length) * D] (consecutive key blocks), values [len(rows), KV,
    blocks(length), D]."""
    nb = -(-length // BLOCK)
    ids = table[rows.long(), :nb].long()                                 # [R, nb]
    r, kv, dim = ids.shape[0], v_cache.shape[1], v_cache.shape[3]
    k = k_cache[ids].transpose(1, 2).reshape(r, kv, nb * BLOCK * dim)
    v = v_cache[ids].transpose(1, 2).reshape(r, kv, nb * BLOCK, dim)
    return k, v
