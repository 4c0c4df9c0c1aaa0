"""Attention over a per-row KV cache for a step that mixes prefill chunks, decodes and drafts.

The tokens of one step are flattened, row after row ([N, ...]); row r owns cache row r and its
new tokens are written at cache positions start_r .. start_r + n_r - 1. Two paths:

* batched: rows with few new tokens (decodes, draft chains and trees) are padded to Tq query
  slots and attend over the cache rows [0, R) in one SDPA call. Grouped-query attention is done
  without copying K/V: the G query heads that share a KV head are stacked along the query axis.
* alone: rows with many new tokens (prefill chunks) attend one by one, so a long chunk does not
  pad every other row to its length.

Visibility inside the new tokens is causal, except where a tree draft gives an ancestor mask.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class AttentionMeta:
    """Where each flat token goes and what it may see; built once per step, used by every layer."""

    write_rows: torch.Tensor            # [N] cache row of each new token
    write_pos: torch.Tensor             # [N] cache position of each new token
    num_rows: int = 0                   # R: rows [0, R) covered by the batched call (0 = no batched call)
    tq: int = 0                         # query slots per row in the batched call
    kv_len: int = 0                     # S: cache positions visible to the batched call
    mask: torch.Tensor | None = None    # [R, 1, G*Tq, S] additive: 0 = may attend, -inf = not
    uniform: bool = False               # flat tokens are exactly [R, Tq] row-major (no padding)
    flat_index: torch.Tensor | None = None  # [Nb] flat token index of each batched token
    slot_index: torch.Tensor | None = None  # [Nb] r * Tq + i of that token in the padded layout
    alone: list[tuple[int, int, int, int]] = field(default_factory=list)  # (row, flat start, n, cache start)
    alone_masks: list[torch.Tensor] = field(default_factory=list)          # [1, 1, G*n, start+n] additive

    @property
    def work(self) -> int:
        """(query slot, key position) pairs the step's attention computes per head: its cost."""
        return self.num_rows * self.tq * self.kv_len + sum(n * (start + n) for _, _, n, start in self.alone)

    @property
    def reads(self) -> int:
        """(row, key position) pairs whose K/V the step's attention reads: what decode
        attention costs, whatever the number of query slots per row."""
        return self.num_rows * self.kv_len + sum(start + n for _, _, n, start in self.alone)


def stack_groups(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, T, D] -> [B, KV, G*T, D]: heads h = k*G + g share KV head k (HF's repeat_kv order)."""
    b, h, t, d = q.shape
    return q.reshape(b, kv_heads, (h // kv_heads) * t, d)


def unstack_groups(o: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of stack_groups: [B, KV, G*T, D] -> [B, H, T, D]."""
    b, kv, gt, d = o.shape
    return o.reshape(b, heads, gt * kv // heads, d)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
    """q: [N, H, D] (RoPE applied); caches [rows, KV, cap, D] already hold this step's K/V.
    Returns [N, H*D]."""
    n, heads, d = q.shape
    kv_heads = k_cache.shape[1]
    if meta.uniform and not meta.alone:
        return _batched(q, k_cache, v_cache, meta, kv_heads).reshape(n, heads * d)
    out = q.new_empty(n, heads, d)
    if meta.num_rows:
        # padding slots stay uninitialised: their query rows are computed and dropped, and a
        # query row's output depends on that row only
        padded = q.new_empty(meta.num_rows * meta.tq, heads, d)
        padded[meta.slot_index] = q[meta.flat_index]
        o = _batched(padded, k_cache, v_cache, meta, kv_heads)          # [R*Tq, H, D]
        out[meta.flat_index] = o[meta.slot_index]
    for (row, s, cnt, start), mask in zip(meta.alone, meta.alone_masks):
        qa = stack_groups(q[s:s + cnt].transpose(0, 1).unsqueeze(0), kv_heads)  # [1, KV, G*n, D]
        k = k_cache[row:row + 1, :, :start + cnt]
        v = v_cache[row:row + 1, :, :start + cnt]
        o = F.scaled_dot_product_attention(qa, k, v, attn_mask=mask)
        out[s:s + cnt] = unstack_groups(o, heads)[0].transpose(0, 1)
    return out.reshape(n, heads * d)


def _batched(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMeta,
             kv_heads: int) -> torch.Tensor:
    """q: [R*Tq, H, D] row-major padded queries -> [R*Tq, H, D]."""
    r, t, s = meta.num_rows, meta.tq, meta.kv_len
    heads, d = q.shape[1], q.shape[2]
    qb = stack_groups(q.view(r, t, heads, d).transpose(1, 2), kv_heads)    # [R, KV, G*Tq, D]
    o = F.scaled_dot_product_attention(qb, k_cache[:r, :, :s], v_cache[:r, :, :s], attn_mask=meta.mask)
    return unstack_groups(o, heads).transpose(1, 2).reshape(r * t, heads, d)
