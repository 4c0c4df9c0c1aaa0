"""Supervised training of a Qwen2 model on the worked task solutions.

Determinism: the example stream, the batching and the batch order are pure functions of the
preset; torch is seeded before the weights are built and runs with a fixed thread count.
Same preset + same torch build + same thread count = bit-identical weights (CPU kernels may
reduce in a different order with another thread count or another CPU, which changes the
last bits).

The learning rate warms up linearly, then decays as 1/sqrt(step): it never depends on the
total step count, so the checkpoint saved at step k is exactly the model a k-step run makes.
The loss is masked on the prompt: the model learns to write solutions, not prompts.
"""
from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Iterator

import torch
from tokenizers import Tokenizer
from tqdm import tqdm

from tailrl.tasks.base import Example
from tailrl.tasks.presets import ModelPreset

log = logging.getLogger(__name__)

IGNORE = -100
EXAMPLES_PER_CHUNK = 512   # examples sorted by length together, then cut into batches
WIDTH_MULTIPLE = 64        # batch widths are padded to a multiple of this: a few distinct
                           # shapes keep the CPU kernel caches (and memory) bounded


def encode_example(tok: Tokenizer, ex: Example, eos_id: int) -> tuple[list[int], list[int]]:
    """(input ids, labels): <bos> prompt solution <eos>, labels masked on <bos> + prompt."""
    prompt = tok.encode(ex.prompt).ids                       # starts with <bos>
    solution = tok.encode(ex.solution, add_special_tokens=False).ids + [eos_id]
    return prompt + solution, [IGNORE] * len(prompt) + solution


def padded_width(length: int, preset: ModelPreset) -> int:
    return min(-(-length // WIDTH_MULTIPLE) * WIDTH_MULTIPLE, preset.max_position_embeddings)


def batches(tok: Tokenizer, stream: Iterator[Example], preset: ModelPreset, eos_id: int,
            pad_id: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Length-bucketed, right-padded batches under ``preset.batch_tokens`` tokens each."""
    rng = random.Random(f"batches/{preset.seed}")
    while True:
        chunk = []
        while len(chunk) < EXAMPLES_PER_CHUNK:
            ids, labels = encode_example(tok, next(stream), eos_id)
            if len(ids) <= preset.max_position_embeddings:
                chunk.append((ids, labels))
        chunk.sort(key=lambda p: len(p[0]))
        groups, cur = [], []
        for item in chunk:
            if cur and padded_width(len(item[0]), preset) * (len(cur) + 1) > preset.batch_tokens:
                groups.append(cur)
                cur = []
            cur.append(item)
        groups.append(cur)
        rng.shuffle(groups)
        for group in groups:
            width = padded_width(max(len(ids) for ids, _ in group), preset)
            x = torch.full((len(group), width), pad_id, dtype=torch.long)
            y = torch.full((len(group), width), IGNORE, dtype=torch.long)
            for r, (ids, labels) in enumerate(group):
                x[r, : len(ids)] = torch.tensor(ids)
                y[r, : len(labels)] = torch.tensor(labels)
            yield x, y


def lr_at(step: int, preset: ModelPreset) -> float:
    """Linear warmup, then inverse square root decay (independent of the total steps)."""
    warm = max(1, preset.warmup_steps)
    if step < warm:
        return preset.lr * (step + 1) / warm
    return preset.lr * math.sqrt(warm / (step + 1))


@torch.no_grad()
def validation_loss(model: torch.nn.Module, val: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    model.eval()
    total, count = 0.0, 0
    for x, y in val:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=x).logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)), y[:, 1:].reshape(-1),
            ignore_index=IGNORE, reduction="sum")
        total += loss.item()
        count += int((y[:, 1:] != IGNORE).sum())
    model.train()
    return total / max(1, count)


def train(model: torch.nn.Module, data: Iterator[tuple[torch.Tensor, torch.Tensor]],
          preset: ModelPreset, val: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
          on_checkpoint: Callable[[int], None] | None = None) -> dict[str, float | None]:
    """Run ``preset.steps`` AdamW steps with bf16 autocast; returns the final figures."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": preset.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=preset.lr, betas=(0.9, 0.95), eps=1e-8)
    model.train()
    start, tokens, ema, val_loss = time.time(), 0, None, float("nan")
    bar = tqdm(range(preset.steps), desc=f"train {preset.name}", unit="step", mininterval=2.0)
    for step in bar:
        x, y = next(data)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, preset)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=y).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += x.numel()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        done = step + 1
        if val and preset.eval_every and done % preset.eval_every == 0:
            val_loss = validation_loss(model, val)
            log.info("step %d: train loss %.4f, val loss %.4f, %.0f tok/s", done, ema, val_loss,
                     tokens / (time.time() - start))
        if on_checkpoint and preset.checkpoint_every and done % preset.checkpoint_every == 0:
            on_checkpoint(done)
        bar.set_postfix(loss=f"{ema:.4f}", val=f"{val_loss:.4f}", lr=f"{lr_at(step, preset):.1e}")
    if val:
        val_loss = validation_loss(model, val)
    seconds = time.time() - start
    return {"train_loss": float(ema or 0.0), "val_loss": val_loss if val else None, "train_seconds": seconds,
            "train_tokens": float(tokens), "tokens_per_s": tokens / max(seconds, 1e-9)}
