"""Checkpoints that let ``--resume`` continue a run exactly.

``OUTPUT_DIR/checkpoints/step_000010/`` holds:
- the policy in Hugging Face format (``config.json``, ``model.safetensors``) plus the
  tokenizer, so a checkpoint is also a model ``LLM(model=...)`` and transformers can load;
- ``optimizer.pt``: the optimizer's state (AdamW moments, step counts);
- ``rng.pt``: torch, numpy and Python RNG states;
- ``history.json``: the rollout history store (last epoch's responses per prompt id);
- ``trainer_state.json``: step, data cursor and the config the run was started with.
- ``drafter/`` (runs with ``drafter: true``): the online drafter's newest weights, a drafter
  checkpoint that ``SpeculativeConfig(drafter=...)`` loads, plus its optimizer, version and
  batch sampler (``spot_trainer.pt``) and its training buffer (``buffer.safetensors``: the
  rollouts' hidden states and tokens it trains on), so the drafter resumes exactly.
A checkpoint is written to a temporary directory and renamed into place, so a crash while
saving never leaves a half checkpoint that ``latest_checkpoint`` would pick.
"""
from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"step_{step:06d}"


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    root = Path(output_dir) / "checkpoints"
    done = sorted(p for p in root.glob("step_*") if (p / STATE_FILE).is_file()) if root.is_dir() else []
    return done[-1] if done else None


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def save_checkpoint(output_dir: str | Path, step: int, policy: torch.nn.Module, tokenizer,
                    optimizer: torch.optim.Optimizer, history, state: dict[str, Any], drafter=None) -> Path:
    """``drafter``: the spot trainer (anything with ``save(directory)``), or None."""
    final = checkpoint_dir(output_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    policy.save_pretrained(str(tmp))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    history.save(tmp / "history.json")
    if drafter is not None:
        drafter.save(str(tmp / "drafter"))
    (tmp / STATE_FILE).write_text(json.dumps({"step": step, **state}, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    log.info("checkpoint at step %d: %s", step, final)
    return final


def load_state(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not (path / STATE_FILE).is_file():
        raise ValueError(f"{path} is not a tailrl training checkpoint (no {STATE_FILE})")
    return json.loads((path / STATE_FILE).read_text())


def restore(path: str | Path, optimizer: torch.optim.Optimizer, history) -> None:
    """Optimizer, RNG streams and history from a checkpoint; the policy weights are loaded
    by the caller from the same directory (it is a Hugging Face model directory)."""
    path = Path(path)
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))
    set_rng_state(torch.load(path / "rng.pt", weights_only=False))
    history.load(path / "history.json")
