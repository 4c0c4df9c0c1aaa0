"""TLT's learned drafter: an EAGLE-style one-layer network over the target's hidden states.

One drafting step maps (feature of position t, token at t + 1) to the feature of position
t + 1 and, through the target's frozen LM head, a distribution over the token at t + 2:

    x   = fc([f_t, rms(embed(tok_{t+1}))])                   # [B, 2H] -> [B, H]
    x   = x + mix(rms(x))                                     # the attention sublayer (below)
    x   = x + down(silu(gate(rms(x))) * up(rms(x)))           # SwiGLU MLP, the target's width
    f'  = rms(x) * out_norm                                   # in the target's normed-hidden space
    p   = softmax(lm_head(f'))

The first step starts from the target's own (normed) hidden state f_t = h_t at the position
that sampled the request's last token; later steps feed back the drafter's f'. Training
regresses f' on the target's h_{t+1} and matches p to the target's next-token distribution.

Why the attention sublayer sees only the current feature: the target's hidden state already
summarises the whole context through all of its layers, and the drafter only extrapolates a
few tokens from it, carrying its own state in the fed-back feature (a recurrence). With one
key, softmax attention is exactly ``o(v(x))``, folded here into one linear map ``mix``. In
exchange the drafter keeps no K/V of its own: nothing to roll back on rejection, to move on
preemption, or to ship with a migrating request; a step for a batch of requests is a few
[B, H] matmuls. The price, measured on the workload model: held-out first-token agreement
0.61 (0.94 on training windows), since a next token that copies an earlier one cannot be
looked up; attending over the request's past features (EAGLE) is the next step.

The embedding and LM head are the target's (shared, frozen, never saved): a checkpoint is
the trainable weights (``drafter.safetensors``) and ``drafter.json`` (sizes).
"""
from __future__ import annotations

import copy
import json
import os
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from tailrl.model.args import ModelArgs

CONFIG_FILE = "drafter.json"
WEIGHTS_FILE = "drafter.safetensors"


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6

    @classmethod
    def from_target(cls, a: ModelArgs, intermediate_size: int | None = None) -> "DrafterConfig":
        """Sized from the target: its hidden width (features are its hidden states), its MLP
        width (one of its layers' worth of compute) unless ``intermediate_size`` is given,
        its vocabulary (shared head)."""
        if intermediate_size is not None and intermediate_size < 1:
            raise ValueError(f"drafter: intermediate_size must be >= 1, got {intermediate_size!r}")
        return cls(a.hidden_size, intermediate_size or a.intermediate_size, a.vocab_size, a.rms_norm_eps)


@dataclass
class DrafterData:
    """Training windows over runs of consecutive positions (teacher-forced sequences, or the
    rollout's own hidden states). Position i holds the target's normed hidden state h_i and
    the token x_i at i; h_i sampled x_{i+1}. A window starting at i reads i .. i + unroll."""

    hidden: torch.Tensor        # [N, H] float32
    tokens: torch.Tensor        # [N] long
    starts: torch.Tensor        # [S] window starts whose window stays inside one run


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class Drafter(nn.Module):
    """``embed`` [V, H] and ``head`` [V, H] are the target's weights; they are kept as frozen
    buffers in the drafter's dtype (not parameters: the optimiser never sees them)."""

    def __init__(self, cfg: DrafterConfig, embed: torch.Tensor, head: torch.Tensor):
        super().__init__()
        h, v = cfg.hidden_size, cfg.vocab_size
        if tuple(embed.shape) != (v, h) or tuple(head.shape) != (v, h):
            raise ValueError(f"drafter: target embedding {tuple(embed.shape)} / head {tuple(head.shape)} "
                             f"do not match the drafter's vocab_size={v}, hidden_size={h}")
        self.cfg = cfg
        self.fc = nn.Linear(2 * h, h)
        self.embed_norm = nn.Parameter(torch.ones(h))
        self.mix_norm = nn.Parameter(torch.ones(h))
        self.mix = nn.Linear(h, h, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(h))
        self.gate_up = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.out_norm = nn.Parameter(torch.ones(h))
        self.register_buffer("embed", embed.detach().float().clone(), persistent=False)
        self.register_buffer("head", head.detach().float().clone(), persistent=False)
        with torch.no_grad():                      # start near "copy the input feature"
            self.fc.weight.zero_()
            self.fc.weight[:, :h].copy_(torch.eye(h))
            self.fc.bias.zero_()
            self.mix.weight.mul_(0.1)
            self.down.weight.mul_(0.1)

    @classmethod
    def for_target(cls, model: nn.Module, intermediate_size: int | None = None) -> "Drafter":
        """A freshly initialised drafter over a target ``Transformer`` (MLP width: the target's,
        or ``intermediate_size``)."""
        return cls(DrafterConfig.from_target(model.args, intermediate_size), *target_weights(model))

    def shadow(self) -> "Drafter":
        """A trainable copy of the trainable weights that shares this drafter's frozen target
        embedding and head (``share_target`` on either refreshes both)."""
        embed, head = self.embed, self.head
        self.embed = self.head = None                   # not copied: shared
        try:
            twin = copy.deepcopy(self)
        finally:
            self.embed, self.head = embed, head
        twin.embed, twin.head = embed, head
        return twin

    @torch.no_grad()
    def copy_weights_from(self, other: "Drafter") -> None:
        """Overwrite the trainable weights with ``other``'s (same config)."""
        theirs = dict(other.named_parameters())
        for name, p in self.named_parameters():
            p.copy_(theirs[name])

    @torch.no_grad()
    def share_target(self, model: nn.Module) -> None:
        """Copy the target's current embedding and LM head (after an RL weight update)."""
        embed, head = target_weights(model)
        self.embed.copy_(embed.float())
        self.head.copy_(head.float())

    def step(self, feature: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """feature [B, H], tokens [B] -> (next feature [B, H], logits [B, V])."""
        eps = self.cfg.rms_norm_eps
        feature = feature.to(self.fc.weight.dtype)
        e = _rms(F.embedding(tokens, self.embed), eps) * self.embed_norm
        x = self.fc(torch.cat([feature, e], dim=-1))
        x = x + self.mix(_rms(x, eps) * self.mix_norm)
        gate, up = self.gate_up(_rms(x, eps) * self.mlp_norm).chunk(2, dim=-1)
        x = x + self.down(F.silu(gate) * up)
        out = _rms(x, eps) * self.out_norm
        return out, F.linear(out, self.head)

    # ---- checkpoint ---------------------------------------------------------------------
    def save(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, CONFIG_FILE), "w") as f:
            json.dump(asdict(self.cfg), f, indent=1)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, os.path.join(path, WEIGHTS_FILE))

    @classmethod
    def load(cls, path: str, model: nn.Module) -> "Drafter":
        """Load a drafter saved by ``save`` onto the target ``model`` (a ``Transformer``);
        fails naming the file or the size that does not fit."""
        cfg_path, w_path = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
        for p in (cfg_path, w_path):
            if not os.path.isfile(p):
                raise ValueError(f"drafter: {path!r} has no {os.path.basename(p)}")
        with open(cfg_path) as f:
            cfg = DrafterConfig(**json.load(f))
        want = DrafterConfig.from_target(model.args)
        if (cfg.hidden_size, cfg.vocab_size) != (want.hidden_size, want.vocab_size):
            raise ValueError(f"drafter: {path!r} was trained for hidden_size={cfg.hidden_size}, "
                             f"vocab_size={cfg.vocab_size}; the target has {want.hidden_size}, {want.vocab_size}")
        drafter = cls(cfg, *target_weights(model))
        drafter.load_state_dict(load_file(w_path))
        return drafter.eval()


def target_weights(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The target ``Transformer``'s embedding and LM-head weights (tied models share one)."""
    embed = model.embed.weight
    return embed, embed if model.lm_head is None else model.lm_head.weight
