"""Training the learned drafter on the target's hidden states (offline warm start: the
``tailrl train-drafter`` command, tailrl/cli/train_drafter.py; online: spot_trainer.py).

1. Sample the model's own responses to training prompts with ``LLM`` (temperature 1: the
   drafter must predict what rollouts produce, not the dataset's reference answers).
2. One teacher-forced forward of the target (Hugging Face's module, float32) per sequence
   gives the normed hidden state h_t at every position, prompt included (the drafter attends
   over the prompt too).
3. Train the drafter on whole sequences (``Drafter.unroll``: causal attention, every root at
   once): from (h_t, x_{t+1}) and the past, predict h_{t+1} (smooth-L1 regression) and the
   target's next-token distribution softmax(head(h_{t+1})) (cross-entropy against those soft
   labels), as in EAGLE / TLT. The drafter is unrolled ``unroll`` steps on its own features
   (attending over its own draft positions, as when drafting), later steps weighted down, so
   that it also learns from the features it will really see deeper in a draft. Only roots at
   the last prompt position or later count (drafts start there). A training batch is
   ``batch`` positions: random sequences, each cropped at random to at most ``batch``
   positions (a crop's drafts see a partial past, as after a migration).

The online spot trainer (``tailrl.drafter.spot_trainer``: training on the rollout's own hidden
states while the tail idles) reuses ``sample_batch`` and ``drafter_loss``.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from tailrl.drafter.network import Drafter, DrafterData
from tailrl.kernels import host_to_device


@torch.no_grad()
def teacher_forced(model: str | torch.nn.Module, sequences: list[tuple[list[int], list[int]]],
                   chunk: int = 8) -> DrafterData:
    """``sequences``: (prompt ids, response ids) pairs -> every position's h_t and x_t; roots
    count from the last prompt position on. ``model``: a checkpoint directory (loaded in
    float32) or a Hugging Face causal LM already loaded (e.g. the policy being trained). The
    forward runs ``chunk`` sequences of similar length at a time, right-padded (a causal
    model's states before the padding do not see it), on the model's device, where the states
    stay; the tokens and offsets are host metadata."""
    if isinstance(model, str):
        import transformers
        hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    else:
        hf = model
    dev = next(hf.parameters()).device
    ids = [list(p) + list(r) for p, r in sequences]
    hidden: list[torch.Tensor | None] = [None] * len(ids)
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    for lo in tqdm(range(0, len(order), chunk), desc="teacher-forced forward", leave=False, disable=None):
        rows = order[lo:lo + chunk]
        width = max(len(ids[i]) for i in rows)
        batch = torch.zeros(len(rows), width, dtype=torch.long, device="cpu")
        mask = torch.zeros(len(rows), width, dtype=torch.long, device="cpu")
        for b, i in enumerate(rows):
            batch[b, :len(ids[i])] = torch.tensor(ids[i], device="cpu")
            mask[b, :len(ids[i])] = 1
        out = hf.model(batch.to(dev), attention_mask=mask.to(dev)).last_hidden_state.float()   # [B, T, H], normed
        for b, i in enumerate(rows):
            hidden[i] = out[b, :len(ids[i])]
    lengths = [len(x) for x in ids]
    return DrafterData(torch.cat(hidden), torch.tensor([t for x in ids for t in x], device="cpu"),
                       torch.tensor([0] + lengths, device="cpu").cumsum(0),
                       torch.tensor([len(p) - 1 for p, _ in sequences], device="cpu"))


@dataclass
class SequenceBatch:
    hidden: torch.Tensor        # [B, T, H] padded
    tokens: torch.Tensor        # [B, T]
    lengths: torch.Tensor       # [B]
    first: torch.Tensor         # [B] first root position that counts
    host: tuple[list[int], list[int]] | None = None    # lengths and first on the host (None: read back)

    def kept(self, k: int) -> torch.Tensor:
        """The flat [B * T] indices, in order, of unroll step ``k``'s positions that count (a root
        t - k that counts, a next position t + 1 that exists): built on the host from ``host``,
        so the loss reads no count back from the device."""
        lengths, first = self.host if self.host is not None else (self.lengths.tolist(), self.first.tolist())
        t = self.tokens.shape[1]
        idx = [b * t + i for b, (m, f) in enumerate(zip(lengths, first)) for i in range(f + k, m - 1)]
        return host_to_device(self.tokens.device, idx, torch.long)


def sample_batch(data: DrafterData, positions: int, gen: torch.Generator,
                 device: torch.device | None = None) -> SequenceBatch:
    """Random sequences (weighted by their trainable roots), each cropped to at most
    ``positions`` at a random offset, until the batch holds ``positions`` positions. Picked on
    the host (``gen``: a CPU generator, over the host metadata); the batch is laid out on
    ``device`` (default: where the states are)."""
    lengths, offsets = data.lengths, data.offsets
    weight = (lengths - 1 - data.first).clamp(min=0).float()
    picked, total = [], 0
    while total < positions:
        s = int(torch.multinomial(weight, 1, generator=gen))
        n = int(lengths[s])
        lo = max(0, int(data.first[s]) - positions + 2)           # the crop keeps a root that counts
        a = int(torch.randint(lo, n - positions + 1, (1,), generator=gen, device="cpu")) if n > positions else 0
        m = min(n - a, positions)
        picked.append((int(offsets[s]) + a, m, max(0, int(data.first[s]) - a)))
        total += m
    width = max(m for _, m, _ in picked)
    dev = torch.device(device if device is not None else data.hidden.device)
    hidden = data.hidden.new_zeros(len(picked), width, data.hidden.shape[1])
    tokens = torch.zeros(len(picked), width, dtype=torch.long, device="cpu")
    for b, (o, m, _) in enumerate(picked):
        hidden[b, :m] = data.hidden[o:o + m]
        tokens[b, :m] = data.tokens[o:o + m]
    meta = host_to_device(dev, [[m, f] for _, m, f in picked], torch.long)   # lengths, first: one copy
    return SequenceBatch(hidden.to(dev), host_to_device(dev, tokens), meta[:, 0], meta[:, 1],
                         ([m for _, m, _ in picked], [f for _, _, f in picked]))


def drafter_loss(drafter: Drafter, batch: SequenceBatch, unroll: int,
                 reg_weight: float = 1.0, decay: float = 0.7) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss over every root of ``batch`` that counts. Returns (loss, top-1 agreement of the
    first step with the target's most likely token: a cheap proxy of chain acceptance), both
    0-d tensors on the batch's device: nothing is read back (on a GPU the loss can be queued
    on a stream beside the rollout's without waiting for it)."""
    outs = drafter.unroll(batch.hidden, batch.tokens, batch.lengths, unroll)
    nxt = torch.cat([batch.hidden[:, 1:], torch.zeros_like(batch.hidden[:, :1])], 1)   # h_{t+1}
    flat = lambda x: x.flatten(0, 1)          # noqa: E731  [B, T, ...] -> [B * T, ...]
    total = batch.hidden.new_zeros(())
    agree = batch.hidden.new_zeros(())
    for k, (feat, logits) in enumerate(outs):
        # step k at t: the draft rooted at t - k (must count), predicting position t + 1 (must exist)
        keep = batch.kept(k)                                                 # [R], row-major
        if keep.numel() == 0:
            break
        target = flat(nxt).index_select(0, keep)                             # [R, H]
        target_p = torch.softmax(F.linear(target, drafter.head), -1)         # [R, V]
        kept_logits = flat(logits).index_select(0, keep)
        ce = -(target_p * torch.log_softmax(kept_logits, -1)).sum(-1).mean()
        reg = F.smooth_l1_loss(flat(feat).index_select(0, keep), target)
        total = total + decay ** k * (ce + reg_weight * reg)
        if k == 0:
            agree = (kept_logits.argmax(-1) == target_p.argmax(-1)).float().mean()
    return total, agree


def train(drafter: Drafter, data: DrafterData, steps: int, batch: int = 1024, lr: float = 1e-3,
          unroll: int = 3, seed: int = 0, max_seconds: float | None = None) -> dict[str, float]:
    """AdamW with cosine decay, ``batch`` positions per step. Returns the final figures (loss,
    first-step agreement, steps run). ``max_seconds``: a time budget as well, the decay
    following whichever of steps and seconds is further along, training ending with the
    first one spent (a warm start sized to a GPU session's minutes)."""
    gen = torch.Generator().manual_seed(seed)
    params = [p for p in drafter.parameters() if p.requires_grad]
    dev = params[0].device
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, max(1, steps)) if max_seconds is None else None
    drafter.train()
    loss_v = agree_v = 0.0
    start, done = time.perf_counter(), 0
    bar = tqdm(range(steps), desc="train drafter", leave=False)
    for step in bar:
        if sched is None:
            progress = max(step / steps, (time.perf_counter() - start) / max_seconds)
            if progress >= 1.0:
                break
            for g in opt.param_groups:
                g["lr"] = lr * 0.5 * (1.0 + math.cos(math.pi * progress))
        loss, agree = drafter_loss(drafter, sample_batch(data, batch, gen, dev), unroll)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if sched is not None:
            sched.step()
        loss_v = loss.item()                    # waits for the step: the clock above sees it whole
        agree_v = agree.item()
        done += 1
        bar.set_postfix(loss=f"{loss_v:.3f}", agree=f"{agree_v:.3f}")
    drafter.eval()
    return {"loss": loss_v, "agreement": agree_v, "steps": float(done)}
