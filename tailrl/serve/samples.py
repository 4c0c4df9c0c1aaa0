"""One sample per call: the token-in, token-out front RL frameworks' rollout servers call.

verl's agent loop and SGLang clients such as slime (``sglang_routes.py``) send every sample as
its own request: ``n`` siblings with the same prompt tokens, each under its own request id, with
no uid or group.
``SampleServer`` rebuilds from the tokens what the engine needs, and runs every call in the
shared ``EngineLoop`` (one continuously batched engine, tailrl's speculation and scheduling):

- prompt id: a digest of the prompt tokens (``default_prompt_id``, as ``LLM.generate`` without
  prompt ids), so a prompt meets its responses of the previous epoch (history drafts);
- group: the prompt's samples within one weight version (``epoch``, advanced by every weight
  update). Sample ``j`` is the ``j``-th call with these tokens in the epoch, or the caller's
  ``index``. Siblings share the group id: they feed each other's group drafts and the engine
  sees them together;
- noise: sample ``j``'s key is ``mix(engine seed, prompt seed, j)`` with prompt seed
  ``prompt_seed(epoch, tokens)`` (or ``SamplingParams.seed``): exactly
  ``LLM(seed=...).generate(tokens, SamplingParams(n=N, seed=prompt_seed(epoch, tokens)))`` for
  samples 0..N-1;
- history: once every sibling of a group has finished, their responses become the prompt's
  history; a sibling whose call comes after the others finished (calls arrive one by one)
  joins it and the history is recorded again, whole; a group cut short by an abort or an
  error records nothing.

Control: ``update_weights`` (applied between two engine steps; a new epoch), ``sleep`` (waits
until nothing runs, then gives back the KV cache's memory), ``abort_all`` (ends running calls
with what they generated and holds, or rejects, new ones) and ``resume``.
"""
from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

from tailrl.config import SamplingParams
from tailrl.engine.inputs import default_prompt_id
from tailrl.engine.request import Request
from tailrl.noise import mix
from tailrl.serve.loop import EngineLoop, Update


def prompt_key(token_ids: list[int]) -> str:
    """The prompt id of a token list (a digest): what groups, history and routing key on."""
    return default_prompt_id(token_ids)


def prompt_seed(epoch: int, token_ids: list[int]) -> int:
    """The prompt seed of ``token_ids`` in weight version ``epoch`` (module docstring)."""
    return mix(epoch, int(prompt_key(token_ids), 16))


@dataclass
class Sample:
    """What one call generated."""

    token_ids: list[int]
    logprobs: list[float]
    aborted: bool
    num_preemptions: int
    spec_draft_tokens: int
    spec_accepted_tokens: int
    spec_verify_steps: int
    finish_reason: str | None = None                # "stop", "length" or "abort"
    top_logprobs: list[dict] | None = None          # per token, its alternatives (SamplingParams.logprobs)
    prompt_top_logprobs: list[dict] | None = None   # per prompt token (SamplingParams.prompt_logprobs)


class SampleGroups:
    """Per-sample calls -> engine requests in groups; when a group's history is due."""

    KEEP = 4096            # groups whose responses are kept after they finished (a late sibling joins them)

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.epoch = 0
        self._issued: dict[str, int] = {}                      # group id -> samples issued
        self._live: dict[str, int] = {}                        # group id -> samples running
        # group id -> responses (None: cut short), the finished groups' least recently finished first
        self._done: OrderedDict[str, list[list[int]] | None] = OrderedDict()
        self._lock = threading.Lock()                          # make: asyncio side; retire: loop thread

    def new_epoch(self) -> None:
        """New weights: the next calls with a prompt form a new group, with new noise."""
        with self._lock:
            self.epoch += 1
            self._issued.clear()

    def make(self, call_id: str, prompt_ids: list[int], params: SamplingParams, index: int | None = None) -> Request:
        pid = prompt_key(prompt_ids)
        with self._lock:
            epoch = self.epoch
            gid = f"s{epoch}-{pid}"
            if index is None:
                index = self._issued.get(gid, 0)
                self._issued[gid] = index + 1
            self._live[gid] = self._live.get(gid, 0) + 1
        seed = params.seed if params.seed is not None else prompt_seed(epoch, prompt_ids)
        return Request(f"{gid}-{index}-{call_id}", list(prompt_ids), params, mix(self.seed, seed, index),
                       group_id=gid, prompt_id=pid, index=index)

    def retire(self, requests: list[Request]) -> list[tuple[str, list[list[int]]]]:
        """Requests that ended (not aborted) -> the (prompt id, responses) pairs to record as
        history: a group's, once none of its siblings runs any more."""
        out = []
        with self._lock:
            for r in requests:
                done = self._done.setdefault(r.group_id, [])
                if done is not None:
                    done.append(list(r.output_token_ids))
                out += self._leave(r)
        return out

    def forget(self, request: Request) -> None:
        """A request that was aborted or failed: its group records nothing this time."""
        with self._lock:
            self._done[request.group_id] = None
            self._leave(request)

    def _leave(self, r: Request) -> list[tuple[str, list[list[int]]]]:
        gid = r.group_id
        self._live[gid] -= 1
        if self._live[gid]:
            return []
        del self._live[gid]
        done = self._done.get(gid)
        if gid in self._done:                # kept: a sibling called after this adds to it
            self._done.move_to_end(gid)
        if len(self._done) > self.KEEP:      # down to half, the least recently finished first
            for old in [g for g in self._done if g not in self._live][:len(self._done) - self.KEEP // 2]:
                del self._done[old]
        return [(r.prompt_id, list(done))] if done else []


class SampleServer:
    """``generate`` one sample per call over ``llm``'s engine; call from one asyncio loop.
    ``loop``: an engine loop to share (the HTTP server's, started by its app), else its own."""

    def __init__(self, llm, loop: EngineLoop | None = None) -> None:
        if llm.engine is None:
            raise ValueError("SampleServer runs one engine: build the LLM without instances / scheduler / "
                             "backend (for more engines, run more servers: verl's replicas)")
        self.llm = llm
        self.groups = SampleGroups(llm.seed)
        self.loop = loop or EngineLoop(llm).start()
        self._gate: asyncio.Event | None = None          # set = admitting (made on the caller's loop)
        self._reject = False
        self._live: dict[str, str] = {}                  # running calls: engine request id -> call id
        self._update: tuple[set[str], bool] | None = None   # a bucketed update: (names written, reopen)

    async def generate(self, call_id: str, prompt_ids: list[int], params: SamplingParams,
                       index: int | None = None) -> Sample:
        """One sample. Bad input raises ``ValueError`` naming the field before anything runs."""
        sample = None
        async for sample in self._run(call_id, prompt_ids, params, index, final_only=True):
            pass
        return sample

    def stream(self, call_id: str, prompt_ids: list[int], params: SamplingParams, index: int | None = None):
        """``generate`` as the sample grows: the sample so far after each engine update that
        added tokens (``finish_reason`` None), then the finished one. Closing it early aborts
        the call (a client that left)."""
        return self._run(call_id, prompt_ids, params, index, final_only=False)

    async def _run(self, call_id: str, prompt_ids: list[int], params: SamplingParams, index: int | None,
                   final_only: bool):
        if not isinstance(call_id, str) or not call_id:
            raise ValueError(f"request_id must be a non-empty string, got {call_id!r}")
        prompt_ids = [int(t) for t in prompt_ids]
        self.llm.inputs.check_tokens(prompt_ids, "prompt_ids")
        params = self.llm.inputs.sampling_params(params, 1)[0]
        if params.n != 1:
            raise ValueError(f"n must be 1 (one sample per call), got {params.n}")
        if not await self._admitted():
            yield Sample([], [], True, 0, 0, 0, 0, "abort")
            return
        req = self.groups.make(call_id, prompt_ids, params, index)     # in the weight version it runs on
        aloop = asyncio.get_running_loop()
        inbox: asyncio.Queue = asyncio.Queue()

        def sink(updates: list[Update]) -> None:                # the engine-loop thread
            aloop.call_soon_threadsafe(inbox.put_nowait, updates)

        toks: list[int] = []
        lps: list[float] = []
        top = prompt_top = finish = error = None
        self._live[req.request_id] = call_id
        try:
            self.loop.submit([req], sink, final_only=final_only, on_retire=self._retire)
            while finish is None:
                for u in await inbox.get():
                    toks += u.token_ids
                    lps += u.logprobs
                    if u.top_logprobs is not None:
                        top = (top or []) + u.top_logprobs
                    prompt_top = u.prompt_top_logprobs or prompt_top
                    finish, error = u.finish_reason, u.error
                if finish is None:
                    yield self._sample(req, toks, lps, None, top, prompt_top)
        finally:
            self._live.pop(req.request_id, None)
            if finish is None:                                  # closed early: nobody reads it
                self.loop.abort([req.request_id])
                self.groups.forget(req)
        if error or finish == "abort":
            self.groups.forget(req)
        if error:
            raise RuntimeError(f"tailrl engine: {error}")
        yield self._sample(req, toks, lps, finish, top, prompt_top)

    @staticmethod
    def _sample(req: Request, toks, lps, finish, top, prompt_top) -> Sample:
        return Sample(list(toks), list(lps), finish == "abort", req.num_preemptions, req.spec_draft_tokens,
                      req.spec_accepted_tokens, req.spec_verify_steps, finish, None if top is None else list(top),
                      prompt_top)

    def _retire(self, requests: list[Request]) -> None:        # the engine-loop thread
        for prompt_id, responses in self.groups.retire(requests):
            self.llm.history.record(prompt_id, responses)

    async def _admitted(self) -> bool:
        gate = self._gate_event()
        if not gate.is_set():
            if self._reject:
                return False
            await gate.wait()
        return True

    def _gate_event(self) -> asyncio.Event:
        if self._gate is None:
            self._gate = asyncio.Event()
            self._gate.set()
        return self._gate

    async def update_weights(self, weights, done: bool = True, complete: bool = True) -> None:
        """New policy weights (Hugging Face names), loaded between two engine steps once running
        requests finished on the old weights (``EngineLoop.update_weights``): a mapping of the
        whole model, or a trainer's buckets, each a list of (name, tensor) pairs with ``done`` on
        the last. The first bucket closes admission (new calls wait, to be grouped in the new
        weight version); the last checks that the buckets wrote every tensor of the model (a
        ValueError naming a missing one otherwise: the weights are then a mix), starts a new
        weight version and opens admission again (if the update closed it). ``complete=False``:
        an update that may hold a part of the model (SGLang's buckets while not paused)."""
        done = done or isinstance(weights, Mapping)
        if self._update is None:
            reopen = self._gate_event().is_set()
            self._update = (set(), reopen)
            if reopen:
                self.hold()
        written, reopen = self._update
        failed = False
        try:
            written |= await asyncio.wrap_future(self.loop.update_weights(weights, done))
        except BaseException:
            failed = done = True                        # a bucket that fails ends the update
            raise
        finally:
            if done:
                self._update = None
                if written or not failed:               # a weight changed: a new weight version
                    self.groups.new_epoch()
                if reopen:
                    await self.resume()
        if done and complete:
            missing = [n for n in self.llm.weight_names() if n not in written]
            if missing:
                raise ValueError(f"weights: the update wrote {len(written)} of the model's tensors and not "
                                 f"{missing[0]!r} (and {len(missing) - 1} more): its weights are now a mix")

    async def abort_all(self, reject: bool = False) -> int:
        """Close admission (new calls wait for ``resume``, or end at once as aborted with
        ``reject``) and end every running call with what it generated. Returns how many."""
        self.hold(reject)
        ids = list(self._live)
        self.loop.abort(ids)
        return len(ids)

    def abort(self, call_ids: set[str]) -> int:
        """End the running calls with these ids with what they generated; returns how many."""
        ids = [rid for rid, call in self._live.items() if call in call_ids]
        self.loop.abort(ids)
        return len(ids)

    @property
    def running(self) -> int:
        """Calls submitted and not yet answered."""
        return len(self._live)

    def hold(self, reject: bool = False) -> None:
        """Close admission: new calls wait for ``resume`` (or end at once as aborted with ``reject``)."""
        self._gate_event().clear()
        self._reject = reject

    async def resume(self) -> None:
        self._reject = False
        self._gate_event().set()

    async def clear_prefixes(self) -> None:
        """Forget the engine's cached prefixes (between two engine steps)."""
        await asyncio.wrap_future(self.loop.call(self.llm.engine.kv.clear_prefixes))

    async def sleep(self) -> None:
        """Wait until nothing runs, then give back the KV cache's memory (it grows on demand)."""
        while self.loop.live_sequences:
            await asyncio.sleep(0.05)
        await asyncio.wrap_future(self.loop.call(self.llm.engine.free_cache))
