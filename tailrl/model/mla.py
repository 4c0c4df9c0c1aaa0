"""DeepSeek-V3's multi-head latent attention (MLA: DeepSeek-V3 / R1, Kimi K2, Moonlight), computed
as the multi-head attention it equals, over the engine's usual K/V pool.

Per token: the query, by one projection or through a low-rank one and its norm (``q_lora_rank``),
[nope | rope] per head; a shared latent (``kv_lora_rank``, normed) and one rotary key; the latent
up-projected to each head's [key nope | value] (``kv_b_proj``). Each head's key is its nope part
beside the shared rotary one. The K/V pool keeps every head's key and value, the value zero-padded
to the key's width (qk_nope + qk_rope: the pool has one head dimension): the arithmetic of Hugging
Face's module, the kernels and pool of any other attention layer (row-invariant, chains and
trees), at about H times the latent's memory a token.

The rotary dimensions: a head's [rope | nope] (the rope ones first) reordered by
``rope.head_order`` so that the kernels' rotate-half pairs hold DeepSeek's pairs (interleaved
where ``rope_interleave``), the other dimensions turned by cos 1 and sin 0 (rope.py). Scores are
sums over a head's dimensions: their order changes no more than rounding.
"""
from __future__ import annotations

import torch
from torch import nn

from tailrl.kernels import AttentionMeta, Backend, Rope
from tailrl.model.args import ModelArgs
from tailrl.model.rope import head_order


class LatentAttention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.a = a
        q_lora, kv_lora, nope, rope, v = a.mla
        h, heads = a.hidden_size, a.num_heads
        qk = nope + rope
        self.q = nn.Linear(h, heads * qk, bias=False) if not q_lora else None
        self.q_a = nn.Linear(h, q_lora, bias=False) if q_lora else None
        self.q_a_norm = nn.Parameter(torch.ones(q_lora)) if q_lora else None
        self.q_b = nn.Linear(q_lora, heads * qk, bias=False) if q_lora else None
        self.kv_a = nn.Linear(h, kv_lora + rope, bias=False)
        self.kv_a_norm = nn.Parameter(torch.ones(kv_lora))
        self.kv_b = nn.Linear(kv_lora, heads * (nope + v), bias=False)
        self.o = nn.Linear(heads * v, h, bias=False)
        # our head dimension j is the checkpoint's [nope | rope] dimension dims[j] (a list: the
        # module is made on the meta device; its tensor is made per device, ``_dims``)
        ours = list(range(nope, qk)) + list(range(nope))                          # [rope | nope]
        with torch.device("cpu"):
            order = head_order(qk, rope, a.rope_interleaved)
        self.dims = ours if order is None else [ours[i] for i in order.tolist()]
        self._on: dict = {}

    def forward(self, x: torch.Tensor, kernels: Backend, rope: Rope, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMeta) -> torch.Tensor:
        """``x`` [N, hidden] normed -> the attention's output projected [N, hidden]."""
        a = self.a
        q_lora, kv_lora, nope, rot, v = a.mla
        n, heads, qk = x.shape[0], a.num_heads, nope + rot
        if self.q is not None:
            q = kernels.linear(x, self.q.weight)
        else:
            q = kernels.linear(kernels.rms_norm(kernels.linear(x, self.q_a.weight), self.q_a_norm, a.rms_norm_eps),
                               self.q_b.weight)
        latent = kernels.linear(x, self.kv_a.weight)                              # [N, kv_lora + rope]
        c = kernels.rms_norm(latent[:, :kv_lora].contiguous(), self.kv_a_norm, a.rms_norm_eps)
        kv = kernels.linear(c, self.kv_b.weight).view(n, heads, nope + v)
        k = torch.cat([kv[:, :, :nope], latent[:, None, kv_lora:].expand(n, heads, rot)], dim=2)
        values = torch.cat([kv[:, :, nope:], kv.new_zeros(n, heads, qk - v)], dim=2)
        dims = self._dims(q.device)
        qkv = torch.cat([q.view(n, heads, qk)[:, :, dims].reshape(n, -1), k[:, :, dims].reshape(n, -1),
                         values.reshape(n, -1)], dim=1)
        out = kernels.rope_attend(qkv, rope, k_cache, v_cache, meta, heads)     # [N, H * qk]
        return kernels.linear(out.view(n, heads, qk)[:, :, :v].reshape(n, heads * v), self.o.weight)

    def _dims(self, device: torch.device) -> torch.Tensor:
        if device not in self._on:
            self._on[device] = torch.tensor(self.dims, device=device)
        return self._on[device]

    def linears(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        mods = (self.q, self.q_a, self.q_b, self.kv_a, self.kv_b, self.o)
        return [(m.weight, None) for m in mods if m is not None]
