"""The spot trainer's data: the rollout's own (target hidden state, sampled token) pairs.

The engine already computes the normed hidden state of every position it samples from (the
root of each row and every draft node). After verification it hands the states that sampled
the emitted tokens to ``add(req, tokens, hidden)``: no extra target forward. Consecutive
positions of one request form a *run*; a gap (the request was preempted and recomputed, or
resumed elsewhere: its prefill positions are not sampled) starts a new run, so a training
window never spans positions whose states were not kept.

Bounded: at most ``capacity`` positions in all. Adding past it evicts the oldest runs first
(running or finished), so the buffer holds the most recent data, i.e. the current policy's.
``data(unroll)`` lays the runs out as a ``DrafterData`` (cached until the next change).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from tailrl.model.drafter import DrafterData


class _Run:
    __slots__ = ("hidden", "tokens", "end")

    def __init__(self, end: int) -> None:
        self.hidden: list[torch.Tensor] = []    # [E, H] chunks; row i sampled tokens[i]
        self.tokens: list[int] = []
        self.end = end                          # the request's num_tokens after the last pair

    def __len__(self) -> int:
        return len(self.tokens)

    def drop_head(self, n: int) -> None:
        h = torch.cat(self.hidden)[n:]
        self.hidden, self.tokens = [h], self.tokens[n:]


class DrafterBuffer:
    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or capacity < 2:
            raise ValueError(f"drafter buffer capacity must be an integer >= 2, got {capacity!r}")
        self.capacity = capacity
        self._runs: OrderedDict[int, _Run] = OrderedDict()   # oldest first
        self._open: dict[str, int] = {}                      # request id -> its current run's key
        self._next_key = 0
        self.size = 0                                        # positions held
        self.added = 0                                       # positions ever added
        self._cache: tuple[int, int, DrafterData | None] | None = None   # (added, unroll, data)

    def __len__(self) -> int:
        return self.size

    def add(self, req: Any, tokens: list[int], hidden: torch.Tensor) -> None:
        """``hidden`` [E, H]: the states that sampled ``tokens`` (E of them), which ``req`` has
        just appended to its output."""
        if len(tokens) != hidden.shape[0]:
            raise ValueError(f"drafter buffer: {len(tokens)} tokens but {hidden.shape[0]} hidden states")
        if not tokens:
            return
        key = self._open.get(req.request_id)
        run = self._runs.get(key) if key is not None else None
        if run is None or run.end != req.num_tokens - len(tokens):
            key, run = self._next_key, _Run(0)
            self._next_key += 1
            self._runs[key] = run
            self._open[req.request_id] = key
        run.hidden.append(hidden.detach().float().cpu())
        run.tokens.extend(tokens)
        run.end = req.num_tokens
        self.size += len(tokens)
        self.added += len(tokens)
        self._evict()

    def finish(self, req: Any) -> None:
        """``req`` left the engine: its run is closed (it stays in the buffer)."""
        self._open.pop(req.request_id, None)

    def _evict(self) -> None:
        while self.size > self.capacity:
            key, run = next(iter(self._runs.items()))
            over = self.size - self.capacity
            if len(run) > over and len(self._runs) == 1:      # one run larger than the buffer: keep its tail
                run.drop_head(over)
                self.size -= over
                return
            del self._runs[key]
            self.size -= len(run)

    def data(self, unroll: int) -> DrafterData | None:
        """All runs as training windows of ``unroll`` drafter steps; None when no run is long enough."""
        if self._cache is not None and self._cache[:2] == (self.added, unroll):
            return self._cache[2]
        hidden, tokens, starts = [], [], []
        offset = 0
        for run in self._runs.values():
            n = len(run)
            if n > unroll:
                if len(run.hidden) > 1:                       # consolidate once
                    run.hidden = [torch.cat(run.hidden)]
                hidden.append(run.hidden[0])
                # position j holds h_j and x_j; h_j sampled x_{j+1} = run.tokens[j]
                tokens.append(torch.tensor([0] + run.tokens[:-1]))
                starts.append(torch.arange(offset, offset + n - unroll))
                offset += n
        data = DrafterData(torch.cat(hidden), torch.cat(tokens), torch.cat(starts)) if starts else None
        self._cache = (self.added, unroll, data)
        return data
