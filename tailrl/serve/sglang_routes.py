"""SGLang's native HTTP API beside the OpenAI one, as SGLang's own server has both.

``POST /generate`` (sglang_protocol.py; ``stream`` as SGLang's cumulative server-sent events)
runs each sample as a call of the per-sample front
(``SampleServer``) over the server's one engine loop, so it batches with /v1/* traffic. The
control routes RL frameworks drive between rollouts:

- ``/abort_request`` (``rid`` or ``abort_all``): the calls end at once with what they generated
  (``finish_reason.type == "abort"``: slime's partial rollouts keep those tokens);
- ``/pause_generation`` (mode ``abort`` only) aborts every call and holds new ones until
  ``/continue_generation``;
- ``/update_weights_from_disk``: a checkpoint of the served model's architecture, checked (config,
  tensor names and shapes) before any weight is touched; new calls wait, running ones finish
  (or are aborted with ``abort_all_requests``), then the weights are swapped between two engine
  steps; a new weight version starts new sample groups and noise, and ``weight_version`` labels
  every later answer;
- ``/release_memory_occupation`` (the K/V cache's memory, once nothing runs; the weights stay)
  and ``/resume_memory_occupation``;
- ``/flush_cache``, ``/v1/loads``, ``/server_info``, ``/model_info`` (and their ``get_`` names),
  ``/get_weight_version``, ``/health_generate`` (a real one-token generation through the engine loop).

With ``--api-key`` every route but the health ones needs ``Authorization: Bearer <key>``.
Imported only by ``app.build_app`` once the ``serve`` extra is known to be installed.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time

from fastapi import Request

import tailrl
from tailrl.config import SamplingParams
from tailrl.engine.request import Request as EngineRequest
from tailrl.model.loader import load_matching_state_dict
from tailrl.serve import require
from tailrl.serve import responses as R
from tailrl.serve.errors import APIError, error_body
from tailrl.serve.samples import SampleServer
from tailrl.serve.sglang_protocol import PromptCall, answer, parse_generate
from tailrl.serve.weight_group import WeightGroup

HEALTH_TIMEOUT_S = 20.0
_UPDATE_FIELDS = {"model_path": None, "load_format": None, "abort_all_requests": False, "weight_version": None,
                  "flush_cache": True, "is_async": False, "torch_empty_cache": False, "keep_pause": False,
                  "recapture_cuda_graph": False, "token_step": 0}


class NativeFront:
    """What the native routes share: the per-sample front, running calls by ``rid``, the weight
    version and whether generation is paused."""

    def __init__(self, server) -> None:
        self.server = server
        self.samples = SampleServer(server.llm, server.loop)
        self.weight_version = "default"
        self.paused = False
        self.calls: dict[str, set[str]] = {}           # rid -> its running call ids
        self._ids = itertools.count(1)
        self.group: WeightGroup | None = None          # a trainer's weights update group, once joined
        self.open_update = False                       # buckets came while paused: continue ends the update

    async def generate(self, request, calls: list[PromptCall]) -> list[dict]:
        """Every sample of every prompt, concurrently; a client that leaves aborts them."""
        t0 = time.monotonic()
        jobs, mine = [], set()
        for c in calls:
            rid = c.rid or f"tailrl-{next(self._ids)}"
            one = dataclasses.replace(c.params, n=1)
            for j in range(c.params.n):
                sid = rid if c.params.n == 1 else f"{rid}-{j}"
                self.calls.setdefault(rid, set()).add(sid)
                mine.add(sid)
                # a seed fixes the noise whatever order calls arrive in: sample j of this body
                jobs.append(self._one(c, one, rid, sid, t0, None if c.params.seed is None else j))
        work = asyncio.ensure_future(asyncio.gather(*jobs))
        watch = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if not work.done():
            self.samples.abort(mine)
            work.cancel()
            raise ConnectionError("client disconnected")
        if work.exception() is not None:              # one call failed: its siblings' answers go nowhere
            self.samples.abort(mine)
        return work.result()

    async def _one(self, call: PromptCall, params: SamplingParams, rid: str, sid: str, t0: float,
                   index: int | None) -> dict:
        try:
            s = await self.samples.generate(sid, call.input_ids, params, index)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        except RuntimeError as e:                     # the engine failed; the server stays up
            raise APIError(500, str(e)) from None
        finally:
            self._left(rid, sid)
        self.server.counters.generation_tokens += len(s.token_ids)
        return self._answer(call, s, sid, t0)

    def _answer(self, call: PromptCall, s, sid: str, t0: float) -> dict:
        llm = self.server.llm
        return answer(call, s, sid, llm.tokenizer, llm.engine.args.eos_token_ids, self.weight_version,
                      time.monotonic() - t0)

    async def stream(self, call: PromptCall):
        """Server-sent events: the answer so far after each engine update, then ``[DONE]``. A
        client that leaves closes this generator, and closing the sample's stream aborts it."""
        t0 = time.monotonic()
        rid = call.rid or f"tailrl-{next(self._ids)}"
        self.calls.setdefault(rid, set()).add(rid)
        try:
            index = None if call.params.seed is None else 0
            async for s in self.samples.stream(rid, call.input_ids, call.params, index):
                if s.finish_reason is not None:
                    self.server.counters.generation_tokens += len(s.token_ids)
                yield R.sse(self._answer(call, s, rid, t0))
        except RuntimeError as e:                     # the engine failed; the server stays up
            yield R.sse(error_body(500, str(e)))
        finally:
            self._left(rid, rid)
        yield R.sse("[DONE]")

    def _left(self, rid: str, sid: str) -> None:
        """Call ``sid`` of ``rid`` ended: no abort reaches it any more."""
        live = self.calls.get(rid)
        if live is not None:
            live.discard(sid)
            if not live:
                del self.calls[rid]

    def abort(self, rid: str | None) -> int:
        ids = {sid for sids in self.calls.values() for sid in sids} if rid is None else self.calls.get(rid, set())
        return self.samples.abort(set(ids))

    async def update_from_disk(self, body: dict) -> dict:
        for k, v in body.items():
            if k not in _UPDATE_FIELDS:
                raise APIError(400, f"unknown field '{k}'", param=k)
            if k in ("is_async", "keep_pause", "recapture_cuda_graph", "torch_empty_cache") and v:
                raise APIError(400, f"field '{k}' is not supported by this server", param=k)
        path, fmt = body.get("model_path"), body.get("load_format")
        if not isinstance(path, str) or not path:
            raise APIError(400, "field 'model_path' must be a checkpoint directory", param="model_path")
        if fmt not in (None, "auto", "safetensors"):
            raise APIError(400, f"field 'load_format' must be 'auto' or 'safetensors', got {fmt!r}",
                           param="load_format")
        version = body.get("weight_version")
        if version is not None and not isinstance(version, str):
            raise APIError(400, "field 'weight_version' must be a string", param="weight_version")
        served = self.server.llm.engine.config.model
        try:                                  # read and checked off the event loop, before any change
            weights = await asyncio.to_thread(load_matching_state_dict, path, served)
        except (ValueError, OSError) as e:
            return {"success": False, "message": str(e), "num_paused_requests": 0}
        self.samples.hold()
        try:
            if body.get("abort_all_requests"):
                self.abort(None)
            await self.samples.update_weights(weights)     # once running requests finished
        finally:
            if not self.paused:
                await self.samples.resume()
        if version is not None:
            self.weight_version = version
        return {"success": True, "message": f"weights loaded from {path}", "num_paused_requests": 0}

    async def join_group(self, body: dict) -> dict:
        """``/init_weights_update_group``: join the trainer's process group (blocks until all joined)."""
        device = self.server.llm.engine.model.norm.device
        try:
            self.group = await asyncio.to_thread(WeightGroup, body, device)
        except (ValueError, RuntimeError) as e:
            return {"success": False, "message": str(e)}
        return {"success": True, "message": f"joined weights update group {self.group.name!r} as rank "
                                            f"{self.group.rank}"}

    async def update_from_distributed(self, body: dict) -> dict:
        """One bucket: its tensors broadcast by the trainer, checked against the model, then
        loaded between two engine steps once running requests finished. While paused (slime's
        update: pause, buckets, continue) the buckets make one update, ended by
        ``/continue_generation``, which checks that every tensor came; otherwise each bucket is
        an update of its own."""
        if self.group is None or body.get("group_name") != self.group.name:
            raise APIError(400, f"field 'group_name': no weights update group {body.get('group_name')!r} was "
                                "joined (/init_weights_update_group)", param="group_name")
        if body.get("load_format") not in (None, "auto"):
            raise APIError(400, "field 'load_format' is not supported by this server", param="load_format")
        spec = self.group.bucket_spec(body)
        pairs = await asyncio.to_thread(self.group.receive, spec)     # the trainer broadcasts them now
        self.open_update = self.paused
        try:                                          # a bucket that does not fit is refused whole
            await self.samples.update_weights(pairs, done=not self.paused, complete=False)
        except ValueError as e:
            return {"success": False, "message": str(e)}
        if isinstance(body.get("weight_version"), str):
            self.weight_version = body["weight_version"]
        return {"success": True, "message": f"{len(pairs)} tensors loaded"}

    async def end_update(self) -> str | None:
        """The open update's end (``/continue_generation``): None, or why it is incomplete."""
        if not self.open_update:
            return None
        self.open_update = False
        try:
            await self.samples.update_weights([], done=True)
        except ValueError as e:
            return str(e)
        return None

    async def healthy(self) -> bool:
        """A one-token greedy generation through the engine loop, outside any sample group."""
        loop = self.server.loop
        if not loop.alive:
            return False
        aloop = asyncio.get_running_loop()
        done: asyncio.Future = aloop.create_future()
        req = EngineRequest(f"health-{next(self._ids)}", [0], SamplingParams(temperature=0.0, max_tokens=1), 0,
                            group_id="health", prompt_id="health")
        loop.submit([req], lambda u: aloop.call_soon_threadsafe(lambda: done.done() or done.set_result(u[-1])),
                    final_only=True, on_retire=lambda _: None)
        try:
            u = await asyncio.wait_for(done, HEALTH_TIMEOUT_S)
        except asyncio.TimeoutError:
            loop.abort([req.request_id])
            return False
        return u.error is None and len(u.token_ids) == 1

    def loads(self) -> dict:
        running = len(self.server.llm.engine.scheduler.running)
        total = self.server.loop.live_sequences
        return {"loads": [{"dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": max(total - running, 0),
                           "num_total_reqs": total}]}

    async def release_memory(self, tags) -> dict:
        """SGLang's release: here the K/V cache's memory (it grows back on demand), once nothing
        runs; weights stay where they are (a named ``weights`` tag is refused)."""
        _memory_tags(tags)
        await self.samples.sleep()
        return {"success": True, "released": ["kv_cache"]}

    def server_info(self) -> dict:
        llm, engine, cfg = self.server.llm, self.server.llm.engine, self.server.cfg
        return {"model_path": engine.config.model, "served_model_name": cfg.model_name, "host": cfg.host,
                "port": cfg.port, "nnodes": 1, "node_rank": 0, "ep_size": 1,
                "engine": "tailrl", "version": tailrl.__version__, "tp_size": 1, "dp_size": 1, "pp_size": 1,
                "num_gpus": 0 if engine.config.device == "cpu" else 1, "device": engine.config.device,
                "dtype": engine.config.dtype, "context_length": self.server.inputs.max_model_len,
                "max_total_num_tokens": engine.kv.budget_tokens, "max_running_requests": engine.config.max_num_seqs,
                "speculative_algorithm": None if llm.speculative is None else llm.speculative.method or "default",
                "weight_version": self.weight_version, "disaggregation_mode": "null"}

    def model_info(self) -> dict:
        path = self.server.llm.engine.config.model
        return {"model_path": path, "tokenizer_path": path if self.server.llm.tokenizer is not None else None,
                "is_generation": True, "weight_version": self.weight_version}


def _memory_tags(tags) -> None:
    if tags is None:
        return
    if not isinstance(tags, list) or any(t not in ("kv_cache", "weights") for t in tags):
        raise APIError(400, f"field 'tags' must be a list of 'kv_cache' / 'weights', got {tags!r}", param="tags")
    if "weights" in tags:
        raise APIError(400, "field 'tags': this server keeps its weights in memory (only 'kv_cache' is released)",
                       param="tags")


async def _disconnected(request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _body(server, request) -> dict:
    """A control route's JSON object (an empty body is ``{}``), after the key check."""
    server.check_auth(request)
    raw = await server.read_json(request) if int(request.headers.get("content-length") or 0) else {}
    if not isinstance(raw, dict):
        raise APIError(400, "request body must be a JSON object")
    return raw


def add_sglang_routes(app, server) -> None:
    front = NativeFront(server)
    app.state.sglang = front
    responses = require("fastapi.responses")
    _generation_routes(app, server, front, responses)
    _control_routes(app, server, front, responses)
    _weight_group_routes(app, server, front, responses)
    _info_routes(app, server, front, responses)


def _generation_routes(app, server, front: NativeFront, responses) -> None:
    @app.post("/generate")
    async def generate(request: Request):
        server.check_auth(request)
        calls, batch, stream = parse_generate(await server.read_json(request), server.inputs, server.cfg)
        server.admit(sum(c.params.n for c in calls), sum(len(c.input_ids) * c.params.n for c in calls))
        if stream:
            return responses.StreamingResponse(front.stream(calls[0]), media_type="text/event-stream")
        try:
            outs = await front.generate(request, calls)
        except ConnectionError:
            return responses.Response(status_code=499)
        return outs if batch or len(outs) > 1 else outs[0]


def _control_routes(app, server, front: NativeFront, responses) -> None:
    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await _body(server, request)
        rid, every = body.get("rid", ""), bool(body.get("abort_all", False))
        if not every and (not isinstance(rid, str) or not rid):
            raise APIError(400, "give 'rid' (a request id) or 'abort_all': true", param="rid")
        return {"success": True, "num_aborted": front.abort(None if every else rid)}

    @app.post("/pause_generation")
    async def pause(request: Request):
        mode = (await _body(server, request)).get("mode", "abort")
        if mode != "abort":
            raise APIError(400, f"field 'mode' must be 'abort' (running requests end with what they generated), "
                           f"got {mode!r}", param="mode")
        front.paused = True
        return {"success": True, "num_aborted": await front.samples.abort_all()}

    @app.post("/continue_generation")
    async def resume(request: Request):
        await _body(server, request)
        incomplete = await front.end_update()
        front.paused = False
        await front.samples.resume()
        if incomplete:
            return responses.JSONResponse({"success": False, "message": incomplete}, status_code=400)
        return {"success": True}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        out = await front.update_from_disk(await _body(server, request))
        return responses.JSONResponse(out, status_code=200 if out["success"] else 400)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request):
        server.check_auth(request)
        await front.samples.clear_prefixes()
        return {"success": True, "message": "cache flushed"}

    @app.post("/release_memory_occupation")
    async def release_memory(request: Request):
        return await front.release_memory((await _body(server, request)).get("tags"))

    @app.post("/resume_memory_occupation")
    async def resume_memory(request: Request):
        _memory_tags((await _body(server, request)).get("tags"))
        return {"success": True}                # the K/V cache is allocated again by the next request


def _weight_group_routes(app, server, front: NativeFront, responses) -> None:
    @app.post("/init_weights_update_group")
    async def init_group(request: Request):
        out = await front.join_group(await _body(server, request))
        return responses.JSONResponse(out, status_code=200 if out["success"] else 400)

    @app.post("/update_weights_from_distributed")
    async def update_from_distributed(request: Request):
        try:
            out = await front.update_from_distributed(await _body(server, request))
        except ValueError as e:
            raise APIError(400, str(e)) from e
        return responses.JSONResponse(out, status_code=200 if out["success"] else 400)

    @app.post("/destroy_weights_update_group")
    async def destroy_group(request: Request):
        await _body(server, request)
        if front.group is not None:
            front.group.close()
            front.group = None
        return {"success": True}


def _info_routes(app, server, front: NativeFront, responses) -> None:
    @app.get("/v1/loads")
    async def loads(request: Request):
        server.check_auth(request)
        return front.loads()

    for route in ("/server_info", "/get_server_info"):
        @app.get(route)
        async def server_info(request: Request):
            server.check_auth(request)
            return front.server_info()

    for route in ("/model_info", "/get_model_info"):
        @app.get(route)
        async def model_info(request: Request):
            server.check_auth(request)
            return front.model_info()

    @app.get("/get_weight_version")
    async def weight_version(request: Request):
        server.check_auth(request)
        return {"weight_version": front.weight_version}

    @app.get("/health_generate")
    async def health_generate():
        if await front.healthy():
            return {"status": "ok"}
        return responses.JSONResponse(error_body(503, "the engine did not generate a token"), status_code=503)
