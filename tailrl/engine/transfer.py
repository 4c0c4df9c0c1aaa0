"""A request's portable state: enough to resume it in another engine instance unchanged.

Sampling noise is keyed by the request's seed key and output position only, and the K/V of its
computed tokens travels with it, so a resumed request emits exactly the tokens it would have.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tailrl.config import SamplingParams
from tailrl.engine.request import Request, RequestStatus


@dataclass
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    output_logprobs: list[float]
    params: SamplingParams
    seed_key: int
    group_id: str
    prompt_id: str
    index: int
    kv: torch.Tensor | None          # [L, 2, KV, n, D]: K/V of the first n tokens (None = recompute)

    @property
    def kv_bytes(self) -> int:
        return 0 if self.kv is None else self.kv.numel() * self.kv.element_size()

    @classmethod
    def from_request(cls, req: Request, kv: torch.Tensor | None) -> "RequestState":
        return cls(req.request_id, list(req.prompt_token_ids), list(req.output_token_ids),
                   list(req.output_logprobs), req.params, req.seed_key, req.group_id, req.prompt_id,
                   req.index, kv)

    def to_request(self) -> Request:
        return Request(self.request_id, list(self.prompt_token_ids), self.params, self.seed_key,
                       group_id=self.group_id, prompt_id=self.prompt_id, index=self.index,
                       output_token_ids=list(self.output_token_ids),
                       output_logprobs=list(self.output_logprobs), status=RequestStatus.WAITING,
                       pending_kv=self.kv)
