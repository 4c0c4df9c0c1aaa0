"""The FastAPI application: routes, auth, body limits; generation goes through the engine loop.

Handlers parse bodies themselves (``read_json`` + ``protocol.parse``) instead of letting
FastAPI validate them, so the body size is bounded before parsing and every client mistake is
an OpenAI-style 400 (see errors.py).
"""
from __future__ import annotations

import hmac
import json
import logging

from tailrl.serve import require
from tailrl.serve.config import ServeConfig
from tailrl.serve.errors import APIError, install_handlers
from tailrl.serve.generation import GenerationRun
from tailrl.serve.loop import EngineLoop
from tailrl.serve.metrics import Metrics, ServeCounters
from tailrl.serve.protocol import ChatCompletionRequest

log = logging.getLogger(__name__)


class Server:
    """What the handlers share: the LLM (tokenizer, input checks), its engine loop, the limits."""

    def __init__(self, llm, loop: EngineLoop, cfg: ServeConfig) -> None:
        self.llm, self.loop, self.cfg = llm, loop, cfg
        self.inputs = llm.inputs
        self.counters = ServeCounters()
        self.metrics = Metrics(loop, self.counters)

    def check_auth(self, request) -> None:
        if self.cfg.api_key is None:
            return
        header = request.headers.get("authorization", "")
        given = header[7:] if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(given.encode(), self.cfg.api_key.encode()):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")

    async def read_json(self, request):
        limit = self.cfg.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"request body is larger than {limit} bytes")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise APIError(413, f"request body is larger than {limit} bytes")
        try:
            return json.loads(body)
        except (ValueError, UnicodeDecodeError):
            raise APIError(400, "request body is not valid JSON") from None

    def check_model(self, name: str) -> None:
        if name != self.cfg.model_name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{self.cfg.model_name}'",
                           param="model", code="model_not_found")

    def check_capacity(self, sequences: int) -> None:
        if self.loop.live_sequences + sequences > self.cfg.max_live_sequences:
            raise APIError(429, f"server is full ({self.cfg.max_live_sequences} sequences queued or running); "
                           "retry later")

    def prompt_tokens(self, prompts: list) -> list[list[int]]:
        if not prompts:
            raise APIError(400, "field 'prompt' is empty", param="prompt")
        if len(prompts) > self.cfg.max_prompts:
            raise APIError(400, f"field 'prompt' has more than {self.cfg.max_prompts} prompts", param="prompt")
        try:
            _, ids = self.inputs.prompt_tokens(prompts)
        except ValueError as e:
            raise APIError(400, str(e).replace("prompts[", "prompt["), param="prompt") from None
        return ids

    def chat_tokens(self, req: ChatCompletionRequest) -> list[int]:
        tok = self.inputs.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
        try:
            return self.inputs.chat_tokens([m.as_template_input() for m in req.messages])
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None

    def admit(self, sequences: int, prompt_tokens: int) -> None:
        """A request of this many sequences and prompt tokens (all samples'): room, then counted."""
        self.check_capacity(sequences)
        self.counters.requests += 1
        self.counters.prompt_tokens += prompt_tokens

    def start(self, groups: list[list], stop: list[str], stream: bool) -> GenerationRun:
        self.admit(sum(len(g) for g in groups), sum(len(g[0].prompt_token_ids) * len(g) for g in groups))
        return GenerationRun(self.loop, groups, self.inputs.tokenizer, stop, stream)

    def finish(self, run: GenerationRun) -> None:
        run.close()
        self.counters.generation_tokens += sum(len(c.token_ids) for c in run.choices)


def build_app(llm, cfg: ServeConfig, loop: EngineLoop | None = None):
    """The ASGI app; starts the engine loop (unless given one) when the app starts."""
    fastapi = require("fastapi")
    from tailrl.serve.routes import add_routes
    from tailrl.serve.sglang_routes import add_sglang_routes
    loop = loop or EngineLoop(llm)
    server = Server(llm, loop, cfg)

    async def lifespan(app):
        if not loop.alive:
            loop.start()
        yield
        loop.stop()

    app = fastapi.FastAPI(title="tailrl", docs_url=None, redoc_url=None, openapi_url=None,
                          lifespan=lifespan)
    install_handlers(app)
    add_routes(app, server)
    add_sglang_routes(app, server)              # SGLang's native /generate and control routes
    app.state.server = server
    return app
