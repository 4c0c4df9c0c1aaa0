"""The reference kernels: plain PyTorch on any device, slow and simple.

Used where no faster backend applies (the native extension not built, ``TAILRL_PURE_PYTHON=1``,
a dtype the native kernels lack) and in tests as the oracle the fast kernels are checked
against. RoPE is applied in the model's dtype, attention is SDPA over each query's gathered
row. Row-local like the others, but SDPA's and the matmuls' reduction orders are PyTorch's:
bit-identity with and without speculation is the native / Triton backends' property.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tailrl.kernels.backend import Backend, Rope, RopeTables
from tailrl.kernels.layout import BLOCK, AttentionMeta, gather_rows, key_index, unpack_keys


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, D]; cos/sin: [N, 1, D] (already gathered at each token's position)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """k, v [N, KV, D] into the pool (keys [blocks, KV, BLOCK * D], values [blocks, KV, BLOCK, D])
    at ``slots`` [N] (block * BLOCK + lane)."""
    block, lane = slots // BLOCK, slots % BLOCK
    idx = key_index(lane, k.shape[-1])                                  # [N, D]
    k_cache[block[:, None, None], torch.arange(k.shape[1], device=k.device)[None, :, None], idx[:, None, :]] = k
    v_cache[block, :, lane] = v


def visibility(meta: AttentionMeta, origin: torch.Tensor | None = None) -> torch.Tensor:
    """[N, kv_len] bool: which cache positions of its row each query sees (``origin``: the
    first position of its prefix each query sees, a sliding window's; its extras it sees all)."""
    n, s = meta.num_tokens, meta.kv_len
    at = torch.arange(s, device=meta.prefix.device)[None, :]
    vis = at < meta.prefix.long()[:, None]
    if origin is not None:
        vis &= at >= origin.to(vis.device).long()[:, None]
    for t in range(n):
        c = int(meta.ecount[t])
        if c:
            e0 = int(meta.estart[t])
            vis[t, meta.extra[e0:e0 + c].long()] = True
    return vis


def reference_attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMeta, origin: torch.Tensor | None = None,
                     scale: float | None = None, softcap: float | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [N, H, D] (RoPE applied); the pool (keys [blocks, KV, BLOCK * D], values [blocks, KV,
    BLOCK, D]) already holds this step's K/V. Returns [N, H*D]: PyTorch's SDPA over each query's
    row, gathered through its block table (``softcap``: the scores capped as Hugging Face's
    eager attention caps them, then the softmax; ``sinks`` [H]: one more logit per head in each
    softmax, weighing no value, as gpt-oss's eager attention). Positions a query does not see are
    zeroed first: a block's unwritten lanes hold whatever the pool held (never read by the native
    kernel)."""
    n, heads, d = q.shape
    kv = k_cache.shape[1]
    s = meta.kv_len
    keys, values = gather_rows(k_cache, v_cache, meta.block_table, meta.q_row, s)
    vis = visibility(meta, origin).to(q.device)                        # [N, S]
    seen = vis[:, None, :, None]
    k = unpack_keys(keys, d)[:, :, :, :s].transpose(-1, -2).masked_fill(~seen, 0)   # [N, KV, S, D]
    v = values[:, :, :s].masked_fill(~seen, 0)
    q = q.view(n, kv, heads // kv, d)
    if softcap or sinks is not None:
        scores = q @ k.transpose(-1, -2) * (d ** -0.5 if scale is None else scale)
        scores = torch.tanh(scores / softcap) * softcap if softcap else scores
        scores = scores.masked_fill(~vis[:, None, None, :], float("-inf"))
        if sinks is None:
            return (scores.softmax(-1) @ v).reshape(n, heads * d)
        sink = sinks.to(scores.dtype).view(1, kv, heads // kv, 1).expand(n, -1, -1, 1)      # [N, KV, G, 1]
        weights = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        return (weights @ v).reshape(n, heads * d)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=vis[:, None, None, :], scale=scale)
    return o.reshape(n, heads * d)


class ReferenceBackend(Backend):
    name = "reference"
    capturable = False

    def rotary(self, tables: RopeTables, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return tables.cos[positions].unsqueeze(1), tables.sin[positions].unsqueeze(1)   # [N, 1, D]

    def rope_attend(self, qkv: torch.Tensor, rope: Rope, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMeta, heads: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
        n = qkv.shape[0]
        kv_heads, d = v_cache.shape[1], v_cache.shape[3]
        nqk = heads + kv_heads
        qk = apply_rope(qkv[:, :nqk * d].view(n, nqk, d), rope.cos, rope.sin)
        write_kv(k_cache, v_cache, meta.write_slot, qk[:, heads:], qkv[:, nqk * d:].view(n, kv_heads, d))
        return reference_attend(qk[:, :heads], k_cache, v_cache, meta, rope.origin, rope.scale, rope.softcap, sinks)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)


REFERENCE = ReferenceBackend()
