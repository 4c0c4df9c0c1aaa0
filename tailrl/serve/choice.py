"""One sequence as the client sees it: tokens, text, text stop strings, and what to stream next.

OpenAI's ``stop`` strings are handled here (the server's engine requests carry stop token ids
only, so a streamed choice can hold back what may start a stop string). After each burst of
accepted tokens the first token whose text completes a stop string is found as
``LLM.generate``'s stop strings find it (``engine/stop_strings.py``: only tokens that could end
one are decoded, with a window of the tokens before them); the text is cut before the string
(the stop string itself is not returned, as in OpenAI), the tokens are kept up to the one that
completed it, and the caller aborts the engine request so its KV is freed.
While streaming, the last ``len(longest stop) - 1`` characters are held back, because they might
be the start of a stop string that the next token completes; so is a trailing U+FFFD, which is
half a multi-byte character.
"""
from __future__ import annotations

from tailrl.engine.stop_strings import StopStrings, cut_text

_checkers: dict[int, StopStrings] = {}      # id(tokenizer) -> its checker (its token texts cached)


def _checker(tokenizer) -> StopStrings:
    c = _checkers.get(id(tokenizer))
    if c is None or c.tokenizer is not tokenizer:
        c = _checkers[id(tokenizer)] = StopStrings(tokenizer)
    return c


class ChoiceState:
    def __init__(self, index: int, tokenizer, stop: list[str] | None = None, incremental: bool = True,
                 min_tokens: int = 0, keep_stop: bool = False, skip_special_tokens: bool = True) -> None:
        self.index = index
        self.min_tokens = min_tokens        # no stop string ends the output before this many tokens
        self.keep_stop = keep_stop          # the stop string stays in the text (vLLM's include_stop_str_in_output)
        self.skip_special_tokens = skip_special_tokens
        self.incremental = incremental      # keep ``text`` current after every update (streaming)
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[dict[int, tuple[float, int]]] = []   # per token, its alternatives (when asked)
        self.prompt_ids: list[int] = []                     # its prompt, and per prompt token after the
        self.prompt_top: list[dict] | None = None           # first its entry (an echo with logprobs)
        self.text = ""
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.sent_text = 0             # characters of ``text`` already streamed
        self.sent_tokens = 0           # tokens already streamed
        self._prefix = self._read = 0  # ``_extend_text``'s window: the last growth's tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) \
            if self.tokenizer is not None else ""

    def token_text(self, tok: int) -> str:
        """How one token is shown in logprobs (a token-id model shows ``token_id:N``, as vLLM)."""
        return self.tokenizer.decode([tok]) if self.tokenizer is not None else f"token_id:{tok}"

    def feed(self, token_ids: list[int], logprobs: list[float], finish_reason: str | None,
             error: str | None = None, top: list[dict] | None = None) -> bool:
        """Take an engine update. Returns True when a stop string ended this choice just now
        (the caller then aborts the engine request)."""
        if self.finished:
            return False                   # e.g. the abort that follows a stop-string match
        n0 = len(self.token_ids)
        self.token_ids += token_ids
        self.logprobs += logprobs
        self.top += top or []
        if self.stop:
            j = _checker(self.tokenizer).first_end(self.token_ids, max(n0, self.min_tokens), self.stop)
            if j is not None:
                del self.token_ids[j + 1:]
                del self.logprobs[j + 1:]
                del self.top[j + 1:]
                self.text = cut_text(self.decode(self.token_ids), self.stop, keep=self.keep_stop)
                self.finish_reason = "stop"
                return True
        if finish_reason is not None:      # the whole text, decoded once
            self.text = self.decode(self.token_ids)
            self.finish_reason, self.error = finish_reason, error
        elif self.incremental:
            self._extend_text()
        return False

    def _extend_text(self) -> None:
        """Grow ``text`` by the new tokens' characters, decoding them with the tokens of the last
        growth before them (a window, not the whole text: streaming a long response stays
        linear); a window whose text ends in U+FFFD (half a multi-byte character) waits for
        the tokens that complete it."""
        ids = self.token_ids
        before, now = self.decode(ids[self._prefix:self._read]), self.decode(ids[self._prefix:])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.text += now[len(before):]
            self._prefix, self._read = self._read, len(ids)

    def take_delta(self) -> tuple[str, list[int], list[float], list[dict]]:
        """Text, tokens, logprobs and alternatives not streamed yet (text held back as the module
        docstring says)."""
        end = len(self.text)
        if not self.finished:
            if self.stop:
                end -= max(len(s) for s in self.stop) - 1
            while end > self.sent_text and self.text[end - 1] == "\ufffd":
                end -= 1
        end = max(end, self.sent_text)
        delta = self.text[self.sent_text:end]
        toks, lps = self.token_ids[self.sent_tokens:], self.logprobs[self.sent_tokens:]
        top = self.top[self.sent_tokens:]
        self.sent_text, self.sent_tokens = end, len(self.token_ids)
        return delta, toks, lps, top
