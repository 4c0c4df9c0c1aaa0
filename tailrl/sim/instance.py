"""One simulated engine instance: a continuous batch advanced in runs, not tokens.

Running requests live in fixed slot arrays (numpy, one entry per batch slot; a free slot
has rate 0 and infinite tokens left, so whole-array updates need no masks). Between two
events the batch is fixed, so the instance computes how many steps until its next event
(the first chunk end, or the step at which KV would overflow) and the closed-form time of
those steps (`step_model.run_time`). Each request makes `rate` tokens a step: 1 without
speculation, its mean accepted length with it.

On KV overflow the newest running request is preempted (recompute, as vLLM does): its KV is
dropped and it returns to the buffer with what it has generated.
"""
from __future__ import annotations

import math

import numpy as np

from tailrl.sim.step_model import StepModel, run_time, steps_within

_EPS = 1e-9


class SimInstance:
    def __init__(self, index: int, slots: int, kv_capacity: int, step_model: StepModel,
                 draft_tokens: int = 0) -> None:
        self.index, self.slots, self.kv_capacity = index, slots, kv_capacity
        self.step_model, self.draft_tokens = step_model, draft_tokens
        self.active = np.zeros(slots, dtype=bool)
        self.rid = np.zeros(slots, dtype=np.int64)
        self.left = np.full(slots, np.inf)   # tokens left in this chunk (inf: free slot)
        self.target = np.zeros(slots, dtype=np.int64)  # tokens this chunk makes if it ends
        self.done = np.zeros(slots)          # tokens made in this chunk so far
        self.rate = np.zeros(slots)          # tokens per step (0: free slot)
        self.inv_rate = np.ones(slots)       # 1 / rate (1: free slot)
        self.ctx = np.zeros(slots)           # KV tokens held
        self.seq = np.zeros(slots, dtype=np.int64)     # admission order (preemption victim)
        self.finishes = np.zeros(slots, dtype=bool)    # chunk ends at the request's end
        self._next_seq = 0
        self._free = list(range(slots - 1, -1, -1))    # free slot indices (a stack)
        self.batch, self.kv, self.kv_rate = 0, 0.0, 0.0
        self.clock = 0.0           # the current run started here
        self.n_event = 0           # steps from `clock` to the next event
        self.version = 0           # bumps invalidate queued events
        self._dt_event = 0.0       # time of those steps (computed by plan)
        self._lines_cache: dict[tuple[int, int], list] = {}
        self.busy: list[tuple[float, float, int]] = []   # (start, end, batch) segments

    @property
    def free_slots(self) -> int:
        return self.slots - self.batch

    def _lines(self):
        key = (self.batch, self.batch * (1 + self.draft_tokens))
        lines = self._lines_cache.get(key)
        if lines is None:
            lines = self._lines_cache[key] = self.step_model.lines(*key)
        return lines

    def admit(self, request_id: int, tokens: int, finishes: bool, rate: float, context: int) -> None:
        """Start a chunk of `tokens` new tokens from `context` tokens of KV."""
        s = self._free.pop()
        self.active[s], self.rid[s], self.left[s], self.target[s] = True, request_id, tokens, tokens
        self.done[s], self.rate[s], self.ctx[s], self.finishes[s] = 0.0, rate, context, finishes
        self.inv_rate[s] = 1.0 / rate
        self.seq[s] = self._next_seq
        self._next_seq += 1
        self.batch += 1
        self.kv += context
        self.kv_rate += rate

    def stall(self, seconds: float) -> None:
        """Spend `seconds` without decoding (prefill, KV transfer)."""
        if seconds > 0:
            self.busy.append((self.clock, self.clock + seconds, self.batch))
            self.clock += seconds

    def plan(self) -> float | None:
        """Steps to the next event and its time; None when idle."""
        if self.batch == 0:
            return None
        n_done = math.ceil(float((self.left * self.inv_rate).min()) - _EPS)
        n_kv = math.floor((self.kv_capacity - self.kv) / self.kv_rate + _EPS)
        self.n_event = max(min(n_done, n_kv), 0)
        self._dt_event = run_time(self._lines(), self.kv, self.kv_rate, self.n_event)
        return self.clock + self._dt_event

    def advance(self, n: int) -> None:
        """Run `n` decode steps of the current batch."""
        if n <= 0:
            return
        dt = self._dt_event if n == self.n_event else run_time(self._lines(), self.kv, self.kv_rate, n)
        grow = n * self.rate
        self.left -= grow
        self.done += grow
        self.ctx += grow
        self.kv += n * self.kv_rate
        self.busy.append((self.clock, self.clock + dt, self.batch))
        self.clock += dt
        self.n_event -= n

    def steps_by(self, t: float) -> int:
        """Steps of the current run completed by time `t` (at most the event's)."""
        return steps_within(self._lines(), self.kv, self.kv_rate, t - self.clock, self.n_event)

    def _remove(self, slots: list[int]) -> None:
        for s in slots:
            self.kv -= float(self.ctx[s])
            self.kv_rate -= float(self.rate[s])
        self.active[slots] = False
        self.batch -= len(slots)
        self.left[slots], self.rate[slots], self.inv_rate[slots] = np.inf, 0.0, 1.0
        self._free.extend(slots)
        if self.batch == 0:   # drop float drift
            self.kv, self.kv_rate = 0.0, 0.0

    def finish_event(self) -> tuple[list[tuple[int, int, bool]], list[tuple[int, int]]]:
        """Run to the planned event; return (chunk ends, preemptions) as
        [(request, tokens, finished)] and [(request, tokens generated before preemption)]."""
        self.advance(self.n_event)
        ended = np.flatnonzero(self.left <= _EPS).tolist()
        chunks = [(int(self.rid[s]), int(self.target[s]), bool(self.finishes[s])) for s in ended]
        self._remove(ended)
        preempted = []
        while self.batch > 0 and self.kv + self.kv_rate > self.kv_capacity + _EPS:
            cand = np.flatnonzero(self.active)
            s = cand[np.argmax(self.seq[cand])]
            tokens = min(int(self.done[s] + _EPS), int(self.target[s]) - 1)
            preempted.append((int(self.rid[s]), tokens))
            self._remove([int(s)])
        return chunks, preempted
