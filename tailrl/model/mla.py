"""DeepSeek-V3's and V2's multi-head latent attention (MLA: DeepSeek-V3 / R1, Kimi K2, Moonlight, V2), its
latent kept in the K/V pool as one K/V head that every query head attends to.

Hugging Face's module, per token: the query, by one projection or through a low-rank one and its
norm (``q_lora_rank``), [nope | rope] per head; a shared latent c (``kv_lora_rank``, normed) and
one rotary key k_pe; the latent up-projected to each head's [key nope | value] (``kv_b_proj``:
W_UK_h, W_UV_h); head h's score with a key q_nope . (W_UK_h c) + q_rope . k_pe, its output
W_UV_h (sum of p c). The same sums absorbed (DeepSeek's own inference form): head h's query
becomes [q_rope | W_UK_h^T q_nope] and every head's key the token's [k_pe | c], its value c; the
output's latent part goes through W_UV_h. So the pool keeps kv_lora_rank + qk_rope_head_dim
numbers a token and layer for keys, as many for values (Moonlight-16B-A3B: 62 KiB a token where
every head's keys and values would take 324 KiB), and the kernels are the usual ones: a K/V
head shared by every query head, row-invariant (speculation stays lossless, chains and trees).

The rotary dimensions: a head's [rope | latent] reordered by ``rope.head_order`` so that the
kernels' rotate-half pairs hold DeepSeek's pairs (interleaved where ``rope_interleave``), the
other dimensions turned by cos 1 and sin 0 (rope.py); the value [c | 0] is not reordered. A
head's absorbed query and its output's up-projection are products per head through the
backend's row-invariant ``linear``, W_UK_h^T kept as a copy made again whenever the weight
changes (``_absorbed``: its version counter).
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
        # our head dimension j is dimension dims[j] of [rope | latent] (a list: the module is made
        # on the meta device; its tensor is made per device, ``_dims``)
        with torch.device("cpu"):
            order = head_order(kv_lora + rope, rope, a.rope_interleaved)
        self.dims = list(range(kv_lora + rope)) if order is None else order.tolist()
        self._on: dict = {}
        self._uk: tuple | None = None

    def forward(self, x: torch.Tensor, kernels: Backend, rope: Rope, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMeta) -> torch.Tensor:
        """``x`` [N, hidden] normed -> the attention's output projected [N, hidden]."""
        a = self.a
        q_lora, kv_lora, nope, rot, v = a.mla
        n, heads = x.shape[0], a.num_heads
        if self.q is not None:
            q = kernels.linear(x, self.q.weight)
        else:
            q = kernels.linear(kernels.rms_norm(kernels.linear(x, self.q_a.weight), self.q_a_norm, a.rms_norm_eps),
                               self.q_b.weight)
        q = q.view(n, heads, nope + rot)
        latent = kernels.linear(x, self.kv_a.weight)                              # [N, kv_lora + rope]
        c = kernels.rms_norm(latent[:, :kv_lora].contiguous(), self.kv_a_norm, a.rms_norm_eps)
        uk, uv = self._per_head()
        absorbed = torch.stack([kernels.linear(q[:, h, :nope].contiguous(), uk[h]) for h in range(heads)], dim=1)
        dims = self._dims(x.device)
        queries = torch.cat([q[:, :, nope:], absorbed], dim=2)[:, :, dims]      # [N, H, rope + kv_lora]
        key = torch.cat([latent[:, kv_lora:], c], dim=1)[:, dims]
        value = torch.cat([c, c.new_zeros(n, rot)], dim=1)
        qkv = torch.cat([queries.reshape(n, -1), key, value], dim=1)
        out = kernels.rope_attend(qkv, rope, k_cache, v_cache, meta, heads).view(n, heads, kv_lora + rot)
        o = torch.cat([kernels.linear(out[:, h, :kv_lora].contiguous(), uv[h]) for h in range(heads)], dim=1)
        return kernels.linear(o, self.o.weight)

    def _per_head(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each head's W_UK_h^T [kv_lora, nope] (a contiguous copy) and W_UV_h [v, kv_lora] (a view
        of ``kv_b``), made again when ``kv_b`` has changed since (an in-place write through any
        view of it, a trainer's weight update, bumps its version counter; a weight made in
        inference mode has none: made every time)."""
        w = self.kv_b.weight
        version = None if w.is_inference() else w._version
        if self._uk is None or version is None or self._uk[0] != version or self._uk[1] != w.device:
            _, kv_lora, nope, _, v = self.a.mla
            per_head = w.detach().view(self.a.num_heads, nope + v, kv_lora)
            uk = per_head[:, :nope].transpose(1, 2).contiguous()
            self._uk = (version, w.device, list(uk.unbind(0)), list(per_head[:, nope:].unbind(0)))
        return self._uk[2], self._uk[3]

    def _dims(self, device: torch.device) -> torch.Tensor:
        if device not in self._on:
            self._on[device] = torch.tensor(self.dims, device=device)
        return self._on[device]

    def linears(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        mods = (self.q, self.q_a, self.q_b, self.kv_a, self.kv_b, self.o)
        return [(m.weight, None) for m in mods if m is not None]
