"""Running acceptance statistics of speculation (per request, per source, overall).

One number summarises verification outcomes:

- ``rate``: per-token acceptance probability ``a`` of the geometric model Seer's cost
  formula assumes. Each verify step accepts ``accepted`` tokens and, unless it accepted its
  whole deepest path, ends in one rejection, so ``a = A / (A + R)`` (accepted tokens over
  accepted tokens plus rejection events) is the maximum-likelihood estimate. A prior of
  ``prior_weight`` pseudo-tokens at ``prior_rate`` keeps it sane before data arrives.
  The adaptive policy prices a node at depth ``j`` at ``a^j`` times its draft's own path
  probability (an accepted/predicted factor, used before, over-valued deep nodes).

Old outcomes are forgotten exponentially (``decay`` per update): the policy changes during
an RL run and acceptance drifts with it.
"""
from __future__ import annotations

from dataclasses import dataclass

MAX_RATE = 0.99         # the highest ``rate`` reports: no draft is ever certain


@dataclass
class AcceptanceStats:
    prior_rate: float = 0.5
    prior_weight: float = 4.0
    decay: float = 0.98
    accepted: float = 0.0       # tokens accepted (bonus excluded)
    rejections: float = 0.0     # verify steps that stopped before the end of the draft
    drafted: float = 0.0        # nodes verified
    steps: int = 0

    def add(self, draft_nodes: int, accepted: int, full: bool) -> None:
        d = self.decay
        self.accepted = self.accepted * d + accepted
        self.rejections = self.rejections * d + (0.0 if full else 1.0)
        self.drafted = self.drafted * d + draft_nodes
        self.steps += 1

    @property
    def rate(self) -> float:
        w = self.prior_weight
        a = (self.accepted + w * self.prior_rate) / (self.accepted + self.rejections + w)
        return min(a, MAX_RATE)
