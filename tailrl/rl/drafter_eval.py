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

import torch

from tailrl.model.drafter import Drafter, DrafterData


@torch.no_grad()
def accepted_per_root(drafter: Drafter, hidden: torch.Tensor, tokens: torch.Tensor, depth: int) -> torch.Tensor:
    """One sequence, hidden [T, H] and tokens [T] -> accepted [T] (long): the leading tokens of
    the greedy ``depth``-chain rooted at each position that equal the sequence's; only
    positions that exist count (a root r needs x_{r+2} to draft anything: 0 otherwise)."""
    t = tokens.shape[0]
    outs = drafter.unroll(hidden[None], tokens[None], torch.tensor([t]), depth)
    accepted = torch.zeros(t, dtype=torch.long)
    alive = torch.ones(t, dtype=torch.bool)
    roots = torch.arange(t)
    for k, (_, logits) in enumerate(outs):
        at = roots + k                       # step k of root r is computed at position r + k
        target = roots + k + 2               # and predicts the token at r + k + 2
        ok = target < t
        hit = torch.zeros(t, dtype=torch.bool)
        hit[ok] = logits[0, at[ok]].argmax(-1) == tokens[target[ok]]
        alive &= hit
        accepted += alive.long()
    return accepted


def chain_acceptance(drafter: Drafter, data: DrafterData, depth: int) -> tuple[float, int]:
    """(mean tokens per verify step, bonus token included; verify steps) of ``depth``-chains
    over the responses of ``data``, each walked from its first root as the drafter alone would
    verify it. (0.0, 0) when no response has a position to draft."""
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    tokens_total = steps = 0
    was_training = drafter.training
    drafter.eval()
    for s in range(len(data.first)):
        lo, hi = int(data.offsets[s]), int(data.offsets[s + 1])
        accepted = accepted_per_root(drafter, data.hidden[lo:hi], data.tokens[lo:hi], depth).tolist()
        r = int(data.first[s])
        while r + 2 < hi - lo:
            a = accepted[r]
            tokens_total += a + 1
            steps += 1
            r += a + 1
    drafter.train(was_training)
    return (tokens_total / steps if steps else 0.0), steps
