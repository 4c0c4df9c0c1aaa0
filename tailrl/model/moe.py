"""A sparse mixture of experts in place of a layer's MLP (Qwen3-MoE, Qwen2-MoE, Mixtral).

Per token: the router's logits (an [E, H] product), their softmax in float32, the top-k experts,
their weights renormalised to sum to 1 where the model says so; each chosen expert's MLP on the
token (``Backend.experts``), the outputs weighted and added in ascending expert id in the model's
dtype (Hugging Face's order: its loop over the experts index-adds each), and Qwen2-MoE's shared
expert, gated by a sigmoid, added last.

Batch invariance, as everywhere in a step: a token's route and result depend on its own row
alone. Every product is the backend's row-invariant one; the top k are taken by a stable sort
(ties to the lower expert id) rather than ``topk``, whose tie-breaking CUDA chooses by the number
of rows; and the renormalising sum and the weighted sum run in a fixed order, one column at a
time.
"""
from __future__ import annotations

import torch
from torch import nn

from tailrl.kernels import Backend
from tailrl.model.args import ModelArgs


def route(logits: torch.Tensor, k: int, normalise: bool, float32_weights: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (each token's k experts [T, k], ascending ids; their weights [T, k],
    float32 where ``float32_weights`` (Mixtral's), else in the logits' dtype)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    top, ids = top[:, :k], ids[:, :k]
    if normalise:
        total = top[:, 0]
        for j in range(1, k):
            total = total + top[:, j]
        top = top / total[:, None]
    ids, order = torch.sort(ids, dim=-1)
    top = top.gather(1, order)
    return ids, top if float32_weights else top.to(logits.dtype)


class SparseMoe(nn.Module):
    """A sparse layer's MLP: the router [E, H], the experts' [gate | up] weights [E, 2I, H] and
    down projections [E, H, I] (Hugging Face's fused layout), and Qwen2-MoE's shared expert."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.a = a
        e, h, i = a.num_experts, a.hidden_size, a.moe_intermediate_size
        self.router = nn.Parameter(torch.zeros(e, h))
        self.gate_up = nn.Parameter(torch.zeros(e, 2 * i, h))
        self.down = nn.Parameter(torch.zeros(e, h, i))
        s = a.shared_expert_size
        self.shared_gate_up = nn.Linear(h, 2 * s, bias=False) if s else None
        self.shared_down = nn.Linear(s, h, bias=False) if s else None
        self.shared_gate = nn.Parameter(torch.zeros(1, h)) if s else None

    def forward(self, h: torch.Tensor, kernels: Backend) -> torch.Tensor:
        a = self.a
        ids, weights = route(kernels.linear(h, self.router), a.experts_per_token, a.norm_topk_prob, a.router_float32)
        out = kernels.experts(h, self.gate_up, self.down, ids, weights)
        if self.shared_gate_up is None:
            return out
        shared = kernels.silu_mul_linear(kernels.linear(h, self.shared_gate_up.weight), self.shared_down.weight)
        return out + torch.sigmoid(kernels.linear(h, self.shared_gate)) * shared

    def linears(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(weight, bias) of the products ``forward`` computes through ``Backend.linear`` (the
        experts' own go through ``Backend.experts``)."""
        out = [(self.router, None)]
        if self.shared_gate_up is not None:
            out += [(self.shared_gate_up.weight, None), (self.shared_down.weight, None), (self.shared_gate, None)]
        return out
