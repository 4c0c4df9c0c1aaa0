"""From a validated HTTP request to engine requests, and the engine's updates back to choices.

``GenerationRun`` is the per-HTTP-request side of the engine loop: it submits one group per
prompt (so the ``n`` samples are siblings for group drafts, under the caller's ``prompt_id``
for history drafts), turns the loop thread's updates into ``ChoiceState`` changes on the
asyncio side, aborts a choice whose stop string matched, and ``close`` aborts whatever is
still running: a client that disconnects frees its KV.
"""
from __future__ import annotations

import asyncio
import itertools

from tailrl.config import SamplingParams
from tailrl.serve.choice import ChoiceState
from tailrl.serve.config import ServeConfig
from tailrl.serve.errors import APIError
from tailrl.serve.loop import EngineLoop, Update

_calls = itertools.count(1)


def sampling_params(req, max_tokens: int, cfg: ServeConfig, inputs, alternatives: int = 0,
                    prompt: int | None = None) -> SamplingParams:
    """Engine ``SamplingParams`` from a request, with the server's limits; a 400 names the field.
    ``alternatives``: the top logprobs asked per token (0: the sampled token's only); ``prompt``:
    those asked per prompt token (an echo with logprobs), None for none."""
    if not 1 <= req.n <= cfg.max_n:
        raise APIError(400, f"field 'n' must be in [1, {cfg.max_n}], got {req.n}", param="n")
    if not 1 <= max_tokens <= cfg.max_tokens_limit:
        raise APIError(400, f"field 'max_tokens' must be in [1, {cfg.max_tokens_limit}], got {max_tokens}",
                       param="max_tokens")
    bad = req.unsupported()
    if bad:
        raise APIError(400, f"field '{bad}' is not supported by this server", param=bad)
    stops = req.stop_list()
    if len(stops) > cfg.max_stop_strings:
        raise APIError(400, f"field 'stop' has more than {cfg.max_stop_strings} strings", param="stop")
    if stops and inputs.tokenizer is None:
        raise APIError(400, "field 'stop' needs a tokenizer; this model has none (use stop_token_ids)", param="stop")
    try:
        params = SamplingParams(n=req.n, temperature=float(req.temperature), top_p=float(req.top_p),
                                top_k=req.top_k, max_tokens=max_tokens, seed=req.seed,
                                stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
                                presence_penalty=float(req.presence_penalty),
                                frequency_penalty=float(req.frequency_penalty),
                                repetition_penalty=float(req.repetition_penalty), min_p=float(req.min_p),
                                min_tokens=req.min_tokens, include_stop_str_in_output=req.include_stop_str_in_output,
                                skip_special_tokens=req.skip_special_tokens, logprobs=alternatives or None,
                                prompt_logprobs=prompt)
        return inputs.sampling_params(params, 1)[0]
    except ValueError as e:
        field = str(e).split(" ", 1)[0]
        raise APIError(400, str(e), param=field) from None


def make_groups(inputs, token_lists: list[list[int]], params: SamplingParams, prompt_ids) -> list[list]:
    """One group per prompt. With ``seed`` s every prompt uses prompt seed s, exactly as
    ``LLM.generate(prompts, SamplingParams(seed=s))``, so the tokens match it."""
    try:
        pids = inputs.prompt_ids(prompt_ids, token_lists)
    except ValueError as e:
        raise APIError(400, str(e).replace("prompt_ids", "field 'prompt_id'"), param="prompt_id") from None
    call = next(_calls)
    groups = []
    for i, toks in enumerate(token_lists):
        groups.append(inputs.group(f"srv{call}-{i}", toks, params, pids[i], inputs.prompt_seed(params, call, i)))
    return groups


class GenerationRun:
    """The groups of one HTTP request, followed from the asyncio side."""

    def __init__(self, loop: EngineLoop, groups: list[list], tokenizer, stop: list[str], stream: bool) -> None:
        self._aloop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._loop = loop
        self.requests = [r for g in groups for r in g]
        self.choices = [ChoiceState(i, tokenizer, stop, incremental=stream, min_tokens=r.params.min_tokens,
                                    keep_stop=r.params.include_stop_str_in_output,
                                    skip_special_tokens=r.params.skip_special_tokens)
                        for i, r in enumerate(self.requests)]
        for r, c in zip(self.requests, self.choices):
            c.prompt_ids = r.prompt_token_ids
        self._by_id = {r.request_id: c for r, c in zip(self.requests, self.choices)}
        for g in groups:
            loop.submit(g, self._sink, final_only=not stream and not stop)

    def _sink(self, updates: list[Update]) -> None:
        """Called in the engine-loop thread: hop onto the event loop."""
        try:
            self._aloop.call_soon_threadsafe(self._queue.put_nowait, updates)
        except RuntimeError:               # the event loop is gone (shutdown): nobody is listening
            pass

    @property
    def done(self) -> bool:
        return all(c.finished for c in self.choices)

    @property
    def error(self) -> str | None:
        return next((c.error for c in self.choices if c.error), None)

    async def next(self, timeout: float | None = None) -> list[ChoiceState]:
        """Wait for the next update; returns the choices it changed (raises TimeoutError)."""
        updates = await asyncio.wait_for(self._queue.get(), timeout)
        changed: dict[int, ChoiceState] = {}
        stopped = []
        for u in updates:
            c = self._by_id[u.request_id]
            if u.prompt_top_logprobs is not None:
                c.prompt_top = u.prompt_top_logprobs
            if c.feed(u.token_ids, u.logprobs, u.finish_reason, u.error, u.top_logprobs):
                stopped.append(u.request_id)
            changed[c.index] = c
        self._loop.abort(stopped)
        return list(changed.values())

    async def wait(self, request) -> None:
        """Until every choice finished. A client that disconnects ends the wait (``close`` then
        aborts): the ASGI ``receive`` blocks until ``http.disconnect`` once the body is read, so
        this watches without polling (polling 200 waiting requests costs the engine thread the GIL)."""
        async def finished():
            while not self.done:
                await self.next()

        async def gone():
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work, watch = asyncio.ensure_future(finished()), asyncio.ensure_future(gone())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
        if not work.done() or work.cancelled():
            raise ConnectionError("client disconnected")
        work.result()                                  # re-raise an error from finished(), if any

    def close(self) -> None:
        self._loop.abort([r.request_id for r, c in zip(self.requests, self.choices) if not c.finished])

    def usage(self) -> dict:
        prompt = sum(len(g) for g in {r.group_id: r.prompt_token_ids for r in self.requests}.values())
        completion = sum(len(c.token_ids) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
