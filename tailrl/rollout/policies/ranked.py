"""A priority queue of waiting requests that prefers local KV without breaking the order.

Used by the priority policies (`context`, `oracle`). Every entry is pushed to one global
heap and, when the request's KV lives on an instance, to that instance's heap too. An
instance takes its own best request when it ranks at least as high (same primary key)
as the best one anywhere: equal-priority work resumes where its KV is, and no request is
passed over for a less urgent local one. Entries are lazy: a request started through one
heap leaves a stale copy in the other, which `live` rejects later.
"""
from __future__ import annotations

import heapq
from typing import Callable


class RankedQueue:
    """Entries are (primary, *tiebreaks, ticket, request_id) tuples; smallest first."""

    def __init__(self, num_instances: int, live: Callable[[int, int], bool]) -> None:
        self._global: list[tuple] = []
        self._local: list[list[tuple]] = [[] for _ in range(num_instances)]
        self._live = live   # (request_id, ticket) -> entry still current?

    def push(self, entry: tuple, location: int | None) -> None:
        heapq.heappush(self._global, entry)
        if location is not None:
            heapq.heappush(self._local[location], entry)

    def _head(self, heap: list[tuple]) -> tuple | None:
        while heap and not self._live(heap[0][-1], heap[0][-2]):
            heapq.heappop(heap)
        return heap[0] if heap else None

    def pop(self, instance: int) -> int | None:
        """The next request for `instance`, or None when nothing is waiting."""
        best, mine = self._head(self._global), self._head(self._local[instance])
        if mine is not None and (best is None or mine[0] <= best[0]):
            return heapq.heappop(self._local[instance])[-1]
        return heapq.heappop(self._global)[-1] if best is not None else None
