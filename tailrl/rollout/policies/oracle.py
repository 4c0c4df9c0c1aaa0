"""`oracle`: knows every request's true length; longest remaining first. Evaluation only.

The reference the practical policies are measured against (Seer's "Oracle": ideal
longest-first scheduling in the same divided-rollout system). Everything else is as in
`divided` and `context`: the same chunks, the same KV reservation per chunk (a full chunk,
although it could know better), the same preference for local KV at equal rank. So the
gap between `context` and `oracle` is the cost of not knowing the lengths when ordering.
"""
from __future__ import annotations

from tailrl.rollout.buffer import RequestState
from tailrl.rollout.policies.base import PolicyConfig, SchedulerPolicy
from tailrl.rollout.policies.ranked import RankedQueue


class OraclePolicy(SchedulerPolicy):
    name = "oracle"

    def __init__(self, true_lengths: dict[int, int], config: PolicyConfig | None = None) -> None:
        super().__init__(config)
        self.true_lengths = dict(true_lengths)  # request id -> tokens it will generate

    def _setup(self) -> None:
        missing = [r.request_id for r in self._buf() if r.request_id not in self.true_lengths]
        if missing:
            raise ValueError(f"true_lengths is missing {len(missing)} requests, e.g. {missing[:3]}")
        self._queue = RankedQueue(self.num_instances, self._live)  # (-true remaining, ticket, rid)

    def _true_remaining(self, r: RequestState) -> int:
        return max(1, min(self.true_lengths[r.request_id], r.max_tokens) - r.generated)

    def _enqueue(self, r: RequestState, now: float, front: bool = False) -> None:
        self._queue.push((-self._true_remaining(r), self._stamp(r), r.request_id), r.location)

    def _pop(self, instance: int, now: float) -> int | None:
        return self._queue.pop(instance)
