"""Qwen3.5's Gated DeltaNet layer: linear attention with a recurrent state per request, in place
of attention in three layers of four (kernels/delta.py computes it; engine/kv/states.py keeps
the states).

Projections fused in one product, [q | k | v (the conv's channels) | z (the norm's gate) | b | a];
a depthwise causal conv of width K over the channels (SiLU after); the gated delta rule per
value head; a gated RMS norm per head; the output projection.
"""
from __future__ import annotations

import torch
from torch import nn

from tailrl.kernels import Backend
from tailrl.kernels.delta import StatePlan
from tailrl.model.args import ModelArgs


class GatedDeltaNet(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.a = a
        kh, vh, kd, vd, width = a.linear_dims
        c = a.conv_channels
        self.in_proj = nn.Linear(a.hidden_size, c + vh * vd + 2 * vh, bias=False)
        self.conv = nn.Parameter(torch.empty(c, width))             # the checkpoint's conv1d.weight [C, 1, K]
        self.dt_bias = nn.Parameter(torch.empty(vh))
        self.A_log = nn.Parameter(torch.empty(vh))
        self.norm = nn.Parameter(torch.empty(vd))                   # the gated norm's (scales by its weight)
        self.out = nn.Linear(vh * vd, a.hidden_size, bias=False)

    def forward(self, h: torch.Tensor, kernels: Backend, states, plan: StatePlan, layer: int) -> torch.Tensor:
        """``h`` [N, hidden] normed; ``states``: this layer's (conv [rows, 2, C, K-1], ssm [rows, 2,
        VH, DK, DV]: states and snapshots, kernels/delta.py); ``plan``: the step's rows. The draft
        nodes' inputs are kept in ``plan.kept[layer]`` for their acceptance. Returns [N, hidden]."""
        a = self.a
        kh, vh, kd, vd, _ = a.linear_dims
        c = a.conv_channels
        proj = kernels.linear(h, self.in_proj.weight)
        mixed, z, b, ab = proj[:, :c], proj[:, c:c + vh * vd], proj[:, c + vh * vd:c + vh * vd + vh], proj[:, -vh:]
        conv, ssm = states
        neg_a, dt_bias = self.decay_terms(ssm.dtype)
        if plan.drafts is not None:
            plan.kept[layer] = (mixed[plan.drafts], b[plan.drafts], ab[plan.drafts])
        o = kernels.delta_rule(mixed, b, ab, self.conv, neg_a, dt_bias, conv, ssm, plan.seqs, a.linear_dims)
        return kernels.linear(kernels.gated_norm(o, z, self.norm, a.rms_norm_eps), self.out.weight)

    def decay_terms(self, acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """-exp(A_log) and dt_bias in the accumulation type ``acc`` [VH] (Hugging Face: A_log in
        float32 first; dt_bias added to a in float32)."""
        return -self.A_log.to(acc).exp(), self.dt_bias.to(acc)

    def advance(self, kernels: Backend, kept: tuple, states, seqs: torch.Tensor) -> None:
        """Run kept draft inputs (``kept``: mixed, b, a rows) through the states in place, as
        committed tokens (``seqs`` over the kept rows): accepted nodes."""
        neg_a, dt_bias = self.decay_terms(states[1].dtype)
        mixed, b, ab = kept
        kernels.delta_rule(mixed, b, ab, self.conv, neg_a, dt_bias, states[0], states[1], seqs, self.a.linear_dims,
                           out=False)
