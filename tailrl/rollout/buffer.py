"""The global request buffer of divided rollout (Seer): one `BufferEntry` per response.

Every response of a rollout step is one request. Between chunks a request sits in the
buffer (WAITING) with the tokens it has generated so far and the instance that holds its KV
(`location`), so any instance can resume it. The buffer is the single owner of per-request
scheduling state; scheduler policies (``tailrl.rollout.policies``) read it and move requests
through its transitions, the driver (simulator or real pool) reports what happened.

Invariants: ``0 <= generated <= max_tokens``; a RUNNING request has ``instance`` set; a
FINISHED request never runs again; ``location`` is None when no KV exists anywhere
(never started, or dropped by a preemption), else the instance whose memory holds it.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable, Iterator


class EntryStatus(enum.IntEnum):
    WAITING = 0    # in the buffer, schedulable
    RUNNING = 1    # a chunk of it is running on `instance`
    FINISHED = 2   # hit EOS or its max_tokens


@dataclass
class BufferEntry:
    """Scheduling view of one response (no tokens: the engine owns those)."""

    request_id: int
    group_id: int               # GRPO group: the n samples of one prompt in this step
    prompt_id: int | str        # stable across epochs (history is keyed by it)
    prompt_len: int
    max_tokens: int             # the request's original limit on generated tokens
    generated: int = 0          # tokens generated so far, over all chunks
    status: EntryStatus = EntryStatus.WAITING
    location: int | None = None  # instance holding its KV (None: must prefill)
    instance: int | None = None  # instance running the current chunk (RUNNING only)
    chunk_max_tokens: int = 0    # max_tokens of the current / last chunk
    chunks: int = 0              # chunks started
    preemptions: int = 0
    migrations: int = 0          # chunks started on an instance other than `location`

    def __post_init__(self) -> None:
        if self.prompt_len < 0:
            raise ValueError(f"prompt_len must be >= 0, got {self.prompt_len!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens!r}")

    @property
    def remaining(self) -> int:
        """Tokens it may still generate (an upper bound: EOS may come first)."""
        return self.max_tokens - self.generated

    @property
    def context_len(self) -> int:
        """Tokens of KV it needs to resume: prompt plus everything generated."""
        return self.prompt_len + self.generated

    @property
    def finished(self) -> bool:
        return self.status == EntryStatus.FINISHED


class RequestBuffer:
    """All requests of one rollout step, indexed by id and by group."""

    def __init__(self, requests: Iterable[BufferEntry]) -> None:
        self._reqs: dict[int, BufferEntry] = {}
        self._groups: dict[int, list[int]] = {}
        for r in requests:
            if r.request_id in self._reqs:
                raise ValueError(f"request_id {r.request_id} appears twice")
            self._reqs[r.request_id] = r
            self._groups.setdefault(r.group_id, []).append(r.request_id)
        self.num_finished = sum(r.finished for r in self._reqs.values())

    def __len__(self) -> int:
        return len(self._reqs)

    def __iter__(self) -> Iterator[BufferEntry]:
        return iter(self._reqs.values())

    def __getitem__(self, request_id: int) -> BufferEntry:
        return self._reqs[request_id]

    def group(self, group_id: int) -> list[BufferEntry]:
        """Members of a group, in insertion order (the first is the group's probe)."""
        return [self._reqs[i] for i in self._groups[group_id]]

    def group_ids(self) -> list[int]:
        return list(self._groups)

    @property
    def all_finished(self) -> bool:
        return self.num_finished == len(self._reqs)

    # ---- transitions (policies call start; drivers' reports reach complete / preempt) ----
    def start(self, request_id: int, instance: int, max_tokens: int) -> BufferEntry:
        """WAITING -> RUNNING on `instance` for a chunk of at most `max_tokens` tokens."""
        r = self._reqs[request_id]
        if r.status != EntryStatus.WAITING:
            raise ValueError(f"request {request_id} is {r.status.name}, not WAITING")
        if not 1 <= max_tokens <= r.remaining:
            raise ValueError(f"max_tokens must be in [1, {r.remaining}] for request {request_id}, "
                             f"got {max_tokens}")
        if r.location is not None and r.location != instance:
            r.migrations += 1
        r.status, r.instance, r.chunk_max_tokens = EntryStatus.RUNNING, instance, max_tokens
        r.chunks += 1
        return r

    def complete(self, request_id: int, new_tokens: int, finished: bool) -> BufferEntry:
        """RUNNING -> WAITING (chunk boundary, KV stays on the instance) or FINISHED."""
        r = self._running(request_id)
        if not 0 <= new_tokens <= r.chunk_max_tokens:
            raise ValueError(f"new_tokens must be in [0, {r.chunk_max_tokens}], got {new_tokens}")
        r.generated += new_tokens
        if not finished and r.generated == r.max_tokens:
            finished = True  # the length limit ends it whatever the driver says
        if not finished and new_tokens < r.chunk_max_tokens:
            raise ValueError(f"request {request_id} stopped early ({new_tokens} < "
                             f"{r.chunk_max_tokens} tokens) without finishing")
        r.location, r.instance = r.instance, None
        r.status = EntryStatus.FINISHED if finished else EntryStatus.WAITING
        self.num_finished += finished
        return r

    def preempt(self, request_id: int, new_tokens: int) -> BufferEntry:
        """RUNNING -> WAITING with its KV dropped (recompute preemption)."""
        r = self._running(request_id)
        if not 0 <= new_tokens < r.chunk_max_tokens:
            raise ValueError(f"new_tokens must be in [0, {r.chunk_max_tokens}), got {new_tokens}")
        r.generated += new_tokens
        r.status, r.instance, r.location = EntryStatus.WAITING, None, None
        r.preemptions += 1
        return r

    def _running(self, request_id: int) -> BufferEntry:
        r = self._reqs[request_id]
        if r.status != EntryStatus.RUNNING:
            raise ValueError(f"request {request_id} is {r.status.name}, not RUNNING")
        return r
