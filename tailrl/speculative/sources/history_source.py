"""``history`` drafts (RhymeRL HistoSpec): the same prompt's responses from the previous epoch.

One suffix index per prompt id over that prompt's responses in the ``HistoryStore``, built
when the prompt's first request starts (so the speculator bills it to indexing, not to the
per-step drafting the policy prices: measured, building inside the first ``propose`` made
drafting look ~10x dearer for a dozen steps), rebuilt when the store's version for the
prompt changes (``record`` replaced it), dropped when the prompt's last live request
finishes (the store keeps the data; the next epoch brings new history anyway).

Each response is stored as ``prompt[-max_match_len:] + response``: at the start of the
output the context is the prompt's tail, which then matches every previous response and
drafts their most common opening.
"""
from __future__ import annotations

import logging
from typing import Any

from tailrl.speculative.draft import Draft
from tailrl.speculative.history import HistoryStore
from tailrl.speculative.sources.base import MatchParams, propose_from, propose_many_from
from tailrl.speculative.sources.suffix_index import SuffixIndex

logger = logging.getLogger(__name__)


class _PromptIndex:
    __slots__ = ("index", "version", "live")

    def __init__(self) -> None:
        self.index: SuffixIndex | None = None
        self.version = -1
        self.live: set[str] = set()


class HistorySource:
    name = "history"
    observes = False            # its observe does nothing (the speculator need not call it)

    def __init__(self, store: HistoryStore, params: MatchParams | None = None) -> None:
        self.store = store
        self.params = params or MatchParams()
        self._prompts: dict[str, _PromptIndex] = {}
        self.builds = 0                     # indexes built (for tests and metrics)

    def __len__(self) -> int:
        return len(self._prompts)

    def start(self, req: Any) -> None:
        if req.prompt_id:
            self._prompts.setdefault(req.prompt_id, _PromptIndex()).live.add(req.request_id)
            self._index(req)

    def observe(self, req: Any, new_tokens: list[int]) -> None:
        pass                                # the history does not change during the epoch

    def _index(self, req: Any) -> SuffixIndex | None:
        pid = req.prompt_id
        if not pid:
            return None
        entry = self._prompts.get(pid)
        if entry is None:                   # propose without start: track it from now on
            self.start(req)
            entry = self._prompts[pid]
        version = self.store.version(pid)
        if version == 0:
            entry.index, entry.version = None, 0
            return None
        if entry.version != version:
            p = self.params
            tail = list(req.prompt_token_ids[max(0, len(req.prompt_token_ids) - p.max_match_len):])
            index = p.index()
            for resp in self.store.get(pid):
                index.add(tail + resp)
            entry.index, entry.version = index, version
            self.builds += 1
            logger.debug("history index for prompt %s: %d responses, %d tokens", pid, len(index), index.num_tokens)
        return entry.index

    def propose(self, req: Any, max_tokens: int, max_paths: int) -> Draft | None:
        index = self._index(req)
        if index is None:
            return None
        return propose_from(index, req, self.params, max_tokens, max_paths, self.name)

    def propose_many(self, reqs: list[Any], max_tokens: list[int], max_paths: int,
                     contexts: list[list[int]]) -> list[Draft | None]:
        lookups = [(ix, None) if (ix := self._index(r)) is not None else None for r in reqs]
        return propose_many_from(lookups, contexts, self.params, max_tokens, max_paths, self.name)

    def finish(self, req: Any) -> None:
        entry = self._prompts.get(req.prompt_id)
        if entry is None:
            return
        entry.live.discard(req.request_id)
        if not entry.live:
            del self._prompts[req.prompt_id]
