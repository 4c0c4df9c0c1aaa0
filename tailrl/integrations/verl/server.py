"""One tailrl rollout server of a verl replica: the body of its Ray actor.

verl's ``LLMServerClient`` calls ``generate(prompt_ids, sampling_params, request_id)`` once per
sample, hundreds at a time, on the server's asyncio loop. Each call becomes one engine request
(``VerlRequests``: prompt id, group, noise) submitted to the ``EngineLoop`` thread, which runs
every live request in one continuously batched engine, with tailrl's speculation and
scheduling; the call returns verl's ``TokenOutput`` (tokens, the target's log-probabilities,
per-request speculation counters under verl's keys). The same engine answers OpenAI requests
on ``server_address`` (tailrl's server), for agent loops that talk HTTP.

Control methods (verl's replica calls them on every server): ``update_weights`` (named
tensors from the trainer, through Ray's object store, no disk; applied between two engine
steps; starts a new epoch of groups and noise), ``sleep`` (waits until nothing runs, then
gives back the KV cache's memory for the trainer), ``wake_up``, ``abort_all_requests`` (ends
running requests with what they generated, ``stop_reason="aborted"``, and holds or rejects new
ones) and ``resume_generation``.
"""
from __future__ import annotations

import asyncio
import logging
import socket

from tailrl.integrations.verl.requests import VerlRequests
from tailrl.serve.loop import EngineLoop, Update

log = logging.getLogger(__name__)


def engine_kwargs(config) -> dict:
    """``LLM`` keyword arguments from verl's ``RolloutConfig``: dtype, seed, the context
    (``max_model_len``, else prompt + response length) and batch size; anything under
    ``engine_kwargs.tailrl`` (``speculative``, ``num_threads``, ...) on top."""
    kwargs = dict(dtype=config.dtype, seed=config.seed, max_num_seqs=config.max_num_seqs,
                  max_model_len=config.max_model_len or config.prompt_length + config.response_length)
    extra = (config.engine_kwargs or {}).get("tailrl") or {}
    return {**kwargs, **dict(extra)}


class TailRLServer:
    """Made a Ray actor by ``TailRLReplica``; usable in-process too (tests)."""

    def __init__(self, config, model_config, replica_rank: int = 0, http: bool = True) -> None:
        from verl.utils.config import omega_conf_to_dataclass
        from tailrl.llm import LLM
        self.config = omega_conf_to_dataclass(config)
        self.model_config = omega_conf_to_dataclass(model_config)
        self.replica_rank = replica_rank
        path = self.model_config.local_path or self.model_config.path
        self.llm = LLM(path, **engine_kwargs(self.config))
        self.requests = VerlRequests(self.llm.inputs, self.config.prompt_length, self.config.response_length,
                                     self.config.ignore_eos)
        self.loop = EngineLoop(self.llm, on_retire=self._retire).start()
        self.global_steps: int | None = None
        self._gate: asyncio.Event | None = None          # set = admitting; made on the actor's loop
        self._reject = False
        self._live: dict[str, object] = {}
        self._http = http
        self._address: tuple[str, int] | None = None
        self._http_task = None

    # ---- generation -------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], sampling_params: dict, request_id: str,
                       image_data=None, video_data=None, audio_data=None, mm_processor_kwargs=None,
                       priority: int = 0, **unused):
        from verl.workers.rollout.replica import TokenOutput
        if image_data or video_data or audio_data:
            raise ValueError("tailrl serves text models: image_data, video_data and audio_data must be empty")
        req, want_logprobs = self.requests.make(request_id, prompt_ids, sampling_params)
        if not await self._admitted():
            self.requests.forget(req)
            return TokenOutput(token_ids=[], log_probs=[] if want_logprobs else None, stop_reason="aborted",
                               extra_fields={"global_steps": self.global_steps})
        aloop = asyncio.get_running_loop()
        done: asyncio.Future = aloop.create_future()

        def sink(updates: list[Update]) -> None:                # the engine-loop thread
            aloop.call_soon_threadsafe(lambda: done.done() or done.set_result(updates[-1]))

        self._live[req.request_id] = req
        try:
            self.loop.submit([req], sink, final_only=True)
            u: Update = await done
        finally:
            self._live.pop(req.request_id, None)
        if u.error or u.finish_reason == "abort":
            self.requests.forget(req)
        if u.error:
            raise RuntimeError(f"tailrl engine: {u.error}")
        return TokenOutput(
            token_ids=list(u.token_ids), log_probs=list(u.logprobs) if want_logprobs else None,
            stop_reason="aborted" if u.finish_reason == "abort" else "completed",
            num_preempted=req.num_preemptions,
            extra_fields={"global_steps": self.global_steps, "spec_num_draft_tokens": req.spec_draft_tokens,
                          "spec_num_accepted_tokens": req.spec_accepted_tokens,
                          "spec_num_verify_steps": req.spec_verify_steps})

    def _retire(self, requests) -> None:                       # the engine-loop thread
        for prompt_id, responses in self.requests.retire(requests):
            self.llm.history.record(prompt_id, responses)

    async def _admitted(self) -> bool:
        if self._gate is None:
            self._gate = asyncio.Event()
            self._gate.set()
        if not self._gate.is_set():
            if self._reject:
                return False
            await self._gate.wait()
        return True

    # ---- control ----------------------------------------------------------------------------
    async def update_weights(self, state_dict: dict, global_steps: int | None = None) -> None:
        """New policy weights (Hugging Face names); applied between two engine steps."""
        await asyncio.wrap_future(self.loop.call(lambda: self.llm.load_weights(state_dict)))
        self.requests.new_epoch()
        if global_steps is not None:
            self.global_steps = global_steps

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    async def abort_all_requests(self, reject_request: bool = False, **unused) -> dict:
        """Close admission (new calls wait for ``resume_generation``, or end at once as aborted
        with ``reject_request``) and end every running request with what it generated."""
        if self._gate is None:
            self._gate = asyncio.Event()
        self._gate.clear()
        self._reject = reject_request
        ids = list(self._live)
        self.loop.abort(ids)
        return {"aborted": len(ids)}

    async def resume_generation(self) -> None:
        if self._gate is None:
            self._gate = asyncio.Event()
        self._reject = False
        self._gate.set()

    async def sleep(self) -> None:
        """Wait until nothing runs, then give back the KV cache's memory (it grows on demand)."""
        while self.loop.live_sequences:
            await asyncio.sleep(0.05)
        await asyncio.wrap_future(self.loop.call(self.llm.engine.free_cache))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Nothing to restore: weights stay in memory and the cache grows when requests come."""

    async def clear_kv_cache(self) -> None:
        """tailrl keeps no prefix cache between requests: nothing to clear."""

    async def release_kv_cache(self) -> None:
        await self.sleep()

    async def resume_kv_cache(self) -> None:
        """The cache grows when requests come."""

    async def start_profile(self, **kwargs) -> None:
        log.warning("tailrl: profiling is not supported through verl; use benchmarks/ and engine metrics")

    async def stop_profile(self) -> None:
        pass

    async def stats(self) -> dict[str, float]:
        """The engine's counters under verl-style names (``rollout/...``, ``timing_s/...``)."""
        return dict(self.loop.stats())

    # ---- the OpenAI server --------------------------------------------------------------------
    async def get_server_address(self) -> tuple[str, int]:
        """(host, port) of the OpenAI server on this engine (started on first call)."""
        if self._address is None:
            host = socket.gethostbyname(socket.gethostname())
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
            self._address = (host, port)
            if self._http:
                self._http_task = asyncio.get_running_loop().create_task(self._serve(port))
        return self._address

    async def _serve(self, port: int) -> None:
        import uvicorn
        from tailrl.serve.app import build_app
        from tailrl.serve.config import ServeConfig
        app = build_app(self.llm, ServeConfig(model_name=self.model_config.path), loop=self.loop)
        await uvicorn.Server(uvicorn.Config(app, host="0.0.0.0", port=port, log_level="warning")).serve()
