"""``self`` drafts: the request's own prompt and output (prompt-lookup / self-repetition).

One suffix index per live request over ``prompt + output`` as a single sequence, so matches
may span the prompt/output boundary (early output often copies the prompt). The suffix that
ends at the live end is in the index but has no continuation, so it never matches itself.
Tokens are synced from ``req.output_token_ids`` (``observe``'s ``new_tokens`` are only a
hint), so a missed or repeated ``observe`` cannot desynchronise the index. ``observe`` of a
request that is not live (e.g. the engine reporting its last tokens after ``finish``) is
ignored; ``propose`` of an unknown request starts it.
"""
from __future__ import annotations

from typing import Any

from tailrl.speculative.draft import Draft
from tailrl.speculative.sources.base import MatchParams, propose_from, propose_many_from, settled
from tailrl.speculative.sources.suffix_index import SuffixIndex


class _Entry:
    __slots__ = ("index", "inserted")

    def __init__(self, index: SuffixIndex, inserted: int) -> None:
        self.index = index
        self.inserted = inserted       # output tokens already in the index


class SelfSource:
    name = "self"
    observes = False            # its observe does nothing (the speculator need not call it)

    def __init__(self, params: MatchParams | None = None) -> None:
        self.params = params or MatchParams()
        self._entries: dict[str, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def start(self, req: Any) -> None:
        """Lazy: the index is built on the first ``propose``."""

    def _build(self, req: Any) -> None:
        index = self.params.index()
        n = settled(req.output_token_ids)
        index.add(list(req.prompt_token_ids) + list(req.output_token_ids[:n]))
        self._entries[req.request_id] = _Entry(index, n)

    def _sync(self, req: Any) -> _Entry:
        e = self._entries.get(req.request_id)
        if e is None:
            self._build(req)
            return self._entries[req.request_id]
        out = req.output_token_ids
        n = settled(out)
        if n > e.inserted:
            e.index.extend(0, out[e.inserted:n])
            e.inserted = n
        return e

    def observe(self, req: Any, new_tokens: list[int]) -> None:
        """Nothing to do: ``propose`` catches the request's index up with its tokens (lazy:
        a request never asked for a draft is never indexed)."""

    def propose(self, req: Any, max_tokens: int, max_paths: int) -> Draft | None:
        e = self._sync(req)
        return propose_from(e.index, req, self.params, max_tokens, max_paths, self.name)

    def propose_many(self, reqs: list[Any], max_tokens: list[int], max_paths: int,
                     contexts: list[list[int]]) -> list[Draft | None]:
        return propose_many_from([(self._sync(r).index, None) for r in reqs], contexts, self.params, max_tokens,
                                 max_paths, self.name)

    def finish(self, req: Any) -> None:
        self._entries.pop(req.request_id, None)
