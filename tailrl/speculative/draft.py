"""A draft: a chain or a tree of proposed tokens for one request, with acceptance estimates.

Layout (the contract with the engine's verifier):

- ``tokens[i]`` is draft node ``i``; nodes are in topological order (a parent always comes
  before its children), so a verifier can build the tree attention mask in one pass.
- ``parents[i]`` is the index of node ``i``'s parent, or ``-1`` when the node directly
  follows the request's last token (the root). A chain is ``parents == [-1, 0, 1, ...]``.
- ``probs[i]`` is the estimated probability that node ``i`` is accepted *given that its
  parent was*. The probability of reaching node ``i`` (its path probability) is the product
  of ``probs`` along its path; the expected number of accepted tokens is the sum of path
  probabilities over all nodes (each node is accepted only if its whole path is).
- ``source`` names the draft source (``"history"``, ``"group"``, ``"self"``, ...).

``truncate(k)`` keeps the ``k`` nodes of highest path probability and every ancestor of a
kept node, so a policy can cut any draft to a token budget without breaking the tree.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from itertools import accumulate
from operator import mul


@dataclass
class Draft:
    tokens: list[int]                 # draft nodes, topological order
    parents: list[int]                # parent index per node; -1 = child of the root
    probs: list[float]                # P(node accepted | parent accepted), in [0, 1]
    source: str                       # which draft source produced it
    match_len: int = 0                # length of the context suffix the draft was matched on
    _path: list[float] | None = field(default=None, init=False, repr=False, compare=False)
    _chain: bool | None = field(default=None, init=False, repr=False, compare=False)
    _score: float | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if len(self.parents) != n or len(self.probs) != n:
            raise ValueError(f"Draft fields disagree in length: tokens {n}, parents "
                             f"{len(self.parents)}, probs {len(self.probs)}")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"Draft parents[{i}]={p} breaks topological order")
        for i, q in enumerate(self.probs):
            if not 0.0 <= q <= 1.0:
                raise ValueError(f"Draft probs[{i}]={q} is not a probability")

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, tokens: list[int], probs: list[float] | None = None, source: str = "self") -> "Draft":
        """A linear draft; ``probs`` default to 1."""
        probs = [1.0] * len(tokens) if probs is None else list(probs)
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), probs, source)

    @classmethod
    def unchecked(cls, tokens: list[int], parents: list[int], probs: list[float], source: str,
                  match_len: int = 0, chain: bool | None = None) -> "Draft":
        """A draft from code that builds valid ones (the native index, ``truncate``), without
        ``__post_init__``'s per-node checks: drafting runs for every request at every step."""
        d = object.__new__(cls)
        d.tokens, d.parents, d.probs, d.source, d.match_len = tokens, parents, probs, source, match_len
        d._path, d._chain, d._score = None, chain, None
        return d

    def rest(self, n: int) -> "Draft":
        """A chain's nodes from ``n`` on, as a chain (the unverified rest after ``n`` accepted)."""
        k = len(self.tokens) - n
        return Draft.unchecked(self.tokens[n:], list(range(-1, k - 1)), self.probs[n:], self.source, chain=True)

    @property
    def is_chain(self) -> bool:
        if self._chain is None:
            self._chain = all(p == i - 1 for i, p in enumerate(self.parents))
        return self._chain

    @property
    def depths(self) -> list[int]:
        """Depth of every node: 1 for children of the root."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    @property
    def max_depth(self) -> int:
        return len(self.tokens) if self.is_chain else max(self.depths, default=0)

    @property
    def path_probs(self) -> list[float]:
        """Probability that each node is accepted (product of ``probs`` along its path)."""
        if self._path is None:
            if self._chain:                 # known to be a chain: the running product, at C speed
                self._path = list(accumulate(self.probs, mul))
            else:
                out: list[float] = []
                for p, q in zip(self.parents, self.probs):
                    out.append(q if p < 0 else out[p] * q)
                self._path = out
        return self._path

    @property
    def score(self) -> float:
        """Expected number of accepted draft tokens (bonus token excluded)."""
        if self._score is None:
            self._score = float(sum(self.path_probs))
        return self._score

    def accepted_by(self, emitted: list[int]) -> int:
        """Draft nodes a verifier accepts when the target emits ``emitted`` from the root on
        (``emitted[d]`` is the token after the path's node at depth d): the length of the
        path that spells a prefix of ``emitted`` (duplicate siblings: the first one, as the
        verifier). This is what verifying the draft gives, when the emitted tokens do not
        depend on the draft (counter-based sampling): how shadow drafts are scored."""
        if self.is_chain:
            n = 0
            for t, e in zip(self.tokens, emitted):
                if t != e:
                    break
                n += 1
            return n
        children: dict[tuple[int, int], int] = {}
        for j, (p, t) in enumerate(zip(self.parents, self.tokens)):
            children.setdefault((p, t), j)
        node, depth = -1, 0
        while depth < len(emitted) and (node, emitted[depth]) in children:
            node, depth = children[(node, emitted[depth])], depth + 1
        return depth

    def path_to(self, i: int) -> list[int]:
        """Tokens from the root down to node ``i`` (inclusive)."""
        out = []
        while i >= 0:
            out.append(self.tokens[i])
            i = self.parents[i]
        return out[::-1]

    def truncate(self, k: int) -> "Draft":
        """Keep the ``k`` nodes of highest path probability, closed under ancestors.

        Best-first over the frontier (children of kept nodes), so a node is only ever taken
        after its parent; ties go to the earlier node. The result keeps the original relative
        (topological) order with re-indexed parents.
        """
        n = len(self.tokens)
        if k >= n:
            return self
        if k <= 0:
            return Draft([], [], [], self.source, self.match_len)
        if self.is_chain:                               # the first k nodes
            return Draft.unchecked(self.tokens[:k], self.parents[:k], self.probs[:k], self.source,
                                   self.match_len, chain=True)
        children: list[list[int]] = [[] for _ in range(n + 1)]   # slot n = root
        for i, p in enumerate(self.parents):
            children[p if p >= 0 else n].append(i)
        path = self.path_probs
        frontier = [(-path[i], i) for i in children[n]]
        heapq.heapify(frontier)
        kept: list[int] = []
        while frontier and len(kept) < k:
            _, i = heapq.heappop(frontier)
            kept.append(i)
            for c in children[i]:
                heapq.heappush(frontier, (-path[c], c))
        kept.sort()
        new_index = {old: new for new, old in enumerate(kept)}
        return Draft([self.tokens[i] for i in kept],
                     [new_index[self.parents[i]] if self.parents[i] >= 0 else -1 for i in kept],
                     [self.probs[i] for i in kept], self.source, self.match_len)
