"""Discrete-event simulation of a rollout step on N instances, driven by a scheduler policy.

The policy objects are the ones the real pool uses (``tailrl.rollout.policies``); the
simulator plays the instances. Events are per instance: the next chunk end or KV overflow
of its current batch (``SimInstance.plan``). At an event the instance reports chunk ends and
preemptions to the policy and asks it for work for its free room. Instances that had run
dry (free room, nothing for them at their last ask) pull first, least loaded first, and join
at their next step boundary: that is how a pull-based pool balances load in the tail.

Costs besides decode steps: a request without KV anywhere is prefilled (prompt + tokens
generated so far); a request resuming on another instance than the one holding its KV
moves it over the link (``context x kv_bytes_per_token / link_bw``). Both stall the
receiving instance (conservative: real engines overlap part of it). A request resuming on
the instance that holds its KV (in its host-memory KV pool, as Seer's global KV cache does)
resumes for free.
"""
from __future__ import annotations

import heapq
import itertools
import logging
from dataclasses import dataclass

import numpy as np

from tailrl.rollout.buffer import BufferEntry, RequestBuffer
from tailrl.rollout.policies import InstanceView, SchedulerPolicy
from tailrl.sim.instance import SimInstance
from tailrl.sim.metrics import SimResult
from tailrl.sim.step_model import StepModel
from tailrl.sim.workload import Trace

log = logging.getLogger(__name__)


@dataclass
class SimConfig:
    instances: int = 16
    max_num_seqs: int = 256           # batch slots per instance
    kv_capacity: int = 1_000_000      # KV token slots per instance
    kv_bytes_per_token: int = 327_680  # what a migrated token's KV weighs
    link_bw: float = 200e9            # bytes/s into an instance (8 x 200 Gb/s RDMA NICs)
    draft_tokens: int = 0             # speculative tokens verified per request-step (0: off)
    accept_mean: float = 1.0          # mean tokens per step per request with speculation
    accept_std: float = 0.0           # spread of the per-request mean across requests
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("instances", "max_num_seqs", "kv_capacity", "kv_bytes_per_token"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.link_bw <= 0:
            raise ValueError(f"link_bw must be > 0, got {self.link_bw!r}")
        if self.draft_tokens < 0:
            raise ValueError(f"draft_tokens must be >= 0, got {self.draft_tokens!r}")
        if not 1 <= self.accept_mean <= 1 + self.draft_tokens:
            raise ValueError(f"accept_mean must be in [1, 1 + draft_tokens], got {self.accept_mean!r}")
        if self.accept_std < 0:
            raise ValueError(f"accept_std must be >= 0, got {self.accept_std!r}")


def _rates(trace: Trace, cfg: SimConfig) -> np.ndarray:
    """Tokens per step per request: the trace's accepted lengths, else drawn from cfg."""
    if cfg.draft_tokens == 0:
        return np.ones(len(trace))
    if trace.accept_len is not None:
        return np.clip(trace.accept_len.astype(float), 1.0, 1.0 + cfg.draft_tokens)
    rng = np.random.default_rng(cfg.seed + 1)
    draw = cfg.accept_mean + cfg.accept_std * rng.standard_normal(len(trace))
    return np.clip(draw, 1.0, 1.0 + cfg.draft_tokens)


def make_buffer(trace: Trace) -> RequestBuffer:
    return RequestBuffer(BufferEntry(i, int(g), int(p), int(pl), int(mt)) for i, (g, p, pl, mt) in
                         enumerate(zip(trace.group_id.tolist(), trace.prompt_id.tolist(),
                                       trace.prompt_len.tolist(), trace.max_tokens.tolist())))


def simulate(trace: Trace, policy: SchedulerPolicy, cfg: SimConfig, step_model: StepModel) -> SimResult:
    return _Run(trace, policy, cfg, step_model).run()


class _Run:
    def __init__(self, trace: Trace, policy: SchedulerPolicy, cfg: SimConfig, step_model: StepModel):
        need = int((trace.prompt_len + trace.max_tokens).max()) + cfg.draft_tokens + 1
        if need > cfg.kv_capacity:
            raise ValueError(f"kv_capacity ({cfg.kv_capacity}) must hold the longest request ({need} tokens)")
        self.trace, self.policy, self.cfg = trace, policy, cfg
        self.length = trace.length.tolist()
        self.rates = _rates(trace, cfg).tolist()
        self.buffer = make_buffer(trace)
        self.insts = [SimInstance(i, cfg.max_num_seqs, cfg.kv_capacity, step_model, cfg.draft_tokens)
                      for i in range(cfg.instances)]
        self.heap: list[tuple[float, int, int, int]] = []
        self.tick = itertools.count()
        self.hungry: set[int] = set()
        self.finish_time = np.zeros(len(trace))
        self.migrated_bytes = 0.0
        self.prefill_tokens = 0
        self.events = 0

    def run(self) -> SimResult:
        self.policy.reset(self.buffer, self.cfg.instances)
        for inst in self.insts:
            self._fill(inst, 0.0)
        while not self.buffer.all_finished:
            if not self.heap:
                raise RuntimeError(f"{self.policy.name}: no instance has work but "
                                   f"{len(self.buffer) - self.buffer.num_finished} requests are unfinished")
            t, _, i, version = heapq.heappop(self.heap)
            inst = self.insts[i]
            if version != inst.version:
                continue
            self.events += 1
            chunks, preempted = inst.finish_event()
            for rid, tokens, finished in chunks:
                self.policy.on_chunk_done(rid, tokens, finished, t)
                if finished:
                    self.finish_time[rid] = t
            for rid, tokens in preempted:
                self.policy.on_preempt(rid, tokens, t)
            if self.hungry and self.policy.num_waiting > 0:
                self._wake(t, skip=i)   # instances that ran dry pull first: load balance
            self._fill(inst, t)
        return SimResult.collect(self)

    def _fill(self, inst: SimInstance, now: float) -> None:
        """Ask the policy for work for `inst`, admit it, and queue its next event."""
        inst.clock = max(inst.clock, now)
        policy, i = self.policy, inst.index
        got = []
        if inst.free_slots > 0 and policy.has_work_for(i):
            view = InstanceView(i, inst.free_slots, self.cfg.kv_capacity, int(inst.kv))
            got = policy.schedule(view, now)
        stall, prefill = 0.0, []
        for a in got:
            r = self.buffer[a.request_id]
            # the buffer already moved it to RUNNING; `location` is where its KV was
            if r.location is None:
                prefill.append(r.context_len)
            elif r.location != i:
                nbytes = r.context_len * self.cfg.kv_bytes_per_token
                self.migrated_bytes += nbytes
                stall += nbytes / self.cfg.link_bw
            tokens = min(a.max_tokens, self.length[a.request_id] - r.generated)
            inst.admit(a.request_id, tokens, r.generated + tokens >= self.length[a.request_id],
                       self.rates[a.request_id], r.context_len)
        if prefill:
            stall += inst.step_model.prefill_time(prefill, int(inst.kv))
            self.prefill_tokens += sum(prefill)
        inst.stall(stall)
        if inst.free_slots > 0 and not policy.has_work_for(i):
            self.hungry.add(i)
        else:
            self.hungry.discard(i)
        t_next = inst.plan()
        inst.version += 1
        if t_next is not None:
            heapq.heappush(self.heap, (t_next, next(self.tick), i, inst.version))

    def _wake(self, now: float, skip: int) -> None:
        """Let instances that ran dry take the work that just returned to the buffer."""
        for j in sorted(self.hungry, key=lambda j: (self.insts[j].batch, j)):
            if self.policy.num_waiting == 0:
                return
            inst = self.insts[j]
            if j == skip or not self.policy.has_work_for(j):
                continue
            if inst.batch > 0:
                n = inst.steps_by(now) + 1      # join at the next step boundary
                if n >= inst.n_event:
                    continue                     # its own event comes first; it pulls then
                inst.advance(n)
            self._fill(inst, now)
