"""Occurrence index over growing token sequences that proposes drafts (the suffix sources' core).

Contract (what a draft means): the longest suffix of the context, at most ``max_match_len``
tokens, that occurs in the indexed sequences *with a continuation* is the match (among the
``max_occurrences`` most recent occurrences of each key: counts are estimates anyway) (shorter than
``min_match_len``: no proposal, a 1-token match drafts noise). Its occurrences vote for the
next token: ``P(t | match) = occurrences continued by t / occurrences continued at all``.
The draft grows best-first by path probability, at most ``max_paths`` leaves and
``max_tokens`` nodes, stopping where the path probability falls below ``min_token_prob``;
``tokens_per_match > 0`` caps a match of ``m`` tokens at ``ceil(tokens_per_match * m)``
nodes. ``exclude=seq_id`` ignores one sequence's occurrences (a request's own tokens in its
group's index). This is the semantics of a suffix tree with counts (ArcticInference, Seer),
computed from an occurrence table instead of a tree.

Why a table (measured in ``benchmarks/draft_cost.py``; the Python suffix trie this replaces
cost ~1 ms per draft on the workload, which ate the gain of speculation):

- Appending a token is a few dict inserts: for each key length ``k`` in ``keys`` (by
  default ``min_match_len`` times powers of 4 up to ``max_match_len``: 2, 8, 16) the ``k`` tokens
  ending at it map to the list of positions that follow them.
- Matching looks up the context's ``k``-token tail from the longest key down. Occurrences
  found under key ``k`` but not under the next longer key ``k2`` match fewer than ``k2``
  tokens, so extending each one backwards costs at most ``k2 - k`` comparisons: the exact
  match length of every occurrence, with no scan of the sequences.
- The draft walks the matched occurrences forward in their own sequences (the sequences
  *are* the tree's paths), splitting them by next token at each node.

Two implementations of this contract: ``PySuffixIndex`` (the reference, pure Python) and
``NativeSuffixIndex`` (the C++ extension ``_suffix_index.cpp``, built by ``pip install``;
same results, tested equal on random sequences). ``SuffixIndex`` is the native one when the
extension is built, else the reference (``NATIVE`` says which; ``TAILRL_PURE_PYTHON=1``
forces the reference). Measured with ``benchmarks/draft_cost.py``: indexing a history
response 5.0 -> 1.0 us per token, a history draft 11.9 -> 8.1 us, and 3.6 us once the Python
around the call was trimmed (native drafts skip ``Draft`` validation); the speculator's whole
drafting per request and step 46 -> 16 us; in the 64x8 rollout, drafting 2.0-2.8 s -> 0.8-1.4 s.
``propose_many`` drafts many (index, context) pairs in one native call: a step's rows, per source.
"""
from __future__ import annotations

import heapq
import importlib
import logging
import math
import os
from collections import Counter
from typing import Iterable, Sequence

from tailrl.speculative.draft import Draft


def key_lengths(min_match_len: int, max_match_len: int) -> tuple[int, ...]:
    """``min_match_len`` times 4, 16, ... up to ``max_match_len`` (which is always included):
    every key costs an insert per token; a match found under key ``k`` extends backwards at
    most up to the next key."""
    if not 1 <= min_match_len <= max_match_len:
        raise ValueError(f"min_match_len must be in [1, max_match_len], got {min_match_len}")
    keys = [min_match_len]
    while keys[-1] * 4 < max_match_len:
        keys.append(keys[-1] * 4)
    if keys[-1] != max_match_len:
        keys.append(max_match_len)
    return tuple(keys)


class PySuffixIndex:
    """The reference implementation (pure Python)."""

    def __init__(self, min_match_len: int = 2, max_match_len: int = 16, max_occurrences: int = 32) -> None:
        self.keys = key_lengths(min_match_len, max_match_len)
        # a key's most recent occurrences only: repetitive text (a sort's passes, a search's
        # retries) repeats a 16-token pattern hundreds of times, and scanning every occurrence
        # for every request at every step cost as much as the forward itself (measured)
        self.max_occurrences = max_occurrences
        self.min_match_len, self.max_match_len = min_match_len, max_match_len
        self._tables: list[dict[tuple, list[tuple[int, int]]]] = [{} for _ in self.keys]
        self._seqs: list[list[int]] = []
        self.num_tokens = 0

    def __len__(self) -> int:
        return len(self._seqs)

    # ---- building -------------------------------------------------------------------
    def add(self, tokens: Iterable[int] = ()) -> int:
        """A new sequence (optionally with tokens); returns its id."""
        sid = len(self._seqs)
        self._seqs.append([])
        self.extend(sid, tokens)
        return sid

    def extend(self, seq_id: int, tokens: Iterable[int]) -> None:
        seq = self._seqs[seq_id]
        old = len(seq)
        seq.extend(int(t) for t in tokens)
        new = len(seq)
        for k, table in zip(self.keys, self._tables):
            for n in range(max(old + 1, k), new + 1):     # the k tokens ending at position n - 1
                key = tuple(seq[n - k:n])
                occ = table.get(key)
                if occ is None:
                    table[key] = [(seq_id, n)]
                else:
                    occ.append((seq_id, n))
        self.num_tokens += new - old

    def tokens(self, seq_id: int) -> list[int]:
        return self._seqs[seq_id]

    # ---- matching -------------------------------------------------------------------
    def match(self, context: Sequence[int], exclude: int | None = None) -> tuple[int, list[tuple[int, int]]]:
        """(m, occurrences): the longest continued suffix length and the positions that follow
        its occurrences; (0, []) when no suffix of >= min_match_len tokens continues."""
        n = len(context)
        hi = min(self.max_match_len, n)
        seqs = self._seqs
        cap = hi
        for i in range(len(self.keys) - 1, -1, -1):
            k = self.keys[i]
            if k > hi:
                continue
            occ = self._tables[i].get(tuple(context[n - k:]))
            if occ:
                best, cands = 0, []
                for s, p in occ[-self.max_occurrences:]:
                    seq = seqs[s]
                    if s == exclude or p >= len(seq):
                        continue
                    m = k
                    while m < cap and m < p and seq[p - 1 - m] == context[n - 1 - m]:
                        m += 1
                    if m > best:
                        best, cands = m, [(s, p)]
                    elif m == best:
                        cands.append((s, p))
                if cands:
                    return best, cands
            cap = k - 1                                 # longer matches were under key k
        return 0, []

    def continuations(self, context: Sequence[int], exclude: int | None = None) -> dict[int, int]:
        """Next-token counts over the occurrences of the longest continued suffix."""
        return self._split(self.match(context, exclude)[1])[0]

    def _split(self, occ: list[tuple[int, int]]):
        """Group occurrences by their next token: ({token: count}, {token: advanced occurrences})."""
        seqs = self._seqs
        groups: dict[int, list[tuple[int, int]]] = {}
        for s, p in occ:
            seq = seqs[s]
            if p < len(seq):
                g = groups.get(seq[p])
                if g is None:
                    groups[seq[p]] = [(s, p + 1)]
                else:
                    g.append((s, p + 1))
        return {t: len(g) for t, g in groups.items()}, groups

    # ---- drafting -------------------------------------------------------------------
    def propose(self, context: Sequence[int], max_tokens: int, max_paths: int = 1, *,
                min_token_prob: float = 0.1, tokens_per_match: float = 0.0, source: str = "suffix",
                exclude: int | None = None) -> Draft | None:
        """Draft continuing ``context`` (see the module docstring); None when nothing matches."""
        if max_tokens <= 0:
            return None
        m, occ = self.match(context, exclude)
        if m == 0:
            return None
        if tokens_per_match > 0:
            max_tokens = min(max_tokens, math.ceil(tokens_per_match * m))
        if max_paths == 1:
            return self._chain(occ, max_tokens, min_token_prob, source, m)
        return self._tree(occ, max_tokens, max_paths, min_token_prob, source, m)

    def _tree(self, occ: list[tuple[int, int]], max_tokens: int, max_paths: int, min_token_prob: float,
              source: str, m: int) -> Draft | None:
        """``propose`` with several paths: best-first by path probability."""
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        kept_children = [0]          # per kept node, plus slot 0 for the root (index -1)
        leaves = 0
        tie = 0
        heap: list = []

        def push(occ: list[tuple[int, int]], parent: int, path: float) -> None:
            nonlocal tie
            counts, groups = self._split(occ)
            if not counts:
                return
            total = len(occ) if len(counts) == 1 else sum(counts.values())
            kids = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
            for t, c in kids[:max_paths]:
                p = c / total if len(kids) > 1 else 1.0
                if path * p < min_token_prob:
                    break
                tie += 1
                heapq.heappush(heap, (-path * p, tie, t, p, groups[t], parent))

        push(occ, -1, 1.0)
        seqs = self._seqs
        while heap and len(tokens) < max_tokens:
            neg_path, _, t, p, occ, parent = heapq.heappop(heap)
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
            if len(occ) == 1 and not heap:
                # One occurrence left and no rival branch: the rest of the draft is a slice of
                # its sequence, every step with probability 1.
                s, q = occ[0]
                rest = seqs[s][q:q + max_tokens - len(tokens)]
                for tok in rest:
                    tokens.append(tok)
                    parents.append(len(tokens) - 2)
                    probs.append(1.0)
                break
            push(occ, len(tokens) - 1, -neg_path)
        if not tokens:
            return None
        return Draft(tokens, parents, probs, source, match_len=m)

    def _chain(self, occ: list[tuple[int, int]], max_tokens: int, min_token_prob: float, source: str,
               m: int) -> Draft | None:
        """``propose`` with one path: the same nodes as the best-first search, found greedily
        over the distinct continuations (slices of the sequences: usually a handful)."""
        seqs = self._seqs
        items = list(Counter(tuple(seqs[s][q:q + max_tokens]) for s, q in occ).items())
        tokens: list[int] = []
        probs: list[float] = []
        path = 1.0
        for j in range(max_tokens):
            if len(items) == 1:                         # one continuation left: the rest of it
                rest = items[0][0][j:]
                if path >= min_token_prob:
                    tokens += rest
                    probs += [1.0] * len(rest)
                break
            counts: dict[int, int] = {}
            for c, w in items:
                if len(c) > j:
                    counts[c[j]] = counts.get(c[j], 0) + w
            if not counts:
                break
            best = min(counts.items(), key=lambda kv: (-kv[1], kv[0]))[0]
            p = counts[best] / sum(counts.values()) if len(counts) > 1 else 1.0
            if path * p < min_token_prob:
                break
            path *= p
            tokens.append(best)
            probs.append(p)
            items = [(c, w) for c, w in items if len(c) > j and c[j] == best]
        if not tokens:
            return None
        return Draft(tokens, list(range(-1, len(tokens) - 1)), probs, source, match_len=m)


class NativeSuffixIndex:
    """The same index in C++ (``_suffix_index.cpp``): equal results, a fraction of the cost."""

    def __init__(self, min_match_len: int = 2, max_match_len: int = 16, max_occurrences: int = 32) -> None:
        self.keys = key_lengths(min_match_len, max_match_len)
        self.max_occurrences = max_occurrences
        self.min_match_len, self.max_match_len = min_match_len, max_match_len
        self._core = _native.Index(list(self.keys), min_match_len, max_match_len, min(max_occurrences, 2**62))

    def __len__(self) -> int:
        return self._core.size()

    @property
    def num_tokens(self) -> int:
        return self._core.num_tokens()

    def add(self, tokens: Iterable[int] = ()) -> int:
        return self._core.add(list(tokens))

    def extend(self, seq_id: int, tokens: Iterable[int]) -> None:
        self._core.extend(seq_id, list(tokens))

    def tokens(self, seq_id: int) -> list[int]:
        return self._core.tokens(seq_id)

    def match(self, context: Sequence[int], exclude: int | None = None) -> tuple[int, list[tuple[int, int]]]:
        return self._core.match(list(context), -1 if exclude is None else exclude)

    def continuations(self, context: Sequence[int], exclude: int | None = None) -> dict[int, int]:
        return self._core.continuations(list(context), -1 if exclude is None else exclude)

    def propose(self, context: Sequence[int], max_tokens: int, max_paths: int = 1, *,
                min_token_prob: float = 0.1, tokens_per_match: float = 0.0, source: str = "suffix",
                exclude: int | None = None) -> Draft | None:
        r = self._core.propose(list(context), max_tokens, max_paths, min_token_prob, tokens_per_match,
                               -1 if exclude is None else exclude)
        if r is None:
            return None
        tokens, parents, probs, m = r
        return Draft.unchecked(tokens, parents, probs, source, m, chain=True if max_paths == 1 else None)


def propose_many(lookups: Sequence[tuple["SuffixIndex", int | None]], contexts: Sequence[Sequence[int]],
                 max_tokens: Sequence[int], max_paths: int = 1, *, min_token_prob: float = 0.1,
                 tokens_per_match: float = 0.0, source: str = "suffix") -> list[Draft | None]:
    """``index.propose(context, k, max_paths, exclude=exclude, ...)`` for every ``(index, exclude)``
    of ``lookups`` with its context and ``k`` of ``max_tokens``: the same drafts, in order. Native
    indexes draft in one call (a step's rows: one Python call per source, not one per row)."""
    if not (len(lookups) == len(contexts) == len(max_tokens)):
        raise ValueError(f"propose_many: {len(lookups)} lookups, {len(contexts)} contexts, "
                         f"{len(max_tokens)} max_tokens")
    if not NATIVE or not all(type(ix) is NativeSuffixIndex for ix, _ in lookups):
        return [ix.propose(c, k, max_paths, min_token_prob=min_token_prob, tokens_per_match=tokens_per_match,
                           source=source, exclude=ex) for (ix, ex), c, k in zip(lookups, contexts, max_tokens)]
    flat: list[int] = []
    ends = []
    for c in contexts:
        flat += c
        ends.append(len(flat))
    raw = _native.propose_many([ix._core for ix, _ in lookups], flat, ends,
                               [-1 if ex is None else ex for _, ex in lookups], max_tokens, max_paths,
                               min_token_prob, tokens_per_match)
    chain = True if max_paths == 1 else None
    unchecked = Draft.unchecked
    return [None if r is None else unchecked(r[0], r[1], r[2], source, r[3], chain) for r in raw]


try:
    if os.environ.get("TAILRL_PURE_PYTHON"):
        raise ImportError("TAILRL_PURE_PYTHON is set")
    _native = importlib.import_module("tailrl.speculative.sources._suffix_index")
    NATIVE = True
except ImportError as exc:                 # not built (no compiler at install time): the reference
    logging.getLogger(__name__).warning("tailrl.speculative: native suffix index unavailable (%s); using the "
                                        "pure-Python reference (slower drafting)", exc)
    _native = None
    NATIVE = False

SuffixIndex = NativeSuffixIndex if NATIVE else PySuffixIndex
