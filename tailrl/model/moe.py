"""A sparse mixture of experts in place of a layer's MLP (Qwen3-MoE, Qwen2-MoE, Mixtral, GLM-4.5 and
DeepSeek-V3, DeepSeek-V2, gpt-oss).

Per token: the router's logits (an [E, H] product), their softmax in float32, the top-k experts,
their weights renormalised to sum to 1 where the model says so (GLM-4.5, DeepSeek-V3's routing:
``route_groups``); each chosen expert's MLP on the token (``Backend.experts``), the outputs
weighted and added in ascending expert id in the model's dtype (Hugging Face's order: its loop
over the experts index-adds each), and the shared expert (Qwen2-MoE's gated by a sigmoid,
GLM-4.5's not) added last. gpt-oss's: a router with a bias, a token's k experts weighted by the
softmax of their k logits (``route_top_logits``), biases on both expert products and its clamped
SwiGLU (``Backend.experts``). DeepSeek-V2's: a float32 router's softmax, the top k within the
best groups, weights times a scale (``route_softmax_groups``).

Batch invariance, as everywhere in a step: a token's route and result depend on its own row
alone. Every product is the backend's row-invariant one; the top k are taken by a stable sort
(ties to the lower expert id) rather than ``topk``, whose tie-breaking CUDA chooses by the number
of rows; and the renormalising sum and the weighted sum run in a fixed order, one column at a
time. GLM-4.5's float32 router product is the backend's row-invariant ``linear_float32``.
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
        top = top / _sum_columns(top)[:, None]
    ids, order = torch.sort(ids, dim=-1)
    top = top.gather(1, order)
    return ids, top if float32_weights else top.to(logits.dtype)


def route_top_logits(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's route of router logits [T, E]: each token's k largest logits (ties to the lower
    id), their softmax in the logits' dtype as weights. Returns ascending ids [T, k] and weights."""
    top, ids = torch.sort(logits, dim=-1, descending=True, stable=True)
    top = torch.softmax(top[:, :k], dim=-1, dtype=logits.dtype)
    ids, order = torch.sort(ids[:, :k], dim=-1)
    return ids, top.gather(1, order)


def route_softmax_groups(logits: torch.Tensor, k: int, groups: int, chosen: int,
                         scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2's route of float32 router logits [T, E]: their softmax; a token's k best (ties
    to the lower id) within its ``chosen`` best of ``groups`` groups (a group worth its best score;
    all of them where ``chosen`` is ``groups``), weighted by their scores times ``scale``.
    Returns ascending ids [T, k] and float32 weights."""
    t, e = logits.shape
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    choice = probs
    if chosen < groups:
        choice = _in_best_groups(probs, probs.view(t, groups, e // groups).amax(dim=-1), chosen, 0.0)
    ids = torch.sort(torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :k], dim=-1).values
    return ids, choice.gather(1, ids) * scale


def _in_best_groups(choice: torch.Tensor, worth: torch.Tensor, chosen: int, fill: float) -> torch.Tensor:
    """``choice`` [T, E] with every expert outside each token's ``chosen`` best groups by ``worth``
    [T, groups] (ties to the lower group) set to ``fill``."""
    t, groups = worth.shape
    kept = torch.sort(worth, dim=-1, descending=True, stable=True).indices[:, :chosen]
    keep = torch.zeros(t, groups, dtype=torch.bool, device=worth.device).scatter_(1, kept, True)
    return choice.masked_fill(~keep.repeat_interleave(choice.shape[1] // groups, dim=1), fill)


def _sum_columns(w: torch.Tensor) -> torch.Tensor:
    """Each row's sum of ``w`` [T, k], one column at a time (a fixed order)."""
    total = w[:, 0]
    for j in range(1, w.shape[1]):
        total = total + w[:, j]
    return total


def sigmoid_rows(x: torch.Tensor) -> torch.Tensor:
    """sigmoid(x), each element's bits its own whatever the tensor's size: PyTorch's CPU sigmoid
    takes a vectorised path or a scalar one by an element's place in the flattened tensor, and
    their bits differ (a token's scores would change with the rows beside it); a softmax over
    the last dimension computes every row with the same code, and sigmoid(x) = softmax([x, 0])[0]
    (within a unit in the last place of ``torch.sigmoid``)."""
    return torch.softmax(torch.stack([x, torch.zeros_like(x)], dim=-1), dim=-1)[..., 0]


def route_groups(logits: torch.Tensor, bias: torch.Tensor, k: int, groups: int, chosen: int, normalise: bool,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GLM-4.5's (DeepSeek-V3's) route of float32 router logits [T, E]: sigmoid scores
    (``sigmoid_rows``); a group's worth is the sum of its two best scores plus ``bias`` (the
    correction bias [E], which only chooses); a token's k experts are its best by score plus
    bias within its ``chosen`` best of ``groups`` groups (ties to the lower id); their weights
    its scores, renormalised to sum to 1 where ``normalise`` (+ 1e-20, Hugging Face's), times
    ``scale``. Returns ascending ids [T, k] and float32 weights."""
    t, e = logits.shape
    scores = sigmoid_rows(logits)
    choice = scores + bias
    if chosen < groups:
        best = torch.sort(choice.view(t, groups, e // groups), dim=-1, descending=True).values
        choice = _in_best_groups(choice, best[..., 0] + best[..., 1], chosen, float("-inf"))
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :k]
    ids = torch.sort(ids, dim=-1).values
    weights = scores.gather(1, ids)
    if normalise:
        weights = weights / (_sum_columns(weights) + 1e-20)[:, None]
    return ids, weights * scale


class SparseMoe(nn.Module):
    """A sparse layer's MLP: the router [E, H] (GLM-4.5's float32, with its correction bias [E]:
    ``keep_float32``), the experts' [gate | up] weights [E, 2I, H] and down projections
    [E, H, I] (Hugging Face's fused layout), and the shared expert (Qwen2-MoE's gate [1, H])."""

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
        self.shared_gate = nn.Parameter(torch.zeros(1, h)) if a.shared_expert_gate else None
        self.score_bias = nn.Parameter(torch.zeros(e)) if a.router_sigmoid else None
        # gpt-oss: the router's bias [E], the experts' [gate | up] biases [E, 2I] and down biases [E, H]
        self.router_bias = nn.Parameter(torch.zeros(e)) if a.expert_bias else None
        self.gate_up_bias = nn.Parameter(torch.zeros(e, 2 * i)) if a.expert_bias else None
        self.down_bias = nn.Parameter(torch.zeros(e, h)) if a.expert_bias else None

    def keep_float32(self) -> None:
        """GLM-4.5's router and correction bias, DeepSeek-V2's router, in float32 whatever the
        model's dtype (Hugging Face keeps them so: a trainer's updates of them arrive in float32).
        Called once the module has taken the model's dtype."""
        if self.score_bias is not None or self.a.router_softmax_groups:
            self.router = nn.Parameter(self.router.float())
        if self.score_bias is not None:
            self.score_bias = nn.Parameter(self.score_bias.float())

    def forward(self, h: torch.Tensor, kernels: Backend) -> torch.Tensor:
        a = self.a
        if a.router_sigmoid:
            ids, weights = route_groups(kernels.linear_float32(h, self.router), self.score_bias, a.experts_per_token,
                                        a.expert_groups, a.groups_per_token, a.norm_topk_prob, a.routed_scaling)
        elif a.router_softmax_groups:
            ids, weights = route_softmax_groups(kernels.linear_float32(h, self.router), a.experts_per_token,
                                                a.expert_groups, a.groups_per_token, a.routed_scaling)
        elif a.router_topk_softmax:
            ids, weights = route_top_logits(kernels.linear(h, self.router, self.router_bias), a.experts_per_token)
        else:
            ids, weights = route(kernels.linear(h, self.router), a.experts_per_token, a.norm_topk_prob,
                                 a.router_float32)
        biases = None if self.gate_up_bias is None else (self.gate_up_bias, self.down_bias)
        out = kernels.experts(h, self.gate_up, self.down, ids, weights, biases, a.swiglu)
        if self.shared_gate_up is None:
            return out
        shared = kernels.silu_mul_linear(kernels.linear(h, self.shared_gate_up.weight), self.shared_down.weight)
        if self.shared_gate is None:
            return out + shared
        return out + sigmoid_rows(kernels.linear(h, self.shared_gate)) * shared

    def linears(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(weight, bias) of the products ``forward`` computes through ``Backend.linear`` or
        ``linear_float32`` (the experts' own go through ``Backend.experts``)."""
        out = [(self.router, self.router_bias)]     # GLM-4.5's: float32, through ``linear_float32``
        if self.shared_gate_up is not None:
            out += [(self.shared_gate_up.weight, None), (self.shared_down.weight, None)]
        return out + ([(self.shared_gate, None)] if self.shared_gate is not None else [])
