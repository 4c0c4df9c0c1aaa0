"""How many tokens per verify step the drafter's chains would get on given responses, measured
at every position instead of on the few drafts a rollout happens to make.

Sampling is counter-based: the tokens a request emits do not depend on its drafts, and a
draft node is accepted iff it equals the token emitted at its position. So the drafter's
acceptance on responses already sampled is exact, given the target's hidden states at their
positions (a teacher-forced forward: ``drafter_train.teacher_forced``): the greedy chain
rooted at position r (h_r, the emitted x_{r+1}) drafts x_{r+2} .. x_{r+1+depth}, and its
accepted length is the number of its leading tokens equal to the response's. ``Drafter.unroll``
gives every root's chain at once (fed the true tokens: equal to the drafter's own chain for
as long as it matches, which is all that counts).

``chain_acceptance`` walks each response as the drafter alone would verify it: from the last
prompt position, a verify step at root r emits its accepted tokens and the bonus token, so
the next root is r + accepted + 1. It differs from a rollout's measured acceptance only in
what the engine bounds: the drafter's past there is the request's last 128 positions at
most, and its K/V are computed in the target's dtype.
"""
from __future__ import annotations

import os
import time

import torch
from safetensors.torch import load_file

from tailrl.drafter.network import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    Drafter,
    DrafterConfig,
    DrafterData,
    read_config,
)
from tailrl.drafter.train import teacher_forced


@torch.no_grad()
def accepted_per_root(drafter: Drafter, hidden: torch.Tensor, tokens: torch.Tensor, depth: int,
                      lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Sequences hidden [B, T, H] and tokens [B, T] padded past ``lengths`` [B] (default: none
    padded; or one sequence, [T, H] and [T]) -> accepted [B, T] (or [T]), long: the leading tokens of the
    greedy ``depth``-chain rooted at each position that equal the sequence's; only positions
    that exist count (a root r needs x_{r+2} to draft anything: 0 otherwise, and 0 past the
    sequence's end)."""
    if tokens.dim() == 1:
        return accepted_per_root(drafter, hidden[None], tokens[None], depth,
                                 torch.tensor([tokens.shape[0]], device=tokens.device))[0]
    b, t = tokens.shape
    dev = tokens.device
    lengths = torch.full((b,), t, device=dev) if lengths is None else lengths
    outs = drafter.unroll(hidden, tokens, lengths, depth)
    accepted = torch.zeros(b, t, dtype=torch.long, device=dev)
    alive = torch.ones(b, t, dtype=torch.bool, device=dev)
    roots = torch.arange(t, device=dev)
    for k, (_, logits) in enumerate(outs):
        at = (roots + k).clamp(max=t - 1)    # step k of root r is computed at position r + k
        target = roots + k + 2               # and predicts the token at r + k + 2
        ok = target[None] < lengths[:, None]                                     # [B, T]
        guess = drafter.token_ids(logits.argmax(-1)).gather(1, at.expand(b, t))  # [B, T]
        truth = tokens.gather(1, target.clamp(max=t - 1).expand(b, t))
        alive &= ok & (guess == truth)
        accepted += alive.long()
    return accepted


def chain_acceptance(drafter: Drafter, data: DrafterData, depth: int, chunk: int = 8) -> tuple[float, int]:
    """(mean tokens per verify step, bonus token included; verify steps) of ``depth``-chains
    over the responses of ``data``, each walked from its first root as the drafter alone would
    verify it (``chunk`` sequences of similar length unrolled at a time, on the drafter's
    device). (0.0, 0) when no response has a position to draft."""
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    tokens_total = steps = 0
    was_training = drafter.training
    drafter.eval()
    lengths = data.lengths.tolist()
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    for lo in range(0, len(order), chunk):
        rows = order[lo:lo + chunk]
        width = max(lengths[s] for s in rows)
        hidden = data.hidden.new_zeros(len(rows), width, data.hidden.shape[1])
        tokens = torch.zeros(len(rows), width, dtype=torch.long, device="cpu")
        for b, s in enumerate(rows):
            o = int(data.offsets[s])
            hidden[b, :lengths[s]] = data.hidden[o:o + lengths[s]]
            tokens[b, :lengths[s]] = data.tokens[o:o + lengths[s]]
        dev = drafter.fc.weight.device
        accepted = accepted_per_root(drafter, hidden.to(dev), tokens.to(dev), depth,
                                     torch.tensor([lengths[s] for s in rows], device=dev)).tolist()
        for b, s in enumerate(rows):
            r = int(data.first[s])
            while r + 2 < lengths[s]:
                a = accepted[b][r]
                tokens_total += a + 1
                steps += 1
                r += a + 1
    drafter.train(was_training)
    return (tokens_total / steps if steps else 0.0), steps


def on_policy(cfg: DrafterConfig, weights: dict[str, torch.Tensor], policy: torch.nn.Module,
              vocab: torch.Tensor | None = None) -> Drafter:
    """A drafter with trainable ``weights`` (``SpotTrainer.weights``) over a Hugging Face
    ``policy``'s embedding and LM head, as the engine's drafter shares its target's (its head
    over ``vocab``, the drafter's draft vocabulary, if it has one)."""
    embed = policy.get_input_embeddings().weight.detach().float()
    out = policy.get_output_embeddings()
    head = out.weight.detach().float() if out is not None else embed
    drafter = Drafter(cfg, embed.clone(), head.clone(), vocab=vocab)
    drafter.load_state_dict(weights if vocab is None else {**weights, "vocab": drafter.vocab})
    return drafter.eval()


def step_acceptance(drafter: Drafter, policy: torch.nn.Module, prompts: list[list[int]],
                    groups: list[list[list[int]]], depth: int) -> tuple[float, int]:
    """``chain_acceptance`` of ``drafter`` on one GRPO step's responses (``groups[i]``: the
    responses to ``prompts[i]``), over the hidden states of the ``policy`` that sampled them."""
    was_training = policy.training
    policy.eval()
    try:
        data = teacher_forced(policy, [(p, r) for p, g in zip(prompts, groups) for r in g])
    finally:
        policy.train(was_training)
    return chain_acceptance(drafter, data, depth)


class StepEvaluator:
    """Per GRPO step (config key ``drafter_eval``): the drafter the step's rollout started with
    (its trainable weights, taken before the rollout), measured exactly on the step's
    responses under the policy that sampled them, before the update. ``drafter_dir``: the
    run's drafter (for its sizes); ``depth``: the draft length."""

    def __init__(self, drafter_dir: str, depth: int) -> None:
        self.cfg = read_config(os.path.join(drafter_dir, CONFIG_FILE))
        # the draft vocabulary is fixed for a drafter's life (a buffer: never trained)
        weights = os.path.join(drafter_dir, WEIGHTS_FILE)
        self.vocab = load_file(weights).get("vocab") if self.cfg.draft_vocab else None
        self.depth = depth

    def measure(self, weights: dict[str, torch.Tensor], policy: torch.nn.Module, prompts: list[list[int]],
                groups: list[list[list[int]]]) -> dict[str, float]:
        """``drafter/eval_accept_length`` (tokens per verify step, bonus included),
        ``drafter/eval_verify_steps`` (how many it rests on), ``timing_s/drafter_eval``."""
        t0 = time.perf_counter()
        drafter = on_policy(self.cfg, weights, policy, self.vocab)
        accept, steps = step_acceptance(drafter, policy, prompts, groups, self.depth)
        return {"drafter/eval_accept_length": accept, "drafter/eval_verify_steps": float(steps),
                "timing_s/drafter_eval": time.perf_counter() - t0}
