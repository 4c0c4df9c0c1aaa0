"""A depth-limited suffix trie with occurrence counts, built online, that proposes drafts.

Every substring of length <= ``max_depth`` of the stored sequences is a path from the root;
a node's ``count`` is the number of occurrences of its string (start positions), so
``count(child) / sum(counts of children)`` estimates P(next token | context).

Why this structure (measured, see ``benchmarks/draft_cost.py``):

- A plain depth-limited trie updates ``max_depth`` nodes and creates up to ``max_depth`` new
  ones per appended token: ~10 us/token and ~150 bytes x 32 nodes per token of memory on
  text that does not repeat. Most of those nodes lie on paths that occur once.
- So paths that occur once stay *implicit*: a node with ``count == 1`` keeps no children,
  only a reference ``(seq, pos)`` to the one place its string continues. The sequence's
  own token list *is* the rest of the path (and it grows live with the sequence). The node
  is materialised one level at a time when a second occurrence walks into it. Per appended
  token we only step the suffixes that currently sit on shared (count >= 2) paths, at most
  ``max_depth`` of them, usually a few. Memory is O(shared nodes + tokens), bounded by
  ``max_depth`` nodes per token in the worst case.
- An n-gram index with occurrence lists would be cheaper to update but must scan every
  occurrence of the matched suffix to count continuations, which on small vocabularies
  (character-level tasks) means hundreds of occurrences per draft. A suffix automaton keeps
  no per-continuation counts online.

Matching (RhymeRL-like): the longest suffix of the context, at most ``max_match_len``
tokens, that occurs in the trie *with a continuation*; shorter than ``min_match_len`` = no
proposal (a 1-token match drafts noise). Longer matches imply shorter ones, so the length
is found by binary search (about log2(max_match_len) walks from the root).

Drafting: best-first by path probability from the matched node, children ordered by count,
at most ``max_paths`` leaves and ``max_tokens`` nodes (optionally at most
``tokens_per_match`` nodes per matched token, as ArcticInference's suffix decoding does),
stopping where the path probability falls below ``min_token_prob``.

Exclusion: ``propose(..., exclude=other)`` subtracts another trie's counts node by node.
The group source uses it to draft from the siblings only: ``other`` holds exactly the
request's own tokens (a sub-multiset of the group trie's occurrences, same depth limit).
"""
from __future__ import annotations

import heapq
import math
from typing import Iterable, Sequence

from tailrl.spec.draft import Draft


class _Node:
    __slots__ = ("count", "children", "seq", "pos")

    def __init__(self, count: int, seq: "_Seq | None" = None, pos: int = 0) -> None:
        self.count = count              # occurrences of this node's string
        self.children: dict[int, _Node] | None = None  # None = implicit (count == 1) path
        self.seq = seq                  # implicit: the sequence that continues the string
        self.pos = pos                  # implicit: index in seq.tokens of the next token


class _Seq:
    __slots__ = ("tokens", "active", "closed")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        # (explicit node, depth) of every suffix ending at the last token that sits on a
        # shared path; suffixes on implicit paths need no work when the sequence grows.
        self.active: list[tuple[_Node, int]] = []
        self.closed = False


# A position in the trie: (node, offset along its implicit path, depth from the root).
_Cursor = tuple[_Node, int, int]


class SuffixTrie:
    """Online suffix trie over several token sequences (see the module docstring)."""

    def __init__(self, max_depth: int = 32) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self._root = _Node(0)
        self._root.children = {}
        self._seqs: dict[int, _Seq] = {}
        self._next_id = 0
        self.num_nodes = 1
        self.num_tokens = 0

    def __len__(self) -> int:
        return len(self._seqs)

    # ---- building -------------------------------------------------------------------
    def add(self, tokens: Iterable[int] = ()) -> int:
        """Start a new sequence (optionally with tokens); returns its id for ``extend``."""
        sid = self._next_id
        self._next_id += 1
        self._seqs[sid] = _Seq()
        self.extend(sid, tokens)
        return sid

    def extend(self, seq_id: int, tokens: Iterable[int]) -> None:
        seq = self._seqs[seq_id]
        if seq.closed:
            raise ValueError(f"sequence {seq_id} is closed")
        for t in tokens:
            self._append(seq, int(t))

    def close(self, seq_id: int) -> None:
        """No more tokens for this sequence; its tokens stay in the trie."""
        seq = self._seqs[seq_id]
        seq.closed = True
        seq.active = []

    def tokens(self, seq_id: int) -> list[int]:
        return self._seqs[seq_id].tokens

    def _append(self, seq: _Seq, t: int) -> None:
        seq.tokens.append(t)
        end = len(seq.tokens)
        limit = self.max_depth
        new_active: list[tuple[_Node, int]] = []
        seq.active.append((self._root, 0))
        for node, depth in seq.active:
            children = node.children
            child = children.get(t)
            if child is None:
                children[t] = _Node(1, seq, end)   # a new path, implicit from here on
                self.num_nodes += 1
                continue
            if child.children is None:
                self._materialize(child, depth + 1, seq, new_active)
            child.count += 1
            if depth + 1 < limit:
                new_active.append((child, depth + 1))
        seq.active = new_active
        self.num_tokens += 1

    def _materialize(self, node: _Node, depth: int, current: _Seq,
                     current_active: list[tuple[_Node, int]]) -> None:
        """Make an implicit node explicit: give its one occurrence a real child."""
        node.children = {}
        seq, pos = node.seq, node.pos
        node.seq = None
        if depth >= self.max_depth:
            return
        if pos < len(seq.tokens):
            node.children[seq.tokens[pos]] = _Node(1, seq, pos + 1)
            self.num_nodes += 1
        elif not seq.closed:
            # The occurrence ends at the live end of ``seq``: it must step when seq grows.
            (current_active if seq is current else seq.active).append((node, depth))

    # ---- reading ------------------------------------------------------------------
    def _walk(self, tokens: Sequence[int]) -> _Cursor | None:
        node, k, depth = self._root, 0, 0
        limit = self.max_depth
        for t in tokens:
            if depth >= limit:
                return None
            if node.children is not None:
                node = node.children.get(t)
                if node is None:
                    return None
            else:
                j = node.pos + k
                toks = node.seq.tokens
                if j >= len(toks) or toks[j] != t:
                    return None
                k += 1
            depth += 1
        return node, k, depth

    def _children(self, cur: _Cursor) -> list[tuple[int, int, _Cursor]]:
        """(token, count, cursor) of every continuation of the cursor's string."""
        node, k, depth = cur
        if depth >= self.max_depth:
            return []
        if node.children is not None:
            return [(t, c.count, (c, 0, depth + 1)) for t, c in node.children.items()]
        j = node.pos + k
        toks = node.seq.tokens
        return [(toks[j], 1, (node, k + 1, depth + 1))] if j < len(toks) else []

    def _step(self, cur: _Cursor | None, t: int) -> _Cursor | None:
        if cur is None:
            return None
        for tok, _, nxt in self._children(cur):
            if tok == t:
                return nxt
        return None

    def count(self, tokens: Sequence[int]) -> int:
        """Occurrences of ``tokens`` (exact for ``len(tokens) <= max_depth``)."""
        if len(tokens) == 0:
            return self.num_tokens
        cur = self._walk(tokens)
        return 0 if cur is None else cur[0].count

    def continuations(self, tokens: Sequence[int], exclude: "SuffixTrie | None" = None) -> dict[int, int]:
        """Next-token counts after the occurrences of ``tokens`` (minus ``exclude``'s)."""
        cur = self._walk(tokens)
        if cur is None:
            return {}
        own = exclude._walk(tokens) if exclude is not None else None
        return self._net_children(cur, exclude, own)[1]

    def _net_children(self, cur: _Cursor, exclude: "SuffixTrie | None", own: _Cursor | None):
        kids = self._children(cur)
        if own is None:
            return kids, {t: c for t, c, _ in kids}
        return kids, exclude._net_counts(kids, own)

    def _net_counts(self, kids: list[tuple[int, int, _Cursor]], own: _Cursor) -> dict[int, int]:
        """Counts of ``kids`` (another trie's children) minus this trie's counts at ``own``."""
        counts = {t: c for t, c, _ in kids}
        for t, c, _ in self._children(own):
            left = counts.get(t, 0) - c
            if left > 0:
                counts[t] = left
            else:
                counts.pop(t, None)
        return counts

    def match(self, context: Sequence[int], min_len: int, max_len: int,
              exclude: "SuffixTrie | None" = None) -> int:
        """Length of the longest suffix of ``context`` (<= max_len) with a continuation; 0 if < min_len."""
        hi = min(max_len, len(context), self.max_depth - 1)
        if hi < min_len or not self._continues(context[len(context) - min_len:], exclude):
            return 0
        if self._continues(context[len(context) - hi:], exclude):
            return hi                                   # the common case when text repeats
        lo, hi = min_len, hi - 1                        # invariant: lo continues, hi+1 does not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._continues(context[len(context) - mid:], exclude):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _continues(self, tokens: Sequence[int], exclude: "SuffixTrie | None") -> bool:
        cur = self._walk(tokens)
        if cur is None:
            return False
        own = exclude._walk(tokens) if exclude is not None else None
        return bool(self._net_children(cur, exclude, own)[1])

    def propose(self, context: Sequence[int], max_tokens: int, max_paths: int = 1, *,
                min_match_len: int = 2, max_match_len: int = 16, min_token_prob: float = 0.1,
                tokens_per_match: float = 0.0, source: str = "suffix",
                exclude: "SuffixTrie | None" = None) -> Draft | None:
        """Draft continuing ``context``; None when no suffix of >= min_match_len continues.

        ``tokens_per_match > 0`` caps the draft at ``ceil(tokens_per_match * m)`` nodes for
        a match of ``m`` tokens (short matches are weak evidence).
        """
        if max_tokens <= 0:
            return None
        m = self.match(context, min_match_len, max_match_len, exclude)
        if m == 0:
            return None
        if tokens_per_match > 0:
            max_tokens = min(max_tokens, math.ceil(tokens_per_match * m))
        suffix = context[len(context) - m:]
        start = self._walk(suffix)
        start_own = exclude._walk(suffix) if exclude is not None else None
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        kept_children = [0]          # per kept node, plus slot 0 for the root (index -1)
        leaves = 0
        tie = 0
        heap: list = []

        def push(cur: _Cursor, own: _Cursor | None, parent: int, path: float) -> None:
            nonlocal tie
            kids = self._children(cur)
            if own is not None:
                net = exclude._net_counts(kids, own)
                kids = [k for k in kids if k[0] in net]
                kids = [(t, net[t], nxt) for t, _, nxt in kids]
            if not kids:
                return
            if len(kids) == 1:                       # the common case deep in a draft
                t, c, nxt = kids[0]
                if path >= min_token_prob:
                    tie += 1
                    nxt_own = exclude._step(own, t) if own is not None else None
                    heapq.heappush(heap, (-path, tie, t, 1.0, nxt, nxt_own, parent))
                return
            total = sum(k[1] for k in kids)
            kids.sort(key=lambda k: (-k[1], k[0]))
            for t, c, nxt in kids[:max_paths]:
                p = c / total
                if path * p < min_token_prob:
                    break
                tie += 1
                nxt_own = exclude._step(own, t) if own is not None else None
                heapq.heappush(heap, (-path * p, tie, t, p, nxt, nxt_own, parent))

        push(start, start_own, -1, 1.0)
        while heap and len(tokens) < max_tokens:
            neg_path, _, t, p, cur, own, parent = heapq.heappop(heap)
            if kept_children[parent + 1] > 0:          # a new branch
                if leaves >= max_paths:
                    continue
                leaves += 1
            elif parent < 0:
                leaves = 1
            kept_children[parent + 1] += 1
            tokens.append(t)
            parents.append(parent)
            probs.append(p)
            kept_children.append(0)
            node, k, depth = cur
            if node.children is None and own is None and not heap:
                # One occurrence left and no rival branch: the rest of the draft is a slice
                # of that occurrence's sequence, every step with probability 1.
                toks, j = node.seq.tokens, node.pos + k
                more = min(max_tokens - len(tokens), len(toks) - j, self.max_depth - depth)
                for i in range(more):
                    tokens.append(toks[j + i])
                    parents.append(len(tokens) - 2)
                    probs.append(1.0)
                break
            push(cur, own, len(tokens) - 1, -neg_path)
        if not tokens:
            return None
        return Draft(tokens, parents, probs, source, match_len=m)
