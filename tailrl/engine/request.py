"""The one per-request state object. Nothing else keeps per-request state."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tailrl.config import SamplingParams


class RequestStatus(enum.IntEnum):
    # ordered: everything above PREEMPTED is finished
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed_key: int                        # 64-bit key of this request's sampling noise (see sampler.py)
    group_id: str = ""                   # the n samples of one prompt share it
    prompt_id: str = ""                  # stable id of the prompt across calls (RL uid)
    index: int = 0                       # sample index inside the group
    priority: float = 0.0                # expected length (context / history / oracle estimate):
                                         # higher is admitted first and drafted for first
    length_prior: tuple = ()             # lengths its length is drawn from (speculative/critical.py)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    # per output token, {token id: (log-probability, rank)} of its top ``params.logprobs`` and the
    # sampled token, where the request asks (engine/top_logprobs.py); else None
    output_top_logprobs: list[dict[int, tuple[float, int]]] | None = None
    # the same for prompt tokens 1, 2, ... where ``params.prompt_logprobs`` asks (computed by its prefill)
    prompt_top_logprobs: list[dict[int, tuple[float, int]]] | None = None
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0         # tokens whose K/V is in the cache
    row: int = -1                        # cache row while running, else -1
    arrival: int = 0                     # admission order; preemption evicts the newest
    max_model_len: int = 1 << 30
    pending_kv: object = None            # imported K/V waiting for a row (see engine.import_request)
    pending_spec: object = None          # imported drafting state waiting for the speculator's start
    stop_check: object = None            # the engine's StopStrings where params.stop is set
    # its output's distinct tokens and their counts (and its prompt's, counted 0, under a repetition
    # penalty), kept up to date as its output grows (logits_process.py)
    penalty_counts: object = None
    num_preemptions: int = 0
    spec_draft_tokens: int = 0           # draft tokens this request verified,
    spec_accepted_tokens: int = 0        # of them accepted (bonus tokens excluded),
    spec_verify_steps: int = 0           # in this many verify steps
    finish_time: float = 0.0             # perf_counter() when it finished
    # the target's normed hidden state at the position that sampled the last token, and
    # num_tokens when it was kept (kept only when a draft source reads it: the drafter)
    _hidden: object = field(default=None, repr=False)
    _hidden_row: int | None = None
    _hidden_at: int = -1

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def prompt_logprobs_pending(self) -> bool:
        """Whether it asks for prompt logprobs that its prefill has not all given yet (it takes
        no cached prefix then: its positions must be computed; engine/top_logprobs.py)."""
        if self.params.prompt_logprobs is None:
            return False
        return len(self.prompt_top_logprobs or ()) < len(self.prompt_token_ids) - 1

    @property
    def is_decoding(self) -> bool:
        """Caught up: only the last sampled token lacks K/V, so this step samples."""
        return self.num_uncomputed == 1

    @property
    def remaining_tokens(self) -> int:
        """New tokens it may still generate (max_tokens and the context window)."""
        return min(self.params.max_tokens - self.num_output_tokens, self.max_model_len - self.num_tokens)

    def takes_drafts(self) -> bool:
        """``is_decoding`` with room for a draft token besides the one it samples
        (``remaining_tokens > 1``): asked of the rows of a step that drafts, so in one pass."""
        out = len(self.output_token_ids)
        total = len(self.prompt_token_ids) + out
        return total - self.num_computed_tokens == 1 and min(self.params.max_tokens - out,
                                                             self.max_model_len - total) > 1

    def tokens(self, start: int, stop: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        if start >= p:
            return self.output_token_ids[start - p:stop - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - p]

    def keep_hidden(self, hidden, row: int | None = None) -> None:
        """Keep the hidden state that sampled the request's current last token: ``hidden``
        [H], or row ``row`` of ``hidden`` [M, H] (a step's states, read only if a draft asks)."""
        self._hidden, self._hidden_row, self._hidden_at = hidden, row, self.num_tokens

    @property
    def last_hidden(self):
        """The hidden state that sampled the last token, or None when none is current (not
        kept, or the request gained tokens since, e.g. resumed in another engine)."""
        if self._hidden_at != self.num_tokens:
            return None
        return self._hidden if self._hidden_row is None else self._hidden[self._hidden_row]

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)
