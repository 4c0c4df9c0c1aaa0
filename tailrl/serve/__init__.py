"""OpenAI-compatible HTTP server over one engine loop (``tailrl serve``; extra ``serve``).

Importing this package is cheap; FastAPI, uvicorn and prometheus_client are imported by the
modules that need them, through ``require`` so a missing extra names the fix."""
from __future__ import annotations

import importlib


def require(module: str, extra: str = "serve"):
    """Import an optional dependency, or fail with the pip command that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{module} is needed for this feature: pip install 'tailrl[{extra}]'") from e
