"""OpenAI response and stream-chunk bodies built from ``ChoiceState``s.

Each choice also carries ``token_ids`` (vLLM's extension): RL clients need the exact tokens,
and text does not round-trip through a tokenizer. The logprob of every token is the target
model's log-probability at the sampling temperature (see DESIGN.md). Asked for N alternatives
(completions ``logprobs`` N, chat ``top_logprobs`` N, up to 20), a token's ``top_logprobs``
hold its N most probable tokens under that distribution (engine/top_logprobs.py): in a
completion a dict of text -> logprob with the sampled token too, as vLLM's; in a chat the N
entries in rank order, as OpenAI's. Without alternatives a completion's dict holds the sampled
token alone and a chat's list is empty.
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


def completion_logprobs(c: ChoiceState, toks: list[int], lps: list[float], offset: int, top: list[dict]) -> dict:
    texts = [c.token_text(t) for t in toks]
    offsets, pos = [], offset
    for t in texts:
        offsets.append(pos)
        pos += len(t)
    alts = [{c.token_text(t): lp for t, (lp, _) in e.items()} for e in top] if top else \
        [{t: lp} for t, lp in zip(texts, lps)]         # (engine entries come in rank order)
    return {"tokens": texts, "token_logprobs": list(lps), "top_logprobs": alts, "text_offset": offsets}


def _chat_entry(c: ChoiceState, tok: int, lp: float) -> dict:
    text = c.token_text(tok)
    return {"token": text, "logprob": lp, "bytes": list(text.encode())}


def chat_logprobs(c: ChoiceState, toks: list[int], lps: list[float], top: list[dict], n: int) -> dict:
    content = []
    for k, (t, lp) in enumerate(zip(toks, lps)):
        ranked = list(top[k].items())[:n] if top else []          # in rank order: the n best
        content.append({**_chat_entry(c, t, lp), "top_logprobs": [_chat_entry(c, a, v) for a, (v, _) in ranked]})
    return {"content": content}


def completion_body(rid: str, model: str, choices: list[ChoiceState], usage: dict, logprobs: bool,
                    echo: bool = False) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [_echoed(c, logprobs) if echo else
                        {"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                         "logprobs": completion_logprobs(c, c.token_ids, c.logprobs, 0, c.top) if logprobs else None,
                         "token_ids": c.token_ids} for c in choices],
            "usage": usage}


def _echoed(c: ChoiceState, logprobs: bool) -> dict:
    """A completion choice with ``echo``: its prompt's text, tokens and (asked for) logprobs before
    its own, the first prompt token's logprob None (nothing predicts it), as vLLM's."""
    prompt = c.decode(c.prompt_ids)
    out = {"index": c.index, "text": prompt + c.text, "finish_reason": c.finish_reason,
           "token_ids": c.prompt_ids + c.token_ids, "logprobs": None}
    if logprobs:
        entries = c.prompt_top or []
        first = c.token_text(c.prompt_ids[0])
        head = completion_logprobs(c, c.prompt_ids[1:], [e[t][0] for e, t in zip(entries, c.prompt_ids[1:])],
                                   len(first), entries)
        tail = completion_logprobs(c, c.token_ids, c.logprobs, len(prompt), c.top)
        out["logprobs"] = {"tokens": [first] + head["tokens"] + tail["tokens"],
                           "token_logprobs": [None] + head["token_logprobs"] + tail["token_logprobs"],
                           "top_logprobs": [None] + head["top_logprobs"] + tail["top_logprobs"],
                           "text_offset": [0] + head["text_offset"] + tail["text_offset"]}
    return out


def chat_body(rid: str, model: str, choices: list[ChoiceState], usage: dict, logprobs: bool, n: int = 0) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                         "finish_reason": c.finish_reason,
                         "logprobs": chat_logprobs(c, c.token_ids, c.logprobs, c.top, n) if logprobs else None,
                         "token_ids": c.token_ids} for c in choices],
            "usage": usage}


def completion_chunk(rid: str, model: str, c: ChoiceState, logprobs: bool) -> dict | None:
    """The chunk streaming what ``c`` gained since its last chunk, or None if nothing to send."""
    offset = c.sent_text
    delta, toks, lps, top = c.take_delta()
    if not delta and not toks and not c.finished:
        return None
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": c.index, "text": delta, "token_ids": toks,
                         "finish_reason": c.finish_reason,
                         "logprobs": completion_logprobs(c, toks, lps, offset, top) if logprobs else None}]}


def chat_chunk(rid: str, model: str, c: ChoiceState, logprobs: bool, first: bool, n: int = 0) -> dict | None:
    delta, toks, lps, top = c.take_delta()
    if not delta and not toks and not c.finished and not first:
        return None
    msg = {"role": "assistant", "content": delta} if first else {"content": delta}
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": c.index, "delta": msg, "token_ids": toks, "finish_reason": c.finish_reason,
                         "logprobs": chat_logprobs(c, toks, lps, top, n) if logprobs else None}]}


def usage_chunk(rid: str, model: str, obj: str, usage: dict) -> dict:
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [], "usage": usage}
