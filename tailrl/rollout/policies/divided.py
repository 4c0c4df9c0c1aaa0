"""`divided`: Seer's divided rollout without length context.

Requests leave their group and run in chunks of at most `chunk_tokens` new tokens; after
each chunk a request returns to the global buffer and may resume on any instance. Instances
pull work when they have room, which balances load by construction. Placement prefers the
instance that holds a request's KV (no transfer): an instance first resumes its own
requests, oldest first, then takes the oldest waiting request of any instance (a migration
when that request's KV lives elsewhere). A chunk's KV growth is reserved at admission, so
memory never overflows and nothing is preempted.
"""
from __future__ import annotations

from collections import deque

from tailrl.rollout.buffer import BufferEntry
from tailrl.rollout.policies.base import SchedulerPolicy


class DividedPolicy(SchedulerPolicy):
    name = "divided"

    def _setup(self) -> None:
        self._global: deque[tuple[int, int]] = deque()            # (ticket, request) FIFO
        self._local: list[deque[tuple[int, int]]] = [deque() for _ in range(self.num_instances)]

    def _enqueue(self, r: BufferEntry, now: float, front: bool = False) -> None:
        entry = (self._stamp(r), r.request_id)
        queues = [self._global] + ([self._local[r.location]] if r.location is not None else [])
        for q in queues:
            q.appendleft(entry) if front else q.append(entry)

    def _pop(self, instance: int, now: float) -> int | None:
        for q in (self._local[instance], self._global):
            while q:
                ticket, rid = q.popleft()
                if self._live(rid, ticket):   # the other queue's copy dies when it starts
                    return rid
        return None
