"""What generate returns (vLLM-like)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int                      # sample index inside the group
    text: str                       # decoded output ("" without a tokenizer)
    token_ids: list[int]
    logprobs: list[float]           # target model's log p of each token at the sampling temperature
    finish_reason: str              # "stop" | "length" | "abort"


@dataclass
class RequestOutput:
    request_id: str                 # the group's id
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_id: str                  # stable id (RL uid) used for history
    outputs: list[CompletionOutput] = field(default_factory=list)
