"""The scheduler-policy interface shared by the simulator and the real instance pool.

A policy is a plain object with no I/O, no clock of its own and no torch. The driver owns
time and the instances; the policy owns the order of work. The protocol is pull-based:

    policy.reset(buffer, num_instances)               # once per rollout step
    loop:
        for an instance with room:                    # free batch slots and/or KV
            for a in policy.schedule(InstanceView(...), now):
                run request a.request_id for at most a.max_tokens new tokens
        on a chunk's end:  policy.on_chunk_done(request_id, new_tokens, finished, now)
        on a preemption:   policy.on_preempt(request_id, new_tokens, now)
    until buffer.all_finished

Subclasses only decide *which* waiting request an instance gets next (`_pop`) and how long
its chunk is (`_chunk_tokens`); admission against the instance's KV budget, buffer
transitions and reservations live here, once.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

from tailrl.rollout.buffer import BufferEntry, EntryStatus, RequestBuffer

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Assignment:
    """One decision: run this request on the asking instance."""

    request_id: int
    max_tokens: int   # new tokens for this chunk (the engine's SamplingParams.max_tokens)


@dataclass(slots=True)
class InstanceView:
    """What an instance tells the policy when it asks for work."""

    instance: int      # index in [0, num_instances)
    free_slots: int    # how many more requests its batch takes (max_num_seqs - running)
    kv_capacity: int   # KV token slots in all
    kv_used: int       # KV token slots held by its running requests now


@dataclass
class PolicyConfig:
    """Knobs common to the policies (each uses the ones that apply to it)."""

    chunk_tokens: int = 8192       # divided rollout: max new tokens per chunk
    watermark: float = 0.01        # fraction of KV kept free at admission (vLLM's default)
    starvation_s: float = 3600.0   # context: a request waiting longer than this goes first
    outlier_factor: float = 1.5    # history: a request past this x its history migrates

    def __post_init__(self) -> None:
        if not (isinstance(self.chunk_tokens, int) and self.chunk_tokens >= 1):
            raise ValueError(f"chunk_tokens must be an integer >= 1, got {self.chunk_tokens!r}")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark!r}")
        if self.starvation_s <= 0:
            raise ValueError(f"starvation_s must be > 0, got {self.starvation_s!r}")
        if self.outlier_factor < 1:
            raise ValueError(f"outlier_factor must be >= 1, got {self.outlier_factor!r}")


class SchedulerPolicy:
    """Base class: admission, reservations and buffer transitions; subclasses pick."""

    name: ClassVar[str] = "base"
    # True: admit a chunk only if its whole KV growth fits (no preemption, Seer);
    # False: admit on current KV use, growth may force preemptions (vLLM / veRL).
    reserve_chunk: ClassVar[bool] = True
    # True: an instance takes at most its fair share, ceil((running + waiting) / instances),
    # so when work runs short it spreads over the instances instead of piling up on the
    # first to ask (Seer: place by KV location "while load stays balanced").
    balance: ClassVar[bool] = True
    # True: the policy estimates lengths (`_expected_remaining`), so fair shares are shares of
    # expected work rather than of request counts
    ranked: ClassVar[bool] = False

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()
        self.buffer: RequestBuffer | None = None
        self.num_instances = 0

    # ---- the protocol ----
    def reset(self, buffer: RequestBuffer, num_instances: int) -> None:
        if num_instances < 1:
            raise ValueError(f"num_instances must be >= 1, got {num_instances!r}")
        self.buffer, self.num_instances = buffer, num_instances
        self.num_waiting = 0
        self._reserved = [0] * num_instances            # KV reserved per instance
        self._running = [0] * num_instances             # requests running per instance
        self._holds: dict[int, tuple[int, int, int]] = {}     # request -> (instance, reserved, expected work)
        self._work = [0] * num_instances                # expected remaining tokens running per instance
        self._waiting_work: dict[int, int] = {}          # waiting request -> its expected remaining tokens
        self._waiting_sum = 0
        self._tickets: dict[int, int] = {}               # request -> its current queue ticket
        self._lost: set[int] = set()                     # instances gone for the rest of the step
        self._setup()
        for r in self._initial_order():
            if r.status == EntryStatus.WAITING:
                self._add_waiting(r, 0.0)

    def schedule(self, view: InstanceView, now: float) -> list[Assignment]:
        """Requests for `view.instance` to start now, best first, within its free room."""
        buf, i = self._buf(), view.instance
        if self.reserve_chunk:
            budget = view.kv_capacity - self._reserved[i]
        else:
            budget = int(view.kv_capacity * (1 - self.config.watermark)) - view.kv_used
        room, work = view.free_slots, self._work_share(i)
        if self.balance and work is None:
            alive = self.num_instances - len(self._lost)
            share = -(-(len(self._holds) + self.num_waiting) // alive)
            room = min(room, max(share - self._running[i], 1 if self._running[i] == 0 else 0))
        out: list[Assignment] = []
        while len(out) < room and self.num_waiting > 0:
            rid = self._pop(i, now)
            if rid is None:
                break
            r = buf[rid]
            n = max(1, min(self._chunk_tokens(r, i), r.remaining))
            need = r.context_len + (self._growth(r, n) if self.reserve_chunk else 0)
            idle = not out and view.kv_used == 0 and self._reserved[i] == 0
            expected = self._waiting_work.get(rid, 0)
            # past its share when taking it would overshoot more than it fills
            over_share = work is not None and work < expected / 2 and (out or self._running[i] > 0)
            if (need > budget and not idle) or over_share:   # keep the order, wait for room
                self._enqueue(r, now, front=True)
                break
            if work is not None:
                work -= expected
            budget -= need
            self.num_waiting -= 1
            self._waiting_sum -= self._waiting_work.pop(rid, 0)
            self._tickets[rid] = -abs(self._tickets.get(rid, 0))   # its queue entries go stale
            buf.start(rid, i, n)
            self._reserved[i] += need
            self._running[i] += 1
            self._holds[rid] = (i, need, expected)
            self._work[i] += expected
            out.append(Assignment(rid, n))
        return out

    def on_chunk_done(self, request_id: int, new_tokens: int, finished: bool, now: float) -> None:
        """The current chunk of `request_id` ended (EOS, its max_tokens or the request's)."""
        self._release(request_id)
        r = self._buf().complete(request_id, new_tokens, finished)
        self._observe(r, now)
        if not r.finished:
            self._add_waiting(r, now)

    def on_preempt(self, request_id: int, new_tokens: int, now: float) -> None:
        """The instance dropped `request_id`'s KV to make room; it returns to the buffer."""
        self._release(request_id)
        r = self._buf().preempt(request_id, new_tokens)
        self._add_waiting(r, now, front=True)

    def on_instance_lost(self, instance: int) -> None:
        """`instance` is gone for the rest of the step (a real pool's process or actor died):
        fair shares count the survivors only. Its running chunks come back via `on_preempt`."""
        if not 0 <= instance < self.num_instances:
            raise ValueError(f"instance must be in [0, {self.num_instances}), got {instance!r}")
        self._lost.add(instance)
        if len(self._lost) == self.num_instances:
            raise RuntimeError(f"{self.name}: every instance is lost")

    def has_work_for(self, instance: int) -> bool:
        """Whether `instance` could get anything from `schedule` if it had room."""
        return self.num_waiting > 0

    # ---- for subclasses ----
    def _setup(self) -> None:
        """Build the queues (called by reset before requests are enqueued)."""

    def _initial_order(self) -> list[BufferEntry]:
        """The order in which reset() enqueues the step's requests."""
        return list(self._buf())

    def _enqueue(self, r: BufferEntry, now: float, front: bool = False) -> None:
        """Make a WAITING request findable by `_pop` (front: it lost its turn, not its place)."""
        raise NotImplementedError

    def _pop(self, instance: int, now: float) -> int | None:
        """Remove and return the next request for `instance`, or None."""
        raise NotImplementedError

    def _chunk_tokens(self, r: BufferEntry, instance: int) -> int:
        return self.config.chunk_tokens

    def _growth(self, r: BufferEntry, n: int) -> int:
        """KV tokens to reserve for a chunk of at most `n` tokens (the oracle knows better)."""
        return n

    def _observe(self, r: BufferEntry, now: float) -> None:
        """Learn from a finished chunk (context and history estimates)."""

    def _expected_remaining(self, r: BufferEntry) -> int:
        """Expected new tokens `r` still needs (policies with `ranked = True`)."""
        raise NotImplementedError

    def known_lengths(self, r: BufferEntry) -> tuple[int, ...]:
        """Lengths `r`'s own length is expected to be drawn from, as far as this policy knows
        (the engine conditions them on how far `r` has got to find the critical path:
        speculative/critical.py); () when it knows none."""
        return ()

    def _requeue(self, r: BufferEntry, now: float) -> None:
        """Queue a waiting request again after its estimate changed (the old entry goes stale)."""
        self._count_waiting(r)
        self._enqueue(r, now)

    def _work_share(self, instance: int) -> float | None:
        """Expected work `instance` may still take on to reach its fair share of all running
        and waiting work (longest-first list scheduling: the first instance to ask takes the
        longest requests, but only its share of the work, not of the count), or None when
        the policy has no estimates or does not balance."""
        if not (self.balance and self.ranked):
            return None
        alive = self.num_instances - len(self._lost)
        return (self._waiting_sum + sum(self._work)) / alive - self._work[instance]

    def _stamp(self, r: BufferEntry) -> int:
        """A fresh ticket for `r`: queue entries with an older ticket are stale."""
        t = abs(self._tickets.get(r.request_id, 0)) + 1
        self._tickets[r.request_id] = t
        return t

    def _live(self, request_id: int, ticket: int) -> bool:
        """Whether a queue entry is current (lazy deletion: queues keep stale entries).
        A request's ticket is positive while it waits and negated when it starts."""
        return self._tickets.get(request_id) == ticket

    # ---- internals ----
    def _add_waiting(self, r: BufferEntry, now: float, front: bool = False) -> None:
        self.num_waiting += 1
        self._count_waiting(r)
        self._enqueue(r, now, front)

    def _count_waiting(self, r: BufferEntry) -> None:
        """Keep the waiting requests' expected work (`_waiting_sum`) current for `r`."""
        if self.ranked:
            e = self._expected_remaining(r)
            self._waiting_sum += e - self._waiting_work.get(r.request_id, 0)
            self._waiting_work[r.request_id] = e

    def _release(self, request_id: int) -> None:
        i, need, expected = self._holds.pop(request_id)
        self._reserved[i] -= need
        self._work[i] -= expected
        self._running[i] -= 1

    def _buf(self) -> RequestBuffer:
        if self.buffer is None:
            raise RuntimeError(f"{self.name}: call reset(buffer, num_instances) first")
        return self.buffer
