"""TLT's adaptive speculation: a bucketed epsilon-greedy bandit over speculation settings.

Arms are ``(max draft nodes per request, max tree paths)``; ``(0, 1)`` is plain decoding, so
the bandit can learn to switch speculation off. Batch sizes are bucketed by powers of two
and each bucket learns separately (speculation pays at batch 2, not at batch 256).

Per step: ``max_paths(batch_size)`` picks the arm for the step's bucket (untried arms
first, in order; then with probability ``epsilon`` a uniformly random arm, else the best
mean reward), ``allocate`` gives every proposal ``min(arm tokens, draft size)``,
``update`` sums the accepted tokens, and the next ``observe_step`` closes the step with
reward = tokens produced per second = (``batch_size`` + accepted) / ``seconds``, i.e. TLT's
accepted length x batch size / step time. Forwards with no pending arm (prefill-only steps)
and steps where a speculating arm found no draft to verify teach nothing. Rewards are
averaged with forgetting (``decay``) since contexts grow.

Deterministic given ``seed``: all randomness comes from one ``random.Random(seed)``.
"""
from __future__ import annotations

import random
from typing import Any

from tailrl.speculative.draft import Draft
from tailrl.speculative.policies.cost_model import batch_bucket

DEFAULT_ARMS = ((0, 1), (2, 1), (4, 1), (8, 1), (4, 4), (8, 4), (16, 4))


class BanditPolicy:
    def __init__(self, arms: tuple[tuple[int, int], ...] = DEFAULT_ARMS, *, epsilon: float = 0.1,
                 seed: int = 0, max_spec_batch: int = 0, decay: float = 0.99) -> None:
        if not arms or any(k < 0 or p < 1 for k, p in arms):
            raise ValueError(f"arms must be non-empty (tokens >= 0, paths >= 1) pairs, got {arms}")
        if not 0 <= epsilon <= 1:
            raise ValueError(f"epsilon must be in [0, 1], got {epsilon}")
        self.arms = tuple(arms)
        self.epsilon = epsilon
        self.max_spec_batch = max_spec_batch
        self.decay = decay
        self._rng = random.Random(seed)
        # per bucket: reward sums and weights per arm (forgetting), plays per arm
        self._sum: dict[int, list[float]] = {}
        self._weight: dict[int, list[float]] = {}
        self._plays: dict[int, list[int]] = {}
        self._pending: tuple[int, int, int] | None = None   # (bucket, arm, batch_size)
        self._accepted = 0
        self._allocated = 0          # draft nodes handed out under the pending arm

    @staticmethod
    def bucket(batch_size: int) -> int:
        return batch_bucket(batch_size)

    def _off(self, batch_size: int) -> bool:
        return bool(self.max_spec_batch) and batch_size > self.max_spec_batch

    def _choose(self, batch_size: int) -> int:
        b = self.bucket(batch_size)
        if b not in self._sum:
            n = len(self.arms)
            self._sum[b], self._weight[b], self._plays[b] = [0.0] * n, [0.0] * n, [0] * n
        plays = self._plays[b]
        untried = [i for i, c in enumerate(plays) if c == 0]
        if untried:
            arm = untried[0]
        elif self._rng.random() < self.epsilon:
            arm = self._rng.randrange(len(self.arms))
        else:
            means = [s / w for s, w in zip(self._sum[b], self._weight[b])]
            arm = max(range(len(means)), key=means.__getitem__)
        self._pending = (b, arm, batch_size)
        self._accepted = self._allocated = 0
        return arm

    def current_arm(self) -> tuple[int, int] | None:
        return None if self._pending is None else self.arms[self._pending[1]]

    def max_paths(self, batch_size: int) -> int:
        if self._off(batch_size):
            self._pending = None
            return 0
        k, paths = self.arms[self._choose(batch_size)]
        return paths if k > 0 else 0

    def draft_limit(self, req: Any) -> int:
        arm = self.current_arm()
        return max(k for k, _ in self.arms) if arm is None else arm[0]

    def allocate(self, proposals: list[tuple[Any, Draft]], batch_size: int,
                 max_tokens: int | None = None) -> list[int]:
        if self._off(batch_size):
            return [0] * len(proposals)
        if self._pending is None or self._pending[2] != batch_size:
            self._choose(batch_size)
        k = self.arms[self._pending[1]][0]
        alloc = [min(k, len(d)) for _, d in proposals]
        self._allocated += sum(alloc)
        return alloc

    def observe_draft(self, seconds: float, requests: int = 1) -> None:
        pass

    def update(self, req: Any, draft_nodes: int, accepted: int, source: str, *,
               max_depth: int | None = None, score: float | None = None) -> None:
        self._accepted += accepted

    def observe_step(self, batch_size: int, num_tokens: int, seconds: float) -> None:
        if self._pending is None or not seconds > 0:
            return
        b, arm, _ = self._pending
        self._pending = None
        if self.arms[arm][0] > 0 and self._allocated == 0:
            return                   # nobody had a draft: this step says nothing about the arm
        reward = (batch_size + self._accepted) / seconds
        self._sum[b] = [s * self.decay for s in self._sum[b]]
        self._weight[b] = [w * self.decay for w in self._weight[b]]
        self._sum[b][arm] += reward
        self._weight[b][arm] += 1.0
        self._plays[b][arm] += 1

    def means(self, batch_size: int) -> list[float | None]:
        """Mean reward per arm in ``batch_size``'s bucket (None = never played)."""
        b = self.bucket(batch_size)
        if b not in self._sum:
            return [None] * len(self.arms)
        return [s / w if p else None for s, w, p in zip(self._sum[b], self._weight[b], self._plays[b])]

    def finish(self, req: Any) -> None:
        pass
