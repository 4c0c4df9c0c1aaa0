"""Exact offline acceptance: replay a finished response against suffix drafts.

With counter-based sampling the token emitted at a position does not depend on drafts, so a
finished response *is* what any draft would have been verified against: replaying it gives
the acceptance speculation would have had, exactly, without running the model. Used to
measure acceptance against k sibling references, chain vs tree (the shape of Seer's Table 2).
"""
from __future__ import annotations

from tailrl.engine.verify import accept_draft
from tailrl.spec.source import MatchParams


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
            # the "target" after each node is the response's own next token at that depth
            depths = d.depths
            targets = [response[t]] + [response[t + dep] if t + dep < len(response) else -1 for dep in depths]
            out, _ = accept_draft(d.parents, d.tokens, targets)
            step = len(out) - (1 if out[-1] == -1 else 0)
            emitted.append(step)
        index.extend(own, response[t:t + step])
        t += step
    return emitted
