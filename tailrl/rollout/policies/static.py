"""`static`: the veRL baseline. The batch is split evenly across instances up front.

Each instance gets one contiguous share of the batch in buffer order (so a GRPO group stays
on one instance, as veRL's data-parallel split does) and runs every request of its share to
the end with continuous batching. Admission looks at current KV use only, so growing
requests can force preemptions; a preempted request goes back to the front of its own
instance's queue. Nothing ever moves between instances: once an instance's share is done it
idles until the slowest share finishes, which is the long tail this project removes.
"""
from __future__ import annotations

from collections import deque

from tailrl.rollout.buffer import BufferEntry
from tailrl.rollout.policies.base import SchedulerPolicy


class StaticPolicy(SchedulerPolicy):
    name = "static"
    reserve_chunk = False
    balance = False

    def _setup(self) -> None:
        reqs = list(self._buf())
        n, k = len(reqs), self.num_instances
        # share j holds requests [j*n//k, (j+1)*n//k): sizes differ by at most one
        self._home = {r.request_id: (idx * k) // n if n else 0 for idx, r in enumerate(reqs)}
        self._queues: list[deque[int]] = [deque() for _ in range(k)]

    def share(self, instance: int) -> list[int]:
        """The request ids assigned to `instance` (for tests and reports)."""
        return [rid for rid, home in self._home.items() if home == instance]

    def _enqueue(self, r: BufferEntry, now: float, front: bool = False) -> None:
        q = self._queues[self._home[r.request_id]]
        q.appendleft(r.request_id) if front else q.append(r.request_id)

    def _pop(self, instance: int, now: float) -> int | None:
        q = self._queues[instance]
        return q.popleft() if q else None

    def _chunk_tokens(self, r: BufferEntry, instance: int) -> int:
        return r.remaining  # no chunking: run to EOS or the length limit

    def on_instance_lost(self, instance: int) -> None:
        """The lost instance's share is dealt round-robin to the survivors (queued work moves
        now; its running requests follow when they come back through `on_preempt`)."""
        super().on_instance_lost(instance)
        alive = [j for j in range(self.num_instances) if j not in self._lost]
        moved = [rid for rid, home in self._home.items() if home == instance]
        for k, rid in enumerate(moved):
            self._home[rid] = alive[k % len(alive)]
        for rid in self._queues[instance]:
            self._queues[self._home[rid]].append(rid)
        self._queues[instance].clear()

    def has_work_for(self, instance: int) -> bool:
        return bool(self._queues[instance])
