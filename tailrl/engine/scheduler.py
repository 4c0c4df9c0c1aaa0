"""Token-budget scheduler for one engine instance.

There is no prefill mode and decode mode: every running request catches its computed tokens up
to its tokens, within a per-step token budget. Decodes go first (one token each), then prefill
chunks, then new requests are admitted while rows, tokens and free K/V blocks allow. A sibling
of a request whose prompt is already in the cache shares that prompt's blocks instead of
prefilling it (the n samples of a prompt share one prefill and one copy of its K/V). When the
pool cannot give the running rows the blocks this step needs, the newest request is preempted:
its blocks go back and it is recomputed later (its tokens are kept, and sampling noise is keyed
by position, so its output does not change).
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from tailrl.engine.kv import KVCache
from tailrl.engine.kv.cache import num_blocks
from tailrl.engine.request import Request, RequestStatus
from tailrl.kernels import BLOCK


@dataclass
class SchedulerOutput:
    rows: list[tuple[Request, int]]      # every running request in row order, with the committed tokens
                                         # it computes this step (0 = it waits for token budget)
    num_tokens: int                      # committed tokens scheduled (prefill chunks + decodes)
    token_budget_left: int               # what drafts may still use
    preempted: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(self, kv: KVCache, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []          # running[i].row == i
        self._arrivals = 0
        self._waiting_in_group: Counter[str] = Counter()

    def add(self, req: Request) -> None:
        """Queue `req` by priority (expected length, longest first: Seer's and RhymeRL's order
        when more requests wait than the batch runs). Equal priorities keep arrival order and
        preempted requests stay ahead of everything (they already lost their place once)."""
        req.status = RequestStatus.WAITING
        self.waiting.insert(self._slot(req.priority), req)
        self._waiting_in_group[req.group_id] += 1

    def _slot(self, priority: float) -> int:
        """Where a new request of `priority` goes: after preempted requests and every waiting
        request of at least its priority. O(1) in the common case (all priorities equal)."""
        q = self.waiting
        if not q or q[-1].status == RequestStatus.PREEMPTED or q[-1].priority >= priority:
            return len(q)
        for i, r in enumerate(q):
            if r.status != RequestStatus.PREEMPTED and r.priority < priority:
                return i
        return len(q)

    def _prefill_chunk(self, req: Request, start: int, budget: int) -> int:
        """Tokens to compute from `start`. While siblings wait to share this prompt, stop at the
        shared boundary (the prompt minus its last token), which they copy next step."""
        n = min(req.num_tokens - start, budget)
        if self._waiting_in_group[req.group_id] and req.num_output_tokens == 0:
            boundary = req.num_prompt_tokens - 1 - start
            if boundary > 0:
                n = min(n, boundary)
        return n

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, req: Request) -> None:
        """Take req out of running (its blocks go back; the last row takes its row) or waiting."""
        if req.row < 0:
            if req in self.waiting:
                self.waiting.remove(req)
                self._waiting_in_group[req.group_id] -= 1
            return
        row, last = req.row, self.running[-1]
        self.kv.register(row, req.tokens, min(req.num_computed_tokens, req.num_tokens))   # its prefix stays cached
        self.kv.release(row)
        if last is not req:
            self.kv.move_row(last.row, row)
            self.running[row] = last
            last.row = row
        self.running.pop()
        req.row = -1

    def preempt(self, req: Request) -> None:
        self.remove(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        self._waiting_in_group[req.group_id] += 1

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        chunk: dict[int, int] = {}                       # id(req) -> committed tokens this step
        # Request.is_decoding, read once per request (hundreds of rows per step)
        decoding = [r.num_computed_tokens + 1 == len(r.prompt_token_ids) + len(r.output_token_ids)
                    for r in self.running]
        running = self.running
        if all(decoding):
            if (budget >= len(running) and not self._may_admit(budget - len(running))
                    and self.kv.grow_rows([(r.row, r.num_computed_tokens + 1) for r in running])):
                # every row decodes one token, all fit, and nobody is admitted (most steps of a
                # rollout's bulk): what the passes below give, in one
                return SchedulerOutput([(req, 1) for req in running], len(running), budget - len(running))
        elif all(d or r.num_computed_tokens == len(r.prompt_token_ids) + len(r.output_token_ids)
                 for r, d in zip(running, decoding)):
            # the same where some rows have nothing to compute (each sits out a step after its
            # verification in the step still in flight: engine/ahead_drafts.py); kept apart from
            # the form above, which it would cover, since that one is the hot path (512 rows:
            # 65 us a step, 84 us through this one)
            n = sum(decoding)
            if (budget >= n and not self._may_admit(budget - n)
                    and self.kv.grow_rows([(r.row, r.num_computed_tokens + d) for r, d in zip(running, decoding)])):
                return SchedulerOutput([(req, int(d)) for req, d in zip(running, decoding)], n, budget - n)
        for req, dec in zip(self.running, decoding):     # decodes first: one token each
            if dec and budget > 0:
                chunk[id(req)] = 1
                budget -= 1
        for req, dec in zip(self.running, decoding):     # then prefill chunks
            if not dec and budget > 0:
                n = self._prefill_chunk(req, req.num_computed_tokens, budget)
                chunk[id(req)] = n
                budget -= n
        preempted: list[Request] = []
        while not self.kv.grow_rows([(r.row, r.num_computed_tokens + chunk.get(id(r), 0)) for r in self.running]):
            victim = max(self.running, key=lambda r: r.arrival)
            budget += chunk.pop(id(victim), 0)
            self.preempt(victim)
            preempted.append(victim)
        budget = self._admit(chunk, budget, preempted)
        rows = [(req, chunk.get(id(req), 0)) for req in self.running]
        return SchedulerOutput(rows, self.max_num_batched_tokens - budget, budget, preempted)

    def _may_admit(self, budget: int) -> bool:
        """Whether a request waits and rows and ``budget`` tokens are left for it."""
        return bool(self.waiting) and len(self.running) < self.max_num_seqs and budget > 0

    def _admit(self, chunk: dict[int, int], budget: int, preempted: list[Request]) -> int:
        if not self._may_admit(budget):
            return budget                               # nothing to admit (most steps)
        # a running sibling with the prompt (minus its last token) in cache can lend its K/V
        lenders: dict[str, Request] = {}
        caching = self.kv.prefix is not None
        for r in self.running:
            if caching:                                 # what the running rows computed, cached
                self.kv.register(r.row, r.tokens, r.num_computed_tokens)
            best = lenders.get(r.group_id)
            if best is None or r.num_computed_tokens > best.num_computed_tokens:
                lenders[r.group_id] = r
        deferred: list[Request] = []
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            req = self.waiting.popleft()
            if req in preempted:                        # not again in the step that evicted it
                deferred.append(req)
                continue
            start, lender, found, queried = 0, None, [], 0
            shared = req.num_prompt_tokens - 1
            if req.pending_kv is not None:
                start = req.pending_kv.shape[3]
            else:
                lender = lenders.get(req.group_id)
                if lender is not None and lender.prompt_token_ids == req.prompt_token_ids:
                    if lender.num_computed_tokens < shared and req.num_output_tokens == 0:
                        deferred.append(req)            # the sibling is still prefilling: wait for it
                        continue
                    start = shared if shared > 0 and lender.num_computed_tokens >= shared else 0
                    lender = lender if start else None
                else:
                    lender = None
                if lender is None and caching and not req.prompt_logprobs_pending:   # the longest prefix cached,
                    # less its last token (none for a request whose prompt logprobs its prefill gives)
                    queried = (req.num_tokens - 1) // BLOCK
                    found = self.kv.lookup(req.tokens(0, queried * BLOCK), queried)
                    start, queried = len(found) * BLOCK, queried * BLOCK
            self._waiting_in_group[req.group_id] -= 1
            n = self._prefill_chunk(req, start, budget)
            if not self._place(req, len(self.running), lender, start, start + n, found, queried):
                self._waiting_in_group[req.group_id] += 1
                deferred.append(req)
                break
            req.row = len(self.running)
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            self._arrivals += 1
            req.arrival = self._arrivals
            if req.pending_kv is not None:
                self.kv.import_row(req.row, req.pending_kv)
                req.pending_kv = None
            req.num_computed_tokens = start
            chunk[id(req)] = n
            budget -= n
            lenders.setdefault(req.group_id, req)
        self.waiting.extendleft(reversed(deferred))
        return budget

    def _place(self, req: Request, row: int, lender: Request | None, start: int, length: int,
               found: list | None = None, queried: int = 0) -> bool:
        """Give free row ``row`` the blocks of ``req``'s first ``length`` positions: the
        lender's first ``start`` shared (its prompt), or the cached prefix ``found`` (kv/prefix.py),
        the rest new. False (no change) when the pool lacks them."""
        shared = start // BLOCK if lender is not None else len(found or ())
        if num_blocks(length) - shared + (self.kv.cached_cost(found) if found else 0) > self.kv.free_blocks:
            return False
        self.kv.take_cached(row, found or [], queried)
        if lender is not None:
            self.kv.share(lender.row, row, start)
        return self.kv.grow(row, length)
