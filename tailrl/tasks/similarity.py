"""Group similarity: how much of a response its siblings' responses would have predicted.

For each response token, find the longest suffix (``min_match``..``max_match`` tokens) of the
text before it (prompt + response so far) that also occurs in a sibling's prompt + response,
followed there by a response token; the prediction is the most frequent token following
those occurrences. The figure is the share of all response tokens predicted right: what a
group suffix-tree drafter that has seen the siblings' complete responses proposes, one token
at a time (the quantity Seer's grouped speculation exploits; live siblings see less).
"""
from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence


def _index(seqs: list[list[int]], starts: list[int], min_match: int, max_match: int):
    """context tuple -> list of (sequence index, next token), for next tokens in responses."""
    index: dict[tuple[int, ...], list[tuple[int, int]]] = defaultdict(list)
    for s, (seq, start) in enumerate(zip(seqs, starts)):
        for p in range(max(start, min_match), len(seq)):
            for k in range(min_match, min(max_match, p) + 1):
                index[tuple(seq[p - k: p])].append((s, seq[p]))
    return index


def group_similarity(prompts: Sequence[Sequence[int]], groups: Sequence[Sequence[Sequence[int]]],
                     min_match: int = 2, max_match: int = 16) -> dict[str, float]:
    """Figures over all groups: ``predicted`` (share of response tokens predicted right),
    ``matched`` (share with any sibling match), ``precision`` (right / matched).

    ``prompts[g]`` is the prompt of group ``g`` and ``groups[g]`` its responses (token ids).
    """
    if len(prompts) != len(groups):
        raise ValueError(f"prompts and groups must have the same length, got {len(prompts)} and {len(groups)}")
    if not 1 <= min_match <= max_match:
        raise ValueError(f"min_match must be in [1, max_match], got {min_match}")
    total = matched = right = 0
    for prompt, responses in zip(prompts, groups):
        seqs = [list(prompt) + list(r) for r in responses]
        starts = [len(prompt)] * len(seqs)
        index = _index(seqs, starts, min_match, max_match)
        for i, seq in enumerate(seqs):
            for p in range(len(prompt), len(seq)):
                total += 1
                for k in range(min(max_match, p), min_match - 1, -1):
                    hits = [tok for src, tok in index.get(tuple(seq[p - k: p]), ()) if src != i]
                    if hits:
                        counts = Counter(hits)
                        best = max(counts.items(), key=lambda kv: (kv[1], -kv[0]))[0]
                        matched += 1
                        right += best == seq[p]
                        break
    return {"predicted": right / total if total else 0.0,
            "matched": matched / total if total else 0.0,
            "precision": right / matched if matched else 0.0,
            "tokens": float(total)}
