"""One tailrl rollout server of a verl replica: the body of its Ray actor.

verl's ``LLMServerClient`` calls ``generate(prompt_ids, sampling_params, request_id)`` once per
sample, hundreds at a time, on the server's asyncio loop. Each call goes to tailrl's
``SampleServer`` (``tailrl/serve/samples.py``: siblings with the same prompt tokens form one
group per weight version, a token digest is the prompt id for history drafts, the noise is
``LLM.generate``'s for ``prompt_seed(epoch, tokens)``), which runs every live sample in one
continuously batched engine with tailrl's speculation and scheduling. The call returns verl's
``TokenOutput``: tokens, the target's log-probabilities, and per-request speculation counters
under verl's ``spec_num_*`` keys (verl's trainer turns them into ``rollout/spec_accept_rate``
and ``rollout/spec_accept_length``). With ``rollout.full_determinism`` verl's request ids are
``det-<priority>``: the priority is then the sample's noise index, whatever the arrival order.
The same engine answers OpenAI requests at ``server_address``, for agent loops that talk HTTP.

Control methods, called by verl's replica and ``ServerAdapter``: ``update_weights`` (named
tensors from the trainer through Ray's object store), ``sleep`` (gives back the KV cache's
memory while the trainer trains), ``wake_up``, ``abort_all_requests`` / ``resume_generation``
(partial rollout: running samples end with what they generated, ``stop_reason="aborted"``).
"""
from __future__ import annotations

import asyncio
import logging
import re
import socket

from tailrl import LLM
from tailrl.config import SamplingParams
from tailrl.serve.samples import SampleServer

log = logging.getLogger(__name__)

# verl's sampling parameters tailrl takes, and those it takes only at their neutral value
TAKEN = {"temperature", "top_p", "top_k", "max_tokens", "max_new_tokens", "logprobs", "seed",
         "stop_token_ids", "ignore_eos", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_p",
         "min_tokens"}
NEUTRAL = {"n": 1}
PROCESSING = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0,
              "min_tokens": 0}       # (engine/logits_process.py) and the type each is taken as
DETERMINISTIC_ID = re.compile(r"det-(\d+)$")


def engine_kwargs(config) -> dict:
    """``LLM`` keyword arguments from verl's ``RolloutConfig``: dtype, seed, the context
    (``max_model_len``, else prompt + response length), batch size and, for an engine on a GPU
    (``engine_kwargs.tailrl.device``), ``gpu_memory_utilization`` (verl's default 0.5: the
    rest is the actor's); anything under ``engine_kwargs.tailrl`` (``speculative``,
    ``num_threads``, ``device``, ...) on top."""
    kwargs = dict(dtype=config.dtype, seed=config.seed, max_num_seqs=config.max_num_seqs,
                  max_model_len=config.max_model_len or config.prompt_length + config.response_length,
                  gpu_memory_utilization=config.gpu_memory_utilization)
    extra = (config.engine_kwargs or {}).get("tailrl") or {}
    return {**kwargs, **dict(extra)}


def to_sampling_params(params: dict, config, prompt_len: int, max_model_len: int) -> tuple[SamplingParams, bool]:
    """(``SamplingParams``, whether log-probabilities are wanted) from verl's dict, with verl's
    default length (the response length, within prompt + response length and the context);
    ``ValueError`` names a field tailrl does not take."""
    for key, value in params.items():
        if key in NEUTRAL and value is not None and value != NEUTRAL[key]:
            raise ValueError(f"sampling_params['{key}'] = {value!r} is not supported by tailrl (only {NEUTRAL[key]!r})")
        if key not in TAKEN and key not in NEUTRAL:
            raise ValueError(f"sampling_params['{key}'] is not supported by tailrl")
    max_tokens = params.get("max_tokens", params.get("max_new_tokens"))
    if max_tokens is None:
        max_tokens = min(config.response_length, config.prompt_length + config.response_length - prompt_len)
    sp = SamplingParams(temperature=float(params.get("temperature", 1.0)), top_p=float(params.get("top_p", 1.0)),
                        top_k=int(params.get("top_k", -1)),
                        max_tokens=max(1, min(int(max_tokens), max_model_len - prompt_len)),
                        seed=params.get("seed"), stop_token_ids=params.get("stop_token_ids"),
                        ignore_eos=bool(params.get("ignore_eos", config.ignore_eos)),
                        **{k: type(v)(params[k]) for k, v in PROCESSING.items() if params.get(k) is not None})
    return sp, bool(params.get("logprobs"))


class TailRLServer:
    """Made a Ray actor by ``TailRLReplica``; usable in-process too (tests)."""

    def __init__(self, config, model_config, replica_rank: int = 0, http: bool = True) -> None:
        from verl.utils.config import omega_conf_to_dataclass
        self.config = omega_conf_to_dataclass(config)
        self.model_config = omega_conf_to_dataclass(model_config)
        self.replica_rank = replica_rank
        self.llm = LLM(self.model_config.local_path or self.model_config.path, **engine_kwargs(self.config))
        self.samples = SampleServer(self.llm)
        self.global_steps: int | None = None
        self._http = http
        self._address: tuple[str, int] | None = None
        self._http_task = None                            # holds the OpenAI server's task alive

    async def generate(self, prompt_ids: list[int], sampling_params: dict, request_id: str,
                       image_data=None, video_data=None, audio_data=None, mm_processor_kwargs=None,
                       priority: int = 0, **unused):
        from verl.workers.rollout.replica import TokenOutput
        if image_data or video_data or audio_data:
            raise ValueError("tailrl serves text models: image_data, video_data and audio_data must be empty")
        if not isinstance(prompt_ids, (list, tuple)) or not prompt_ids:
            raise ValueError("prompt_ids must be a non-empty list of token ids")
        sp, want_logprobs = to_sampling_params(dict(sampling_params), self.config, len(prompt_ids),
                                            self.llm.inputs.max_model_len)
        det = DETERMINISTIC_ID.match(str(request_id))
        s = await self.samples.generate(request_id, prompt_ids, sp, int(det.group(1)) if det else None)
        return TokenOutput(
            token_ids=s.token_ids, log_probs=s.logprobs if want_logprobs else None,
            stop_reason="aborted" if s.aborted else "completed", num_preempted=s.num_preemptions,
            extra_fields={"global_steps": self.global_steps, "spec_num_draft_tokens": s.spec_draft_tokens,
                          "spec_num_accepted_tokens": s.spec_accepted_tokens,
                          "spec_num_verify_steps": s.spec_verify_steps})

    async def update_weights(self, weights, global_steps: int | None = None, done: bool = True) -> None:
        """New policy weights (Hugging Face names), loaded between two engine steps: the whole
        model (a dict), or one bucket of (name, tensor) pairs, ``done`` on the last
        (``SampleServer.update_weights``)."""
        await self.samples.update_weights(weights, done)
        if done and global_steps is not None:
            self.global_steps = global_steps

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    async def abort_all_requests(self, reject_request: bool = False, **unused) -> dict:
        return {"aborted": await self.samples.abort_all(reject_request)}

    async def resume_generation(self) -> None:
        await self.samples.resume()

    async def sleep(self) -> None:
        await self.samples.sleep()

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Nothing to restore: the weights stay in memory and the cache grows when samples come."""

    async def clear_kv_cache(self) -> None:
        """Forget the cached prefixes (engine/kv/prefix.py; new weights forget them anyway)."""
        await self.samples.clear_prefixes()

    async def release_kv_cache(self) -> None:
        await self.samples.sleep()

    async def resume_kv_cache(self) -> None:
        """The cache grows when samples come."""

    async def start_profile(self, **kwargs) -> None:
        log.warning("tailrl: no profiler through verl; the engine's metrics are in stats()")

    async def stop_profile(self) -> None:
        pass

    async def stats(self) -> dict[str, float]:
        """The engine's counters under verl-style names (``rollout/...``, ``timing_s/...``)."""
        return dict(self.samples.loop.stats())

    async def get_server_address(self) -> tuple[str, int]:
        """(host, port) of the OpenAI server on this engine (started on the first call)."""
        if self._address is None:
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
            self._address = (socket.gethostbyname(socket.gethostname()), port)
            if self._http:
                self._http_task = asyncio.get_running_loop().create_task(self._serve(port))
        return self._address

    async def _serve(self, port: int) -> None:
        import uvicorn

        from tailrl.serve.app import build_app
        from tailrl.serve.config import ServeConfig
        app = build_app(self.llm, ServeConfig(model_name=self.model_config.path), loop=self.samples.loop)
        await uvicorn.Server(uvicorn.Config(app, host="0.0.0.0", port=port, log_level="warning")).serve()
