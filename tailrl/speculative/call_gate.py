"""Whether a drafter call that the prices approve is made: a measured check of the value model.

``SourceChoice`` approves a call when the expected gains of its requests add up to more than
the call's measured price. Those gains rest on a model (a token is worth the batch's time
per token); on a target whose drafter costs a sizeable share of a forward the model can
approve calls that do not pay. The gate tests the approval against what it brings: a
two-armed bandit per batch-size bucket (``batch_bucket``), arm 0 = skip the approved call
(every request keeps its suffix draft), arm 1 = make it. The reward of a step is its
throughput, (batch size + accepted draft tokens) / seconds, the step's drafting included
(TLT's reward). Both arms are played on the same kind of step (one the prices approved), so
the comparison is not biased by which steps want a call. Each arm is played ``warmup`` times
per bucket in turn, then the arm of higher mean reward (with forgetting: the drafter trains,
contexts grow) is played, the other with probability ``epsilon``. Steps with prefill chunks
teach nothing. Deterministic given ``seed``.
"""
from __future__ import annotations

import random

from tailrl.speculative.policies.cost_model import batch_bucket


class CallGate:
    def __init__(self, epsilon: float = 0.1, warmup: int = 4, decay: float = 0.98, seed: int = 0) -> None:
        self.epsilon, self.warmup, self.decay = epsilon, warmup, decay
        self._rng = random.Random(seed)
        self._sum: dict[int, list[float]] = {}     # bucket -> forgotten reward sums per arm
        self._weight: dict[int, list[float]] = {}  # bucket -> forgotten counts per arm
        self._plays: dict[int, list[int]] = {}     # bucket -> plays per arm
        self._pending: tuple[int, int] | None = None   # (bucket, arm) of this step
        self._accepted = 0                         # draft tokens accepted this step
        self.skipped = 0                           # approved calls skipped (arm 0)

    def allow(self, batch_size: int) -> bool:
        """This step's approved call: make it (True) or skip it."""
        b = batch_bucket(batch_size)
        plays = self._plays.setdefault(b, [0, 0])
        s, w = self._sum.setdefault(b, [0.0, 0.0]), self._weight.setdefault(b, [0.0, 0.0])
        means = [s[i] / w[i] if w[i] > 1e-9 else None for i in (0, 1)]
        if min(plays) < self.warmup or None in means:       # in turn, the call first
            arm = 1 if plays[1] <= plays[0] else 0
        elif self._rng.random() < self.epsilon:
            arm = self._rng.randrange(2)
        else:
            arm = int(means[1] > means[0])
        plays[arm] += 1
        self._pending = (b, arm)
        self.skipped += arm == 0
        return bool(arm)

    def record(self, accepted: int) -> None:
        """A verified draft of this step accepted ``accepted`` tokens (bonus excluded)."""
        self._accepted += accepted

    def observe_step(self, batch_size: int, seconds: float, prefill: bool = False) -> None:
        """The step ended (``seconds``: all of it, drafting included)."""
        pending, accepted = self._pending, self._accepted
        self._pending, self._accepted = None, 0
        if pending is None or prefill or seconds <= 0:
            return
        b, arm = pending
        s, w = self._sum[b], self._weight[b]
        for i in (0, 1):
            s[i] *= self.decay
            w[i] *= self.decay
        s[arm] += (batch_size + accepted) / seconds
        w[arm] += 1.0

    def rejects(self, batch_size: int) -> bool:
        """Whether calls measured worse than skipping them at this batch size (both arms past
        their warm-up)."""
        plays = self._plays.get(batch_bucket(batch_size))
        if plays is None or min(plays) < self.warmup:
            return False
        skip, call = self.mean(batch_size)
        return skip is not None and call is not None and skip > call

    def mean(self, batch_size: int) -> tuple[float | None, float | None]:
        """Mean reward of (skip, call) at this batch size (None: not played)."""
        b = batch_bucket(batch_size)
        s, w = self._sum.get(b, [0.0, 0.0]), self._weight.get(b, [0.0, 0.0])
        return tuple(s[i] / w[i] if w[i] > 0 else None for i in (0, 1))
