"""TLT's learned drafter: an EAGLE-style one-layer network over the target's hidden states.

A drafter *position* t reads the feature f_t (the target's normed hidden state h_t at a
committed position, or the drafter's own output at a draft position) and the token at t + 1;
it predicts the feature of t + 1 and, through the target's frozen LM head, the token at t + 2:

    x   = fc([f_t, rms(embed(tok_{t+1}))])                   # [B, 2H] -> [B, H]
    x   = x + o(attn(q(x_t), k/v(x_s) for s <= t))            # causal attention, rotary positions
    x   = x + down(silu(gate(rms(x))) * up(rms(x)))           # SwiGLU MLP, the target's width
    f'  = rms(x) * out_norm                                   # in the target's normed-hidden space
    p   = softmax(lm_head(f'))

Attention (EAGLE's design): position t attends over the drafter's own K/V of the request's
earlier positions: the *committed* ones, whose features are the target's (prompt positions
from the prefill, emitted tokens after verification), and the in-flight draft positions on
the path from the draft's root to t (features fed back). K/V of a committed position depend
only on (h_t, tok_{t+1}) (one layer: keys are computed before attention), so they are
computed once and kept per request (``tailrl.drafter.past``); a rejected draft leaves
nothing to roll back. On the workload's tasks the next token often copies an earlier one
(of the prompt or the response): attention can look it up, a recurrence over the last
feature cannot.

Positions are rotary (the target's theta, applied to q and k at absolute positions): scores
depend on relative offsets only, so a partial past (a request imported from another
instance keeps only what this instance computed) and crops of sequences in training need
no re-indexing, and no table limits the length below the target's context. Heads: the
target's ``head_dim`` and ``num_kv_heads`` heads (4 x 32 on ``small``): a copy is one sharp
head, and the K/V kept per position is a third of one target layer's.

A draft's first step is at the root r (the position that sampled the request's last token:
its feature is the target's h_r); depth d sits at r + d - 1 and sees the committed positions
< r, then the path r .. r + d - 1. ``unroll`` (training) computes the same thing for every
root of whole teacher-forced sequences at once: unroll step k at position t is depth k + 1
of the draft rooted at t - k (EAGLE-3's "training-time test" masks).

The embedding and LM head are the target's (shared, frozen, never saved): a checkpoint is
the trainable weights (``drafter.safetensors``) and ``drafter.json`` (sizes).
"""
from __future__ import annotations

import copy
import json
import os
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from tailrl.model.args import ModelArgs

CONFIG_FILE = "drafter.json"
WEIGHTS_FILE = "drafter.safetensors"
NEG_INF = float("-inf")


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    draft_vocab: int = 0        # tokens the head covers (``Drafter.vocab``); 0: the target's whole vocabulary

    @classmethod
    def from_target(cls, a: ModelArgs, intermediate_size: int | None = None, draft_vocab: int = 0) -> "DrafterConfig":
        """Sized from the target: its hidden width (features are its hidden states), its MLP
        width (one of its layers' worth of compute) unless ``intermediate_size`` is given,
        its vocabulary (shared head; ``draft_vocab`` of its tokens if given), ``num_kv_heads``
        heads of its ``head_dim``, its RoPE theta."""
        if intermediate_size is not None and intermediate_size < 1:
            raise ValueError(f"drafter: intermediate_size must be >= 1, got {intermediate_size!r}")
        return cls(a.hidden_size, intermediate_size or a.intermediate_size, a.vocab_size, a.num_kv_heads,
                   a.head_dim, a.rope_theta, a.rms_norm_eps, draft_vocab)


@dataclass
class DrafterData:
    """Teacher-forced sequences (prompt + response), or runs of the rollout's own positions,
    concatenated. Position i holds the target's normed hidden state h_i and the token x_i at
    i; h_i sampled x_{i+1}. Sequence s is rows ``offsets[s] .. offsets[s + 1]``; its drafts
    are rooted at its positions ``first[s]`` or later (the last prompt position: drafting
    starts there), so only those roots count in the loss."""

    hidden: torch.Tensor        # [N, H] float32
    tokens: torch.Tensor        # [N] long
    offsets: torch.Tensor       # [S + 1] long, offsets[0] == 0, offsets[-1] == N
    first: torch.Tensor         # [S] long, the first root position of each sequence that counts

    def __post_init__(self) -> None:
        if self.hidden.shape[0] != self.tokens.shape[0] or int(self.offsets[-1]) != self.tokens.shape[0]:
            raise ValueError(f"drafter data: hidden {tuple(self.hidden.shape)}, tokens {tuple(self.tokens.shape)} "
                             f"and offsets (ending at {int(self.offsets[-1])}) disagree")
        if len(self.first) != len(self.offsets) - 1:
            raise ValueError(f"drafter data: first has {len(self.first)} entries for {len(self.offsets) - 1} sequences")

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def windows(self, unroll: int) -> int:
        """Draft roots that train all ``unroll`` steps (a root r needs r + unroll < length)."""
        return int((self.lengths - unroll - self.first).clamp(min=0).sum())


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _shift(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """``x`` moved ``n`` places later along ``dim`` (zeros come in first): out[t] = x[t - n]."""
    if n == 0:
        return x
    pad = torch.zeros_like(x.narrow(dim, 0, n))
    return torch.cat([pad, x.narrow(dim, 0, x.shape[dim] - n)], dim)


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of t [..., head_dim] (halves rotated, as the target's)."""
    half = t.shape[-1] // 2
    return t * cos + torch.cat([-t[..., half:], t[..., :half]], -1) * sin


class Drafter(nn.Module):
    """``embed`` [V, H] and ``head`` [V, H] are the target's weights; they are kept as frozen
    buffers in the drafter's dtype (not parameters: the optimiser never sees them). The drafter
    lives on their device (the target's): every tensor it makes follows its weights.

    Draft vocabulary (EAGLE-3's): with ``cfg.draft_vocab`` K > 0 the head keeps only the rows
    of the K target tokens in ``vocab`` (ascending ids, saved with the weights; see
    ``tailrl.drafter.vocab``), so its logits are [..., K] and ``token_ids`` maps their indices
    to the target's ids. The head is most of a drafter step's weights on a real checkpoint
    (Qwen2.5-0.5B: 136M of ~150M parameters a depth), so a step reads a fraction of them; a
    token outside ``vocab`` is never drafted (drafts are verified: outputs do not change)."""

    def __init__(self, cfg: DrafterConfig, embed: torch.Tensor, head: torch.Tensor,
                 vocab: torch.Tensor | None = None):
        super().__init__()
        h, v = cfg.hidden_size, cfg.vocab_size
        if tuple(embed.shape) != (v, h) or tuple(head.shape) != (v, h):
            raise ValueError(f"drafter: target embedding {tuple(embed.shape)} / head {tuple(head.shape)} "
                             f"do not match the drafter's vocab_size={v}, hidden_size={h}")
        vocab = _checked_vocab(vocab, cfg)
        self.cfg = cfg
        inner = cfg.num_heads * cfg.head_dim
        self.fc = nn.Linear(2 * h, h)
        self.embed_norm = nn.Parameter(torch.ones(h))
        self.attn_norm = nn.Parameter(torch.ones(h))
        self.qkv = nn.Linear(h, 3 * inner, bias=False)
        self.o = nn.Linear(inner, h, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(h))
        self.gate_up = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.out_norm = nn.Parameter(torch.ones(h))
        self.register_buffer("embed", embed.detach().float().clone(), persistent=False)
        self.register_buffer("head", _rows(head, vocab).detach().float().clone(), persistent=False)
        self.register_buffer("vocab", vocab)      # saved with the weights where there is one
        # not a buffer: float64 whatever the drafter's dtype (``.to(bfloat16)`` would round it,
        # putting position 2000's cosines off by up to 0.33, and a bfloat16 copy's keys out of
        # step with the float32 drafter's queries)
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None     # cos, sin [max_pos, D]
        with torch.no_grad():                      # start near "copy the input feature"
            self.fc.weight.zero_()
            self.fc.weight[:, :h].copy_(torch.eye(h))
            self.fc.bias.zero_()
            self.o.weight.mul_(0.1)
            self.down.weight.mul_(0.1)
        self.to(embed.device)

    @classmethod
    def for_target(cls, model: nn.Module, intermediate_size: int | None = None,
                   vocab: torch.Tensor | None = None) -> "Drafter":
        """A freshly initialised drafter over a target ``Transformer`` (MLP width: the target's,
        or ``intermediate_size``; its head over ``vocab``'s tokens if given, else all)."""
        cfg = DrafterConfig.from_target(model.args, intermediate_size, len(vocab) if vocab is not None else 0)
        return cls(cfg, *target_weights(model), vocab=vocab)

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
        self.head.copy_(_rows(head, self.vocab).float())

    def token_ids(self, index: torch.Tensor) -> torch.Tensor:
        """The target's token ids of head indices (logits' last dimension)."""
        return index if self.vocab is None else self.vocab[index]

    # ---- the layer, piece by piece ----------------------------------------------------------
    def _input(self, feature: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """fc([f, rms(embed(tok))]): [..., H], [...] -> [..., H]."""
        e = _rms(F.embedding(tokens, self.embed), self.cfg.rms_norm_eps) * self.embed_norm
        return self.fc(torch.cat([feature.to(self.fc.weight.dtype), e], dim=-1))

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor, end: int | None = None) -> tuple[torch.Tensor, ...]:
        """x [..., H], positions [...] (below ``end`` if given) -> q, k, v [..., heads, head_dim];
        q and k rotated, q scaled."""
        c = self.cfg
        qkv = self.qkv(_rms(x, c.rms_norm_eps) * self.attn_norm)
        q, k, v = qkv.unflatten(-1, (3, c.num_heads, c.head_dim)).unbind(-3)
        cos, sin = self._rope(positions, x.dtype, end)                                    # [..., 1, D]
        return _rotate(q, cos, sin) * c.head_dim ** -0.5, _rotate(k, cos, sin), v

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype, end: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [..., 1, head_dim] at ``positions`` [...] from a table (computed in float64,
        grown on demand: a drafting step is a few small ops, and trigonometry per step shows).
        ``end``: a bound on the positions known to the caller (else read from them: on a GPU,
        a wait for the device)."""
        need = end if end is not None else int(positions.max()) + 1 if positions.numel() else 1
        cos, sin = self.rope_table(need, dtype)
        return cos[positions].unsqueeze(-2), sin[positions].unsqueeze(-2)

    def rope_table(self, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos and sin tables [>= end, head_dim] in ``dtype``: the current ones, or new ones
        (at least doubled) where they are too short or of another dtype."""
        if self._rope_table is None or self._rope_table[0].shape[0] < end or self._rope_table[0].dtype != dtype:
            size = max(end, 2 * (self._rope_table[0].shape[0] if self._rope_table is not None else 512))
            dev = self.fc.weight.device
            angles = torch.arange(size, dtype=torch.float64, device=dev).unsqueeze(-1) * self.inv_freq.to(dev)
            angles = torch.cat([angles, angles], -1)
            self._rope_table = (angles.cos().to(dtype), angles.sin().to(dtype))
        return self._rope_table

    def _output(self, x: torch.Tensor, att: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual after attention (att [..., heads * head_dim]), the MLP, the output feature and logits."""
        eps = self.cfg.rms_norm_eps
        x = x + self.o(att)
        gate, up = self.gate_up(_rms(x, eps) * self.mlp_norm).chunk(2, dim=-1)
        x = x + self.down(F.silu(gate) * up)
        out = _rms(x, eps) * self.out_norm
        return out, F.linear(out, self.head)

    def committed_kv(self, hidden: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
                     end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of committed positions: hidden [P, H] (the target's h_t), next_tokens [P] (x_{t+1}),
        positions [P] (t, below ``end`` if given) -> k, v [P, heads, head_dim]. Each row depends
        on its own inputs only (the query rows of ``qkv`` are not computed)."""
        c = self.cfg
        inner = c.num_heads * c.head_dim
        x = self._input(hidden, next_tokens)
        kv = F.linear(_rms(x, c.rms_norm_eps) * self.attn_norm, self.qkv.weight[inner:])
        k, v = kv.unflatten(-1, (2, c.num_heads, c.head_dim)).unbind(-3)
        cos, sin = self._rope(positions, x.dtype, end)
        return _rotate(k, cos, sin), v

    # ---- drafting: one step for a batch of draft nodes ---------------------------------------
    def step(self, feature: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
             past: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, rows: torch.Tensor | None = None,
             path: tuple[torch.Tensor, torch.Tensor] | None = None, end: int | None = None
             ) -> tuple[torch.Tensor, ...]:
        """One drafter position per row: feature [F, H], tokens [F] (the token after it), positions
        [F] (below ``end`` if given). ``past``: committed K/V (keys transposed, k_t [B, heads,
        head_dim, L]; v [B, heads, L, head_dim]) and what row b sees of it (bias [B, L]: 0 seen,
        -inf not); row f reads past row ``rows[f]`` (default f). ``path``: K/V of the draft
        positions before this one on the row's path (k, v [F, heads, d, head_dim]). Returns (next
        feature [F, H], logits [F, V] over the head's tokens (``token_ids``), k [F, heads,
        head_dim], v): the caller appends k, v to the path of the row's children."""
        x = self._input(feature, tokens)
        q, k, v = self._qkv(x, positions, end)                             # [F, heads, D]
        own_k, own_v = k.unsqueeze(2), v.unsqueeze(2)                      # [F, heads, 1, D]
        if path is not None:
            own_k, own_v = torch.cat([path[0], own_k], 2), torch.cat([path[1], own_v], 2)
        scores = (own_k @ q.unsqueeze(-1)).squeeze(-1)                     # [F, heads, d + 1]
        if past is not None:
            pk, pv, bias = past if rows is None else (past[0][rows], past[1][rows], past[2][rows])
            # keys stored transposed: q @ K^T is one [1, D] x [D, L] product per head (fast on CPU)
            s_past = (q.unsqueeze(-2) @ pk).squeeze(-2) + bias.unsqueeze(1)          # [F, heads, L]
            p = torch.softmax(torch.cat([s_past, scores], -1), -1)
            n = s_past.shape[-1]
            att = (p[..., None, :n] @ pv).squeeze(-2) + (p[..., None, n:] @ own_v).squeeze(-2)
        else:
            att = (torch.softmax(scores, -1).unsqueeze(-2) @ own_v).squeeze(-2)        # [F, heads, D]
        out, logits = self._output(x, att.flatten(-2))
        return out, logits, k, v

    # ---- training: every root of whole sequences at once -------------------------------------
    def unroll(self, hidden: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor,
               steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Teacher-forced sequences hidden [B, T, H] (the target's h_t), tokens [B, T], padded
        past ``lengths`` [B]. Returns per unroll step k < ``steps`` (next feature [B, T, H],
        logits [B, T, V]): step k at position t is depth k + 1 of the draft rooted at t - k,
        fed its own features from step k - 1 and the true tokens; it sees the committed
        positions <= t - k and the path's draft positions t - k + 1 .. t (the steps before).
        Rows with t < k or t + 1 >= length are padding (their values are unused)."""
        b, t = tokens.shape
        nxt = torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], 1)          # x_{t+1}
        pos = torch.arange(t, device=tokens.device).expand(b, t)
        s_idx = torch.arange(t, device=tokens.device)
        valid_key = s_idx[None, :] < lengths[:, None]                                  # [B, T]
        feature, ks, vs, outs = hidden, [], [], []
        for k in range(steps):
            x = self._input(feature, nxt)
            q, kk, vv = (a.transpose(1, 2) for a in self._qkv(x, pos, t))              # [B, heads, T, D]
            if k == 0:
                k0, v0 = kk, vv
            else:
                ks.append(kk)
                vs.append(vv)
            # committed keys s <= t - k, then the path's keys at t - k + j (j = 1 .. k)
            see = (s_idx[None, :] <= s_idx[:, None] - k)[None] & valid_key[:, None, :]   # [B, T, T]
            scores = [(q @ k0.transpose(-1, -2)).masked_fill(~see[:, None], NEG_INF)]
            for j in range(1, k + 1):
                diag = (q * _shift(ks[j - 1], k - j, 2)).sum(-1, keepdim=True)         # [B, heads, T, 1]
                scores.append(diag.masked_fill((s_idx < k - j).view(1, 1, t, 1), NEG_INF))
            p = torch.softmax(torch.cat(scores, -1), -1)
            att = p[..., :t] @ v0
            for j in range(1, k + 1):
                att = att + p[..., t + j - 1:t + j] * _shift(vs[j - 1], k - j, 2)
            out, logits = self._output(x, att.transpose(1, 2).flatten(-2))
            outs.append((out, logits))
            feature = _shift(out, 1, 1)                                                # position t reads out[t - 1]
        return outs

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
        cfg = read_config(cfg_path)
        want = DrafterConfig.from_target(model.args)
        if (cfg.hidden_size, cfg.vocab_size) != (want.hidden_size, want.vocab_size):
            raise ValueError(f"drafter: {path!r} was trained for hidden_size={cfg.hidden_size}, "
                             f"vocab_size={cfg.vocab_size}; the target has {want.hidden_size}, {want.vocab_size}")
        weights = load_file(w_path)
        drafter = cls(cfg, *target_weights(model), vocab=weights.get("vocab"))
        drafter.load_state_dict(weights)
        return drafter.eval()


def _checked_vocab(vocab: torch.Tensor | None, cfg: DrafterConfig) -> torch.Tensor | None:
    """``vocab`` as the draft vocabulary of ``cfg`` (long, ascending, distinct ids below
    ``vocab_size``, ``draft_vocab`` of them), or a ValueError naming what does not fit."""
    if cfg.draft_vocab < 0:
        raise ValueError(f"drafter: draft_vocab must be >= 0, got {cfg.draft_vocab}")
    if not cfg.draft_vocab:
        if vocab is not None:
            raise ValueError("drafter: a vocab was given for a drafter of the whole vocabulary (draft_vocab=0)")
        return None
    if vocab is None or vocab.dim() != 1 or len(vocab) != cfg.draft_vocab or vocab.dtype.is_floating_point:
        got = None if vocab is None else tuple(vocab.shape)
        raise ValueError(f"drafter: draft_vocab={cfg.draft_vocab} needs a vocab of that many token ids, got {got}")
    vocab = vocab.long()
    if int(vocab[0]) < 0 or int(vocab[-1]) >= cfg.vocab_size or not bool((vocab[1:] > vocab[:-1]).all()):
        raise ValueError(f"drafter: vocab must hold ascending distinct token ids below vocab_size={cfg.vocab_size}")
    return vocab


def _rows(head: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
    return head if vocab is None else head[vocab.to(head.device)]


def read_config(path: str) -> DrafterConfig:
    """``drafter.json``; a field missing (an older drafter without attention) or unknown fails
    naming it."""
    with open(path) as f:
        raw = json.load(f)
    names = [f.name for f in fields(DrafterConfig)]
    for name in names[:5]:
        if name not in raw:
            raise ValueError(f"drafter: {path!r} has no field {name!r} (a drafter of an older format, "
                             f"without attention over past positions: train a new one with tailrl train-drafter)")
    unknown = sorted(set(raw) - set(names))
    if unknown:
        raise ValueError(f"drafter: {path!r} has unknown field(s) {unknown}")
    return DrafterConfig(**raw)


def target_weights(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The target ``Transformer``'s embedding and LM-head weights (tied models share one)."""
    embed = model.embed.weight
    return embed, embed if model.lm_head is None else model.lm_head.weight
