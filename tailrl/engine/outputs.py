"""What generate returns (vLLM-like)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Logprob:
    """One alternative of an output token (vLLM's ``Logprob``)."""
    logprob: float                  # under the distribution ``CompletionOutput.logprobs`` reports
    rank: int                       # 1 = the most probable (ties: the lower token id first)
    decoded_token: str | None = None   # its text (None without a tokenizer or with detokenize=False)


@dataclass
class CompletionOutput:
    index: int                      # sample index inside the group
    text: str                       # decoded output ("" without a tokenizer)
    token_ids: list[int]
    logprobs: list[float]           # target model's log p of each token at the sampling temperature
    finish_reason: str              # "stop" | "length" | "abort"
    # with SamplingParams.logprobs = N >= 1: per token, {token id: Logprob} of its N most probable
    # tokens and the sampled one (engine/top_logprobs.py); else None
    top_logprobs: list[dict[int, Logprob]] | None = None


@dataclass
class RequestOutput:
    request_id: str                 # the group's id
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_id: str                  # stable id (RL uid) used for history
    outputs: list[CompletionOutput] = field(default_factory=list)
    # with SamplingParams.prompt_logprobs = N: per prompt token, None for the first, then {token id:
    # Logprob} of that token and its position's N most probable (vLLM's); else None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
