"""Exact offline acceptance: replay a finished response against suffix drafts.

With counter-based sampling the token emitted at a position does not depend on drafts, so a
finished response *is* what any draft would have been verified against: replaying it gives
the acceptance speculation would have had, exactly, without running the model. Used to
measure acceptance against k sibling references, chain vs tree (the shape of Seer's Table 2).
"""
from __future__ import annotations

from tailrl.speculative.sources.base import MatchParams


def replay(prompt: list[int], response: list[int], references: list[list[int]], max_tokens: int = 8,
           max_paths: int = 1, params: MatchParams | None = None) -> list[int]:
    """Tokens emitted per verify step (accepted drafts + the bonus token) while generating
    `response`, drafting from `references` and from the response's own prefix."""
    p = params or MatchParams()
    index = p.index()
    for ref in references:
        index.add(ref)
    own = index.add(prompt)
    emitted: list[int] = []
    t = 0
    while t < len(response):
        context = prompt[-p.max_match_len:] + response[max(t - p.max_match_len, 0):t]
        d = index.propose(context[-p.max_match_len:], min(max_tokens, p.max_draft_depth), max_paths,
                          min_token_prob=p.min_token_prob, tokens_per_match=p.tokens_per_match)
        step = 1
        if d is not None and len(d.tokens):
            # the target emits the response's own tokens: the accepted nodes plus the bonus
            # token, which does not exist once the response has ended
            step = min(d.accepted_by(response[t:t + d.max_depth + 1]) + 1, len(response) - t)
            emitted.append(step)
        index.extend(own, response[t:t + step])
        t += step
    return emitted
