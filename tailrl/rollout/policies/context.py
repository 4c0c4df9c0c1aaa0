"""`context`: Seer's context-aware scheduling on top of divided rollout.

Responses of one prompt have correlated lengths, so the first response of each group is a
*probe* that runs before the rest of its group:

1. Probes go first, shortest-generated-first: every group gets a chance to reveal that it
   is short before any probe's continuation runs (a probe that has generated less is more
   likely to finish soon).
2. A group's length estimate is its longest finished member; a group with none finished
   yet is estimated at its max length (a probe still running is evidence of a long group).
   A request that has already outrun its group's estimate is treated as unknown again.
3. All other requests go longest-estimate-first (ties: most generated first, so a long
   request returning at a chunk boundary resumes at once rather than queueing behind its
   unstarted siblings).
4. Anti-starvation: a request that has waited longer than `starvation_s` goes before both
   (a safety net: in a synchronous step everything runs eventually, and a short deadline
   would turn longest-first back into first-come-first-served).
5. Locality: an instance resumes a request whose KV it holds instead of the globally best
   one when the local one is estimated at least as long (the order is kept, bytes saved).

Chunks and KV reservation are as in `divided`.
"""
from __future__ import annotations

import heapq
import itertools

from tailrl.rollout.buffer import BufferEntry, EntryStatus
from tailrl.rollout.policies.base import SchedulerPolicy
from tailrl.rollout.policies.ranked import RankedQueue


class ContextPolicy(SchedulerPolicy):
    name = "context"
    ranked = True

    def _setup(self) -> None:
        buf = self._buf()
        self._probe_of = {g: buf.group(g)[0].request_id for g in buf.group_ids()}
        self._estimate: dict[int, int] = {}                  # group -> longest finished member
        self._seq = itertools.count()                        # FIFO tie-break inside heaps
        self._probes: list[tuple[int, int, int, int]] = []   # (generated, seq, ticket, rid)
        # (-estimate, -generated, seq, ticket, rid), preferring local KV at equal estimates
        self._main = RankedQueue(self.num_instances, self._live)
        self._waits: list[tuple[float, int, int, int]] = []  # (waiting since, seq, ticket, rid)
        self._since: dict[int, tuple[int, float]] = {}       # rid -> (chunks started, waiting since)

    def estimate(self, r: BufferEntry) -> int:
        """Estimated total length of `r` (tokens), as the order of service uses it."""
        est = self._estimate.get(r.group_id)
        return r.max_tokens if est is None or r.generated >= est else est

    def _expected_remaining(self, r: BufferEntry) -> int:
        return max(1, self.estimate(r) - r.generated)

    def known_lengths(self, r: BufferEntry) -> tuple[int, ...]:
        """The lengths of the group's finished members (the probe's first)."""
        return tuple(m.generated for m in self._buf().group(r.group_id) if m.status == EntryStatus.FINISHED)

    def is_probe(self, r: BufferEntry) -> bool:
        return self._probe_of[r.group_id] == r.request_id and r.group_id not in self._estimate

    def _enqueue(self, r: BufferEntry, now: float, front: bool = False) -> None:
        t, seq = self._stamp(r), next(self._seq)
        if self.is_probe(r):
            heapq.heappush(self._probes, (r.generated, seq, t, r.request_id))
            return
        self._main.push((-self.estimate(r), -r.generated, seq, t, r.request_id), r.location)
        chunks, since = self._since.get(r.request_id, (-1, now))
        if chunks != r.chunks:   # it ran since it last queued: a new wait begins now
            since = now
            self._since[r.request_id] = (r.chunks, now)
        heapq.heappush(self._waits, (since, seq, t, r.request_id))

    def _pop(self, instance: int, now: float) -> int | None:
        # anti-starvation: the oldest waiting non-probe, if it has waited too long
        waits = self._waits
        while waits and not self._live(waits[0][3], waits[0][2]):
            heapq.heappop(waits)
        if waits and now - waits[0][0] > self.config.starvation_s:
            return heapq.heappop(waits)[3]
        probes = self._probes
        while probes:
            entry = heapq.heappop(probes)
            if self._live(entry[-1], entry[-2]):
                return entry[-1]
        return self._main.pop(instance)

    def _observe(self, r: BufferEntry, now: float) -> None:
        if not r.finished or r.generated <= self._estimate.get(r.group_id, -1):
            return
        self._estimate[r.group_id] = r.generated
        # the group's order changed: requeue its waiting members (old entries go stale)
        for m in self._buf().group(r.group_id):
            if m.status == m.status.WAITING:
                self._requeue(m, now)
