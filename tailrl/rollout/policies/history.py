"""`history`: RhymeRL's HistoPipe, placement from the previous epoch's lengths.

Response-length ranks per prompt are stable across epochs, so the previous epoch's lengths
say up front which groups will be long. The policy

1. estimates each request as its prompt's longest previous response (`history`; a prompt
   without history is estimated at its max length, i.e. treated as long);
2. plans before anything runs: longest-processing-time-first placement of the requests onto
   instances by estimated tokens, so the instances' planned loads (and finishing times)
   line up; each instance serves its own plan longest-first (or shortest-first: HistoPipe
   alternates the order across steps so neighbouring steps complement each other; the
   caller passes `shortest_first` by step parity);
3. runs requests in chunks (as `divided`, KV reserved per chunk); between chunks a request
   resumes first on the instance holding its KV. A request that reaches `outlier_factor`
   x its estimate runs far past its history: it is now estimated at its max length and
   migrates to an instance whose remaining planned load is at most the mean (one that
   can absorb it), ahead of planned work;
4. lets an instance whose plan is done steal the longest request of the most loaded plan.
"""
from __future__ import annotations

import heapq
import itertools
import math
from collections import deque

from tailrl.rollout.buffer import RequestState
from tailrl.rollout.policies.base import PolicyConfig, SchedulerPolicy


class HistoryPolicy(SchedulerPolicy):
    name = "history"

    def __init__(self, history: dict[int | str, list[int]], config: PolicyConfig | None = None,
                 shortest_first: bool = False) -> None:
        super().__init__(config)
        self.history = history            # prompt id -> previous epoch's response lengths
        self.shortest_first = shortest_first

    def estimate(self, r: RequestState) -> int:
        """Expected total length from history (max length when unknown or outrun)."""
        past = self.history.get(r.prompt_id)
        if not past or r.request_id in self._outliers:
            return r.max_tokens
        return max(1, min(max(past), r.max_tokens))

    def _setup(self) -> None:
        k = self.num_instances
        self._outliers: set[int] = set()
        self._seq = itertools.count()
        self._plans: list[deque[int]] = [deque() for _ in range(k)]
        self._planned_load = [0] * k        # estimated tokens not yet started, per instance
        self._home: dict[int, int] = {}
        self._migrants: list[tuple[int, int, int, int]] = []  # (-generated, seq, ticket, rid)
        self._total_load = 0
        self._order = sorted(self._buf(), key=lambda r: (-self.estimate(r), r.request_id))
        loads = [(0, i) for i in range(k)]    # LPT: next-longest onto the least loaded plan
        for r in self._order:
            load, i = heapq.heappop(loads)
            self._home[r.request_id] = i
            heapq.heappush(loads, (load + self.estimate(r), i))

    def _initial_order(self) -> list[RequestState]:
        return self._order

    def _add_load(self, i: int, tokens: int) -> None:
        self._planned_load[i] += tokens
        self._total_load += tokens

    def _enqueue(self, r: RequestState, now: float, front: bool = False) -> None:
        t = self._stamp(r)
        if r.request_id in self._outliers:
            heapq.heappush(self._migrants, (-r.generated, next(self._seq), t, r.request_id))
            return
        if r.location is not None:   # between chunks: resume where its KV is, next
            self._home[r.request_id] = r.location
        i = self._home[r.request_id]
        # reset() enqueues longest-first; a started, preempted or refused request goes first
        at_head = front or r.chunks > 0 or self.shortest_first
        self._plans[i].appendleft((t, r.request_id)) if at_head else self._plans[i].append((t, r.request_id))
        self._add_load(i, self._left(r))

    def _left(self, r: RequestState) -> int:
        return max(self.estimate(r) - r.generated, 1)

    def _pop(self, instance: int, now: float) -> int | None:
        mean = self._total_load / self.num_instances
        if self._migrants and self._planned_load[instance] <= mean:
            rid = self._pop_migrant()
            if rid is not None:
                return rid
        rid = self._pop_plan(instance)
        if rid is None:
            rid = self._pop_migrant()
        if rid is None:   # own plan done: steal from the most loaded plan
            victim = max(range(self.num_instances), key=self._planned_load.__getitem__)
            rid = self._pop_plan(victim)
        return rid

    def _pop_plan(self, i: int) -> int | None:
        plan = self._plans[i]
        while plan:
            t, rid = plan.popleft()
            if self._live(rid, t):
                self._add_load(i, -self._left(self._buf()[rid]))
                return rid
        return None

    def _pop_migrant(self) -> int | None:
        while self._migrants:
            *_, t, rid = heapq.heappop(self._migrants)
            if self._live(rid, t):
                return rid
        return None

    def _budget(self, r: RequestState) -> int:
        """Tokens a request may make before it counts as an outlier."""
        return math.ceil(self.estimate(r) * self.config.outlier_factor)

    def _chunk_tokens(self, r: RequestState, instance: int) -> int:
        if r.request_id in self._outliers:
            return self.config.chunk_tokens
        return max(1, min(self.config.chunk_tokens, self._budget(r) - r.generated))

    def _observe(self, r: RequestState, now: float) -> None:
        if not r.finished and r.generated >= self._budget(r):
            self._outliers.add(r.request_id)   # it ran far past its history: migrate it
