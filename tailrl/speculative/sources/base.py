"""The draft-source protocol and the matching parameters the suffix sources share.

A source keeps whatever index it needs, fed by the engine through four calls:

- ``start(req)``: the request was admitted; ``req.prompt_token_ids`` is known and
  ``req.output_token_ids`` may be non-empty (a resumed chunk of a divided rollout).
- ``observe(req, new_tokens)``: ``new_tokens`` were just appended; ``req.output_token_ids``
  already ends with them.
- ``propose(req, max_tokens, max_paths) -> Draft | None``: a draft continuing the request's
  current context, at most ``max_tokens`` nodes and ``max_paths`` leaves; None when the
  source has no useful match (the engine then decodes plainly unless another source has).
- ``finish(req)``: finished, aborted or handed back to the buffer (it may ``start`` again).

A source may also draft for many requests in one call: ``propose_many(reqs, max_tokens,
max_paths, contexts)`` -> one ``Draft | None`` per request, each what ``propose`` gives
(``max_tokens``: a list, one per request; ``contexts``: each request's ``context_tail`` of at
least its ``max_match_len``). The suffix sources do (one native call for a step's rows).

A source whose ``observe`` does nothing says so with ``observes = False``: the speculator
then skips it for every row of every step. A source may also have ``observe_step()``: called
once for each step's tokens, whichever rows they are (the group source's lazy indexing).

Sources rely only on ``req.request_id``, ``req.group_id``, ``req.prompt_id``,
``req.prompt_token_ids`` and ``req.output_token_ids``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from tailrl.speculative.draft import Draft
from tailrl.speculative.sources.suffix_index import SuffixIndex, propose_many


@runtime_checkable
class DraftSource(Protocol):
    name: str

    def propose(self, req: Any, max_tokens: int, max_paths: int) -> Draft | None: ...

    def observe(self, req: Any, new_tokens: list[int]) -> None: ...

    def start(self, req: Any) -> None: ...

    def finish(self, req: Any) -> None: ...


@dataclass
class MatchParams:
    """How the suffix sources match a context and grow a draft (see ``SuffixIndex``)."""

    min_match_len: int = 2        # a shorter match proposes nothing
    max_match_len: int = 16       # longest context suffix considered
    min_token_prob: float = 0.1   # stop a path when its estimated probability falls below
    max_draft_depth: int = 16     # tokens a draft may reach below the matched suffix
    tokens_per_match: float = 1.0  # draft nodes per matched token (0 = no such limit)

    def __post_init__(self) -> None:
        if not 1 <= self.min_match_len <= self.max_match_len:
            raise ValueError(f"min_match_len must be in [1, max_match_len], got {self.min_match_len}")
        if not 0 <= self.min_token_prob < 1:
            raise ValueError(f"min_token_prob must be in [0, 1), got {self.min_token_prob}")
        if self.max_draft_depth < 1:
            raise ValueError(f"max_draft_depth must be >= 1, got {self.max_draft_depth}")
        if self.tokens_per_match < 0:
            raise ValueError(f"tokens_per_match must be >= 0, got {self.tokens_per_match}")

    def index(self) -> SuffixIndex:
        """An empty index with these matching lengths."""
        return SuffixIndex(self.min_match_len, self.max_match_len)


def propose_from(index: SuffixIndex, req: Any, params: MatchParams, max_tokens: int, max_paths: int,
                 source: str, exclude: int | None = None) -> Draft | None:
    """Match ``req``'s context in ``index`` and grow a draft, as every suffix source does.

    A match of ``m`` tokens drafts at most ``ceil(tokens_per_match * m)`` nodes: a short
    match is weak evidence (on text without repetition, 2-token matches happen by chance),
    so it earns a short draft; long matches earn the full depth.
    """
    p = params
    return index.propose(context_tail(req, p.max_match_len), min(max_tokens, p.max_draft_depth), max_paths,
                         min_token_prob=p.min_token_prob, tokens_per_match=p.tokens_per_match,
                         source=source, exclude=exclude)


def propose_many_from(lookups: list[tuple[SuffixIndex, int | None] | None], contexts: list[list[int]],
                      params: MatchParams, max_tokens: list[int], max_paths: int, source: str) -> list[Draft | None]:
    """``propose_from`` for many requests at once: request ``i`` matches its context
    ``contexts[i]`` (at least its last ``params.max_match_len`` tokens: ``context_tail``) in
    ``lookups[i]`` = (index, excluded sequence), or has no draft where that is None."""
    live = [i for i, lk in enumerate(lookups) if lk is not None]
    out: list[Draft | None] = [None] * len(lookups)
    if live:
        cap = params.max_draft_depth
        drafts = propose_many([lookups[i] for i in live], [contexts[i] for i in live],
                              [min(max_tokens[i], cap) for i in live], max_paths,
                              min_token_prob=params.min_token_prob, tokens_per_match=params.tokens_per_match,
                              source=source)
        for i, d in zip(live, drafts):
            out[i] = d
    return out


def settled(out: list[int]) -> int:
    """How many of the output tokens ``out`` are known: a step launched ahead leaves a
    placeholder (negative) as the last token of a row whose token is still on the device
    (engine/ahead.py); no index may take it in."""
    return len(out) - 1 if out and out[-1] < 0 else len(out)


def context_tail(req: Any, n: int) -> list[int]:
    """The last ``n`` tokens of prompt + output (the prompt's tail fills in for a short output)."""
    out = req.output_token_ids
    if len(out) >= n:
        return out[len(out) - n:]
    need = n - len(out)
    prompt = req.prompt_token_ids
    return list(prompt[max(0, len(prompt) - need):]) + list(out)
