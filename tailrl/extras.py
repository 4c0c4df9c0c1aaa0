"""Optional dependencies (the extras in pyproject.toml), imported when a feature needs them.

``require("fastapi", "serve")`` imports the module or fails with the pip command that
installs it, so the core install stays light and a missing extra says how to fix it."""
from __future__ import annotations

import importlib


def require(module: str, extra: str):
    """Import an optional dependency, or fail with the pip command that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{module} is needed for this feature: pip install 'tailrl[{extra}]'") from e
