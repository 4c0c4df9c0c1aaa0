"""vLLM's ``stop`` strings: a response ends at the token whose text completes one of them.

The engine knows tokens; a stop string is text. After a row's tokens are committed
(``verify.commit``, and a step launched ahead settling), ``StopStrings.first_end`` looks at the
request's new tokens and returns the index of the first one whose text completes a stop
string. The response keeps that token and its log-probability and ends there, as vLLM's does;
its text is cut before the string (``cut_text``, where the outputs are made). Tokens a verify
step accepted after it are dropped like those after a stop token. The tokens never depend on
drafts, so a response ends at the same token with and without speculation.

Most tokens cannot end a stop string. A token's own text (decoded alone, kept per token id)
must hold a string's last character, or part of a multi-byte character (U+FFFD), or the string
ends in a space (SentencePiece tokenizers drop a token's leading space when it is decoded
alone); only then are the last tokens decoded, a window wide enough for the longest string in
the worst case (4 bytes a character, one byte a token) plus a margin, with and without the
token, and the string searched for where the token's characters begin. Measured on `small`'s
tokenizer (this CPU): 0.2 us a token passed over, ~10 us a token whose window is decoded.
"""
from __future__ import annotations

import os

MARGIN = 8              # window tokens beyond the longest string's worst case


class StopStrings:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._pieces: dict[int, str] = {}          # token id -> its text alone

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _piece(self, tok: int) -> str:
        piece = self._pieces.get(tok)
        if piece is None:
            piece = self._pieces[tok] = self._decode([tok])
        return piece

    def first_end(self, out: list[int], start: int, stops: list[str]) -> int | None:
        """The index of the first token of ``out`` from ``start`` on whose text completes one of
        ``stops`` (searched in the text of the tokens before it too), or None."""
        lasts = {s[-1] for s in stops}
        always = " " in lasts
        width = 4 * max(len(s) for s in stops) + MARGIN
        for j in range(start, len(out)):
            piece = self._piece(out[j])
            if not (always or "\ufffd" in piece or any(c in piece for c in lasts)):
                continue
            lo = max(0, j + 1 - width)
            before, now = self._decode(out[lo:j]), self._decode(out[lo:j + 1])
            fresh = len(os.path.commonprefix([before, now]))      # where token j's characters begin
            if any(now.find(s, max(0, fresh - len(s) + 1)) >= 0 for s in stops):
                return j
        return None


def cut_text(text: str, stops: list[str], keep: bool = False) -> str:
    """A response's text without the stop string that ended it (with it where ``keep``: vLLM's
    ``include_stop_str_in_output``), nor anything after it."""
    hits = [(i, i + len(s)) for i, s in ((text.find(s), s) for s in stops) if i >= 0]
    if not hits:
        return text
    return text[:min(end for _, end in hits)] if keep else text[:min(start for start, _ in hits)]
