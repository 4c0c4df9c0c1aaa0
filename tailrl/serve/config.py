"""The server's limits and identity, validated up front (one flat dataclass, as EngineConfig)."""
from __future__ import annotations

import os
from dataclasses import dataclass

from tailrl.config import _check


@dataclass
class ServeConfig:
    """Every bound a client could push against has a default: the server is safe when started bare."""

    model_name: str = "tailrl"                  # what /v1/models lists and requests must name
    host: str = "127.0.0.1"                     # loopback unless the operator says otherwise
    port: int = 8000
    api_key: str | None = None                  # when set, /v1/* and /metrics need "Bearer <key>"
    max_request_bytes: int = 1 << 20            # larger bodies get 413 before being parsed
    max_tokens_limit: int = 4096                # upper bound on a request's max_tokens
    max_n: int = 64                             # upper bound on n (samples per prompt)
    max_prompts: int = 256                      # prompts in one /v1/completions request
    max_live_sequences: int = 4096              # sequences queued or running; beyond: 429
    max_stop_strings: int = 8

    def __post_init__(self) -> None:
        _check(isinstance(self.model_name, str) and self.model_name != "", "model_name", "must be non-empty",
               self.model_name)
        _check(0 <= self.port < 65536, "port", "must be in [0, 65535]", self.port)
        _check(self.api_key is None or self.api_key != "", "api_key", "must be None or non-empty", self.api_key)
        for name in ("max_request_bytes", "max_tokens_limit", "max_n", "max_prompts", "max_live_sequences",
                     "max_stop_strings"):
            _check(getattr(self, name) >= 1, name, "must be >= 1", getattr(self, name))

    @staticmethod
    def default_model_name(model_dir: str) -> str:
        return os.path.basename(os.path.normpath(model_dir)) or "tailrl"
