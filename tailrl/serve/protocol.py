"""Request bodies of the OpenAI API subset the server speaks, as strict pydantic models.

Strict: ``"temperature": "hot"`` or ``"n": 1.5`` is a 400, not silently coerced. Unknown fields
are ignored (clients send ``user`` and the like); fields OpenAI defines but the engine cannot
honour (``echo``, ``best_of``, ``logit_bias``, penalties, ``suffix``) are rejected when set, so a
client never gets output that silently ignores what it asked for. tailrl extensions (sent
through the client's ``extra_body``): ``prompt_id`` (stable prompt id: history drafts),
``top_k``, ``stop_token_ids``, ``ignore_eos``.
"""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from tailrl.serve.errors import APIError

Number = Union[StrictInt, StrictFloat]
TokenIds = list[StrictInt]


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    n: StrictInt = 1
    temperature: Number = 1.0
    top_p: Number = 1.0
    top_k: StrictInt = -1
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: dict | None = None
    presence_penalty: Number = 0
    frequency_penalty: Number = 0
    # vLLM's extra sampling fields (engine/logits_process.py)
    repetition_penalty: Number = 1.0
    min_p: Number = 0.0
    min_tokens: StrictInt = 0
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    # ignored-if-default OpenAI fields
    logit_bias: dict | None = None
    best_of: StrictInt | None = None

    def unsupported(self) -> str | None:
        """The name of a set field the engine cannot honour, if any."""
        if self.logit_bias:
            return "logit_bias"
        if self.best_of not in (None, self.n):
            return "best_of"
        return None

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    max_tokens: StrictInt = 16                      # OpenAI's default for completions
    logprobs: StrictInt | None = None              # alternatives per token, 0..20 (0: the sampled token's only)
    echo: StrictBool = False
    suffix: StrictStr | None = None
    prompt_id: StrictStr | list[StrictStr] | None = None

    def unsupported(self) -> str | None:
        if self.echo and self.stream:
            return "echo"                               # (echoed prompts are returned whole, not streamed)
        if self.suffix:
            return "suffix"
        return super().unsupported()

    def prompt_list(self) -> list:
        """The prompts as a list of str / list[int] (a flat id list is one prompt)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [p]
        return list(p)


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[TextPart] | None = None

    def as_template_input(self) -> dict:
        c = self.content
        text = "".join(p.text for p in c) if isinstance(c, list) else (c or "")
        return {"role": self.role, "content": text}


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    prompt_id: StrictStr | None = None


def parse(model: type[BaseModel], data) -> BaseModel:
    """Validate a JSON body; the first problem becomes a 400 naming the field."""
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errs = e.errors()
        err = errs[0]
        field = str(err["loc"][0]) if err["loc"] else "body"
        if err["type"] == "missing":
            raise APIError(400, f"field '{field}' is required", param=field) from None
        if len(errs) > 1 and all(x["loc"][:1] == err["loc"][:1] for x in errs):   # a union: no member fits
            raise APIError(400, f"field '{field}' has the wrong type", param=field) from None
        raise APIError(400, f"field '{field}' is invalid: {err['msg']}", param=field) from None
