"""Gated DeltaNet's recurrence (Qwen3.5's linear attention, model/deltanet.py): what a step's
rows give the kernels, and the PyTorch reference.

A row's states: its causal conv's last K-1 inputs (conv [rows, 2, C, K-1], the model's dtype)
and its delta-rule state (ssm [rows, 2, VH, DK, DV], the accumulation type: float32, float64 for
a float64 model); index 0 of the second dimension holds the states, 1 a snapshot of them after
a given token (a prompt's but its last token: its siblings start from there,
engine/kv/states.py). A step's tokens run through them in order, row by row
(``StatePlan.seqs``): its committed tokens advance the row's states in place, the nodes of its
chain draft after them advance a copy, so the states stay those of the committed tokens until
the engine accepts nodes (engine/kv/states.py runs the accepted nodes' kept inputs through
again, in place: the same code on the same inputs, so the same bits as if they had been
committed tokens).

Per token (Hugging Face's Qwen3_5GatedDeltaNet, token by token: its recurrent form): the conv
of each channel over the token and the K-1 inputs before it, rounded to the dtype, SiLU,
rounded; q and k of each key head scaled to unit length (q also by DK ** -0.5); beta =
sigmoid(b) rounded to the dtype, g = -exp(A_log) softplus(a + dt_bias); the state S (each
value head's, reading its key head's q and k) decays by exp(g), S += k (beta (v - S^T k))^T,
o = S^T q, rounded to the dtype.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class StatePlan:
    """The rows of one step of a model with recurrent layers. ``seqs`` [S, 6] int64 on the step's
    device: per row (its tokens consecutive, in step order) its state row, first flat token, tokens,
    committed tokens (the rest: chain draft nodes), 1 if its first token is position 0 (its
    states start from zeros), and the count of its tokens after which its states are copied to
    its snapshot (0: none). ``drafts`` [D] long: the flat index of every draft node, row by
    row; ``kept``: layer -> the inputs of those nodes (what acceptance runs through again)."""

    seqs: torch.Tensor | None
    drafts: torch.Tensor | None = None
    kept: dict = field(default_factory=dict)
    host: object = None                 # ``seqs`` as a numpy array (the engine's copy: seqs may be on a GPU)
    drafts_host: object = None          # ``drafts`` as a numpy array (None: no drafts)
    nodes: dict = field(default_factory=dict)   # a drafting batch plan's index -> (its row, its first kept node)

    def portable(self) -> "StatePlan":
        """The plan as host arrays alone (for another process: a tensor parallel rank)."""
        return StatePlan(None, host=self.host, drafts_host=self.drafts_host)

    def on(self, device) -> "StatePlan":
        """A ``portable`` plan with its tensors made on ``device``."""
        drafts = None if self.drafts_host is None else torch.from_numpy(self.drafts_host).to(device)
        return StatePlan(torch.from_numpy(self.host).to(device), drafts, host=self.host, drafts_host=self.drafts_host,
                         nodes=self.nodes)


def delta_rule(mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_w: torch.Tensor, neg_a: torch.Tensor,
               dt_bias: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor, seqs: torch.Tensor,
               dims: tuple[int, int, int, int, int], out: bool = True) -> torch.Tensor | None:
    """The reference: ``mixed`` [N, C] (q | k | v channels, before the conv), ``b``, ``a`` [N,
    VH], the conv's weights [C, K], -exp(A_log) and dt_bias [VH] in the accumulation type, the
    states and their snapshots (updated as the module docstring says), ``seqs`` (``StatePlan``).
    Returns o [N, VH * DV] in the dtype (None where ``out`` is False)."""
    kh, vh, dk, dv, k = dims
    acc = ssm.dtype
    dt = mixed.dtype
    res = mixed.new_zeros(mixed.shape[0], vh * dv) if out else None     # a token in no run: 0
    for row, t0, cnt, done, fresh, snap in seqs.tolist():
        if fresh:
            conv[row, 0].zero_()
            ssm[row, 0].zero_()
        win = conv[row, 0].to(acc)                                       # [C, K-1]
        state = ssm[row, 0]
        for j in range(cnt):
            if j == done:                                                # draft nodes: on a copy
                state = state.clone()
            t = t0 + j
            x = mixed[t].to(acc)
            full = torch.cat([win, x[:, None]], dim=1)                  # [C, K]
            c = F.silu((full * conv_w.to(acc)).sum(1).to(dt).to(acc)).to(dt).to(acc)
            win = full[:, 1:]
            if j + 1 == done:
                conv[row, 0].copy_(win.to(conv.dtype))
            if j + 1 == snap:
                conv[row, 1].copy_(win.to(conv.dtype))
            q, kk, v = c[:kh * dk].view(kh, dk), c[kh * dk:2 * kh * dk].view(kh, dk), c[2 * kh * dk:].view(vh, dv)
            q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * dk ** -0.5
            kk = kk / torch.sqrt((kk * kk).sum(-1, keepdim=True) + 1e-6)
            q, kk = q.repeat_interleave(vh // kh, 0), kk.repeat_interleave(vh // kh, 0)
            beta = torch.sigmoid(b[t].to(acc)).to(dt).to(acc)
            g = neg_a * F.softplus(a[t].to(acc) + dt_bias)
            state.mul_(g.exp()[:, None, None])
            mem = (state * kk[:, :, None]).sum(1)                        # [VH, DV]
            state.add_(kk[:, :, None] * ((v - mem) * beta[:, None])[:, None, :])
            if res is not None:
                res[t] = (state * q[:, :, None]).sum(1).reshape(-1).to(dt)
            if j + 1 == snap:
                ssm[row, 1].copy_(state)
    return res


def gated_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The reference of the DeltaNet's gated RMS norm: each head's DV values of o [N, VH * DV]
    normed in float32 (float64 for a float64 model), rounded, times ``weight`` [DV], rounded,
    times SiLU of z (as o), rounded (Hugging Face's Qwen3_5RMSNormGated)."""
    dv = weight.shape[0]
    acc = torch.float64 if o.dtype == torch.float64 else torch.float32
    x = o.reshape(-1, dv).to(acc)
    y = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(o.dtype) * weight
    return (y.to(acc) * F.silu(z.reshape(-1, dv).to(acc))).to(o.dtype).view(o.shape)
