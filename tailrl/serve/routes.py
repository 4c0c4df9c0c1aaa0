"""The HTTP routes: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

Imported only by ``app.build_app``, after it checked that the ``serve`` extra is installed
(FastAPI resolves the ``Request`` annotations below from this module's globals)."""
from __future__ import annotations

from fastapi import Request

from tailrl.config import MAX_LOGPROBS
from tailrl.serve import require
from tailrl.serve import responses as R
from tailrl.serve.errors import APIError, error_body
from tailrl.serve.generation import GenerationRun, make_groups, sampling_params
from tailrl.serve.protocol import ChatCompletionRequest, CompletionRequest, parse


def add_routes(app, server) -> None:
    responses = require("fastapi.responses")

    @app.get("/health")
    async def health():
        if not server.loop.alive:
            return responses.JSONResponse(error_body(503, "engine loop is not running"), status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request):
        server.check_auth(request)
        return {"object": "list", "data": [{"id": server.cfg.model_name, "object": "model", "created": 0,
                                            "owned_by": "tailrl", "max_model_len": server.inputs.max_model_len}]}

    @app.get("/metrics")
    async def metrics(request: Request):
        server.check_auth(request)
        body, ctype = server.metrics.render()
        return responses.Response(body, media_type=ctype)

    @app.post("/v1/completions")
    async def completions(request: Request):
        server.check_auth(request)
        req = parse(CompletionRequest, await server.read_json(request))
        server.check_model(req.model)
        _alternatives(req.logprobs, "logprobs")
        ids = server.prompt_tokens(req.prompt_list())
        params = sampling_params(req, req.max_tokens, server.cfg, server.inputs, req.logprobs or 0,
                                 req.logprobs if req.echo else None)
        pids = req.prompt_id if not isinstance(req.prompt_id, str) else [req.prompt_id] * len(ids)
        groups = make_groups(server.inputs, ids, params, pids)
        run = server.start(groups, req.stop_list(), req.stream)
        return await _respond(server, request, run, req, "cmpl", req.logprobs is not None)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        server.check_auth(request)
        req = parse(ChatCompletionRequest, await server.read_json(request))
        server.check_model(req.model)
        _alternatives(req.top_logprobs, "top_logprobs")
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "field 'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        ids = server.chat_tokens(req)
        room = server.inputs.max_model_len - len(ids)
        max_tokens = next((m for m in (req.max_completion_tokens, req.max_tokens) if m is not None),
                          min(server.cfg.max_tokens_limit, room))
        params = sampling_params(req, max_tokens, server.cfg, server.inputs, req.top_logprobs or 0)
        groups = make_groups(server.inputs, [ids], params, None if req.prompt_id is None else [req.prompt_id])
        run = server.start(groups, req.stop_list(), req.stream)
        return await _respond(server, request, run, req, "chatcmpl", req.logprobs)


async def _respond(server, request, run: GenerationRun, req, kind: str, logprobs: bool):
    """A JSON body once everything finished, or a server-sent-event stream."""
    responses = require("fastapi.responses")
    rid, model = R.new_id(kind), server.cfg.model_name
    if req.stream:
        return responses.StreamingResponse(_stream(server, run, req, rid, kind, logprobs),
                                           media_type="text/event-stream")
    try:
        await run.wait(request)
    except ConnectionError:
        server.finish(run)
        return responses.Response(status_code=499)        # nobody reads it; the requests were aborted
    server.finish(run)
    if run.error:
        raise APIError(500, run.error)
    body = (R.completion_body(rid, model, run.choices, run.usage(), logprobs, req.echo) if kind == "cmpl"
            else R.chat_body(rid, model, run.choices, run.usage(), logprobs, req.top_logprobs or 0))
    return responses.JSONResponse(body)


async def _stream(server, run: GenerationRun, req, rid: str, kind: str, logprobs: bool):
    """Tokens are sent as soon as the engine accepts them (bursts when drafts are accepted).
    If the client goes away, Starlette cancels this generator and ``finally`` aborts its requests."""
    model = server.cfg.model_name
    try:
        if kind == "chatcmpl":                 # OpenAI sends the role first, before any content
            for c in run.choices:
                yield R.sse(R.chat_chunk(rid, model, c, logprobs, first=True, n=req.top_logprobs or 0))
        while not run.done:
            for c in await run.next():
                chunk = (R.completion_chunk(rid, model, c, logprobs) if kind == "cmpl"
                         else R.chat_chunk(rid, model, c, logprobs, first=False, n=req.top_logprobs or 0))
                if chunk is not None:
                    yield R.sse(chunk)
        if run.error:
            yield R.sse(error_body(500, run.error))
        if req.include_usage():
            obj = "text_completion" if kind == "cmpl" else "chat.completion.chunk"
            yield R.sse(R.usage_chunk(rid, model, obj, run.usage()))
        yield R.sse("[DONE]")
    finally:
        server.finish(run)


def _alternatives(value: int | None, field: str) -> None:
    """The alternatives a request may ask per token: 0 (the sampled token's logprob only) to 20."""
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise APIError(400, f"field '{field}' must be in [0, {MAX_LOGPROBS}], got {value}", param=field)
