"""A request's portable state: enough to resume it in another engine instance unchanged.

Sampling noise is keyed by the request's seed key and output position only, and the K/V of its
computed tokens travels with it, so a resumed request emits exactly the tokens it would have.
Its drafts too: the target's hidden state at its draft root (``hidden``) and what the
speculator's drafts depend on (``speculation``: the learned drafter's past, a carried chain)
travel with it, so the importing instance drafts for it as the exporting one would have
(drafts never change outputs; without them it would draft worse until it caught up).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
    hidden: torch.Tensor | None = None   # [H]: the target's state that sampled the last token (drafter's root)
    speculation: dict[str, Any] | None = None   # ``Speculator.export_state``: drafter past, carried chain
    top_logprobs: list[dict] | None = None      # ``Request.output_top_logprobs`` (top_logprobs.py)
    prompt_top_logprobs: list[dict] | None = None   # ``Request.prompt_top_logprobs``

    @property
    def kv_bytes(self) -> int:
        return 0 if self.kv is None else self.kv.numel() * self.kv.element_size()

    @property
    def spec_bytes(self) -> int:
        """Bytes of the drafting state carried besides the K/V (root state, drafter past)."""
        past = (self.speculation or {}).get("sources", {}).get("drafter")
        return (0 if self.hidden is None else self.hidden.numel() * self.hidden.element_size()) + (
            past.nbytes if past is not None else 0)

    @classmethod
    def from_request(cls, req: Request, kv: torch.Tensor | None,
                     speculation: dict[str, Any] | None = None) -> "RequestState":
        hidden = req.last_hidden
        # a host copy: the kept state is a row of a step's tensor, which a view would pickle
        # whole, on the exporter's device (the importer's drafter moves it to its own)
        return cls(req.request_id, list(req.prompt_token_ids), list(req.output_token_ids),
                   list(req.output_logprobs), req.params, req.seed_key, req.group_id, req.prompt_id,
                   req.index, kv, None if hidden is None else hidden.to("cpu", copy=True), speculation,
                   None if req.output_top_logprobs is None else list(req.output_top_logprobs),
                   None if req.prompt_top_logprobs is None else list(req.prompt_top_logprobs))

    def to_request(self) -> Request:
        req = Request(self.request_id, list(self.prompt_token_ids), self.params, self.seed_key,
                      group_id=self.group_id, prompt_id=self.prompt_id, index=self.index,
                      output_token_ids=list(self.output_token_ids),
                      output_logprobs=list(self.output_logprobs), status=RequestStatus.WAITING,
                      output_top_logprobs=None if self.top_logprobs is None else list(self.top_logprobs),
                      prompt_top_logprobs=None if self.prompt_top_logprobs is None else list(self.prompt_top_logprobs),
                      pending_kv=self.kv, pending_spec=self.speculation)
        if self.hidden is not None:
            req.keep_hidden(self.hidden)
        return req
