"""Where the workload models live: ``get_model(preset)`` returns a checkpoint directory.

- ``small``: the weights shipped in the repository (``models/small``) when present, since
  training them takes longer than a demo should wait; otherwise the cached build.
- any other preset (``test``): the cached build, built on first use.

The cache is ``$TAILRL_CACHE/models/<preset>-<fingerprint>`` (default ``~/.cache/tailrl``);
the fingerprint hashes the preset, so changing a preset never serves a stale model. A build
goes into a temporary directory renamed into place when complete, under a file lock, so
concurrent processes (pytest workers, CI jobs) never see half a model and build it once.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

from tailrl.tasks.presets import ModelPreset, get_preset

log = logging.getLogger(__name__)

# Bump when the task formats or the tokenizer change in a way that changes built models.
FORMAT_VERSION = 1
SHIPPED_ROOT = Path(__file__).resolve().parents[2] / "models"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def cache_root() -> Path:
    return Path(os.environ.get("TAILRL_CACHE", Path.home() / ".cache" / "tailrl")).expanduser()


def fingerprint(preset: ModelPreset) -> str:
    blob = json.dumps({"format": FORMAT_VERSION, **asdict(preset)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in REQUIRED_FILES)


def shipped_model(name: str) -> Path | None:
    path = SHIPPED_ROOT / name
    return path if is_complete(path) else None


def cached_model_path(preset: ModelPreset) -> Path:
    return cache_root() / "models" / f"{preset.name}-{fingerprint(preset)}"


def build_cached(preset: ModelPreset) -> Path:
    """The cached build of ``preset``, building it (once, atomically) if missing."""
    from tailrl.tasks.make_model import build

    final = cached_model_path(preset)
    if is_complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # another process may be building it right now
        if is_complete(final):
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        try:
            log.info("building the %r model into %s", preset.name, final)
            build(preset, tmp)
            os.rename(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def get_model(preset: str = "small") -> str:
    """Path of a ready checkpoint directory for ``preset`` ("test" or "small")."""
    p = get_preset(preset)
    if p.name == "small":
        shipped = shipped_model(p.name)
        if shipped is not None:
            return str(shipped)
    return str(build_cached(p))
