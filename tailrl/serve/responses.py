"""OpenAI response and stream-chunk bodies built from ``ChoiceState``s.

Each choice also carries ``token_ids`` (vLLM's extension): RL clients need the exact tokens,
and text does not round-trip through a tokenizer. The logprob of every token is the target
model's log-probability at the sampling temperature (see DESIGN.md); only the sampled token's
logprob exists, so ``top_logprobs`` holds just that token.
"""
from __future__ import annotations

import json
import time
import uuid

from tailrl.serve.choice import ChoiceState


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def completion_logprobs(c: ChoiceState, toks: list[int], lps: list[float], offset: int) -> dict:
    texts = [c.token_text(t) for t in toks]
    offsets, pos = [], offset
    for t in texts:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": texts, "token_logprobs": list(lps), "top_logprobs": [{t: lp} for t, lp in zip(texts, lps)],
            "text_offset": offsets}


def chat_logprobs(c: ChoiceState, toks: list[int], lps: list[float]) -> dict:
    content = []
    for t, lp in zip(toks, lps):
        text = c.token_text(t)
        entry = {"token": text, "logprob": lp, "bytes": list(text.encode())}
        content.append({**entry, "top_logprobs": [entry]})
    return {"content": content}


def completion_body(rid: str, model: str, choices: list[ChoiceState], usage: dict, logprobs: bool) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                         "logprobs": completion_logprobs(c, c.token_ids, c.logprobs, 0) if logprobs else None,
                         "token_ids": c.token_ids} for c in choices],
            "usage": usage}


def chat_body(rid: str, model: str, choices: list[ChoiceState], usage: dict, logprobs: bool) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                         "finish_reason": c.finish_reason,
                         "logprobs": chat_logprobs(c, c.token_ids, c.logprobs) if logprobs else None,
                         "token_ids": c.token_ids} for c in choices],
            "usage": usage}


def completion_chunk(rid: str, model: str, c: ChoiceState, logprobs: bool) -> dict | None:
    """The chunk streaming what ``c`` gained since its last chunk, or None if nothing to send."""
    offset = c.sent_text
    delta, toks, lps = c.take_delta()
    if not delta and not toks and not c.finished:
        return None
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": c.index, "text": delta, "token_ids": toks,
                         "finish_reason": c.finish_reason,
                         "logprobs": completion_logprobs(c, toks, lps, offset) if logprobs else None}]}


def chat_chunk(rid: str, model: str, c: ChoiceState, logprobs: bool, first: bool) -> dict | None:
    delta, toks, lps = c.take_delta()
    if not delta and not toks and not c.finished and not first:
        return None
    msg = {"role": "assistant", "content": delta} if first else {"content": delta}
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": c.index, "delta": msg, "token_ids": toks, "finish_reason": c.finish_reason,
                         "logprobs": chat_logprobs(c, toks, lps) if logprobs else None}]}


def usage_chunk(rid: str, model: str, obj: str, usage: dict) -> dict:
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [], "usage": usage}
