"""`history`: RhymeRL's HistoPipe, placement from the previous epoch's lengths.

Response-length ranks per prompt are stable across epochs, so the previous epoch says up
front, before any probe runs, which work is long. The policy

1. estimates each request as its prompt's longest previous response (`history`; a prompt
   without history is estimated at its max length, i.e. treated as long);
2. places work so finishing times line up: longest-processing-time-first list scheduling
   done online. Whenever an instance has room it takes the longest-estimated waiting
   request (the least-loaded machine gets the next-longest job), so long work starts
   first and the short work fills in behind it on whichever instance frees up.
   `shortest_first=True` reverses the order (HistoPipe alternates it across steps so that
   neighbouring steps complement each other; the caller passes it by step parity);
3. runs requests in chunks (as `divided`, KV reserved per chunk); at equal estimate an
   instance resumes the requests whose KV it holds;
4. treats a request that reaches `outlier_factor` x its estimate as an outlier that runs
   far past its history: it is re-estimated at its max length, so it goes first at its
   next chunk boundary, onto the instance that asks first within its fair share (a
   migration when that is not where its KV is).

Departure: HistoPipe plans placement per step ahead of time; a static plan loses to the
online rule once instances pull chunks (a long request queued on a busy instance waits
while another instance runs short ones), which we measured (docs/scheduling.md).
"""
from __future__ import annotations

import itertools
import math

from tailrl.rollout.buffer import BufferEntry
from tailrl.rollout.policies.base import PolicyConfig, SchedulerPolicy
from tailrl.rollout.policies.ranked import RankedQueue


class HistoryPolicy(SchedulerPolicy):
    name = "history"
    ranked = True

    def __init__(self, history: dict[int | str, list[int]], config: PolicyConfig | None = None,
                 shortest_first: bool = False) -> None:
        super().__init__(config)
        self.history = history            # prompt id -> previous epoch's response lengths
        self.shortest_first = shortest_first

    def estimate(self, r: BufferEntry) -> int:
        """Expected total length from history (max length when unknown or outrun)."""
        past = self.history.get(r.prompt_id)
        if not past or r.request_id in self._outliers:
            return r.max_tokens
        return max(1, min(max(past), r.max_tokens))

    def _expected_remaining(self, r: BufferEntry) -> int:
        return max(1, self.estimate(r) - r.generated)

    def known_lengths(self, r: BufferEntry) -> tuple[int, ...]:
        return tuple(self.history.get(r.prompt_id) or ())

    def _setup(self) -> None:
        self._outliers: set[int] = set()
        self._seq = itertools.count()
        # (key, -generated, seq, ticket, rid); key = -estimate (longest first) or +estimate
        self._queue = RankedQueue(self.num_instances, self._live)

    def _enqueue(self, r: BufferEntry, now: float, front: bool = False) -> None:
        est = self.estimate(r)
        key = est if self.shortest_first and r.request_id not in self._outliers else -est
        self._queue.push((key, -r.generated, next(self._seq), self._stamp(r), r.request_id), r.location)

    def _pop(self, instance: int, now: float) -> int | None:
        return self._queue.pop(instance)

    def _budget(self, r: BufferEntry) -> int:
        """Tokens a request may make before it counts as an outlier."""
        return math.ceil(self.estimate(r) * self.config.outlier_factor)

    def _chunk_tokens(self, r: BufferEntry, instance: int) -> int:
        if r.request_id in self._outliers:
            return self.config.chunk_tokens
        return max(1, min(self.config.chunk_tokens, self._budget(r) - r.generated))

    def _observe(self, r: BufferEntry, now: float) -> None:
        if not r.finished and r.generated >= self._budget(r):
            self._outliers.add(r.request_id)   # it ran far past its history
