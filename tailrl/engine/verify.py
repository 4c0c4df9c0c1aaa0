"""Accept/reject for speculative drafts (chains and trees): a pure function over token lists.

Math. Let y_t = S(p(. | x_<t), u_t) be the token plain decoding emits at position t, where S
is the sampler (sampler.py) and u_t the counter-based uniform of (request, t). The verification
forward gives p(. | prefix, path to node) for the root and every draft node, so we can compute
the target token after each node with the same S and u. Walking from the root, a child is
accepted iff its token equals the target token at its parent; the first mismatch emits the
target token (the "bonus"). Every emitted token is therefore exactly the token plain decoding
emits at that position: the output is identical path by path, hence the distribution is the
target's at any temperature / top-k / top-p. For a deterministic draft token x this accepts
with probability p(x), the same as standard rejection sampling with a point-mass proposal.
"""
from __future__ import annotations


def accept_draft(parents: list[int], draft_tokens: list[int], targets: list[int]) -> tuple[list[int], list[int]]:
    """parents[j]: parent node of draft node j (-1 = the root, i.e. the last committed token).
    targets[0]: target token after the root; targets[1 + j]: target token after node j.
    Returns (emitted tokens, accepted node indices); len(emitted) == len(accepted) + 1."""
    children: dict[int, dict[int, int]] = {}
    for j, (par, tok) in enumerate(zip(parents, draft_tokens)):
        children.setdefault(par, {}).setdefault(tok, j)   # duplicate siblings: the first one wins
    emitted: list[int] = []
    accepted: list[int] = []
    node = -1
    while True:
        tok = targets[node + 1]
        emitted.append(tok)
        nxt = children.get(node, {}).get(tok)
        if nxt is None:
            return emitted, accepted
        accepted.append(nxt)
        node = nxt
