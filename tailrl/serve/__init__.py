"""OpenAI-compatible HTTP server over one engine loop (``tailrl serve``; extra ``serve``).

Importing this package is cheap; FastAPI, uvicorn and prometheus_client are imported by the
modules that need them, through ``require`` so a missing extra names the fix."""
from __future__ import annotations

from tailrl.extras import require as _require


def require(module: str, extra: str = "serve"):
    """``tailrl.extras.require`` with the server's extra as the default."""
    return _require(module, extra)
