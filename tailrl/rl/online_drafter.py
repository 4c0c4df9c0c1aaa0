"""Wiring of the online drafter into a training run (``drafter: true`` in the config).

- ``drafter_dir``: the drafter the run starts from: the checkpoint's when resuming, else
  ``drafter_init`` (a warm start), else a fresh one sized from the target (written to
  ``OUTPUT_DIR/drafter_init`` so that the engine loads it like any drafter), its head over a
  draft vocabulary of ``drafter_vocab`` tokens (``tailrl.drafter.vocab``): no response exists
  yet, so the tokens of the run's prompts and answers, and the model's end-of-sequence ids,
  then the lowest ids.
- ``attach``: a ``DrafterBuffer`` as the engine speculator's collector and a ``SpotTrainer``
  as the engine's between-steps work, training a shadow of the drafter the engine drafts with;
  with a rollout pool, one of each per instance, in its worker (``PoolSpot``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from tailrl import LLM
from tailrl.drafter.buffer import DrafterBuffer
from tailrl.drafter.network import CONFIG_FILE, Drafter
from tailrl.drafter.pool_spot import PoolSpot
from tailrl.drafter.spot_trainer import STATE_FILE, SpotConfig, SpotTrainer
from tailrl.drafter.vocab import DRAFT_VOCAB, frequent_tokens
from tailrl.rl.config import TrainConfig

CHECKPOINT_SUBDIR = "drafter"      # inside a training checkpoint


def drafter_dir(cfg: TrainConfig, model_dir: str, resume_from: Path | None,
                data_tokens: Callable[[], list[int]] = list) -> str:
    """``data_tokens``: the run's prompts' and answers' tokens (asked only for a fresh drafter)."""
    if resume_from is not None:
        saved = resume_from / CHECKPOINT_SUBDIR
        if not (saved / CONFIG_FILE).is_file():
            raise ValueError(f"--resume: {resume_from} has no drafter; config key 'drafter' was off in that run")
        return str(saved)
    if cfg.drafter_init is not None:
        return cfg.drafter_init
    from tailrl.model.loader import load_model
    out = Path(cfg.output_dir) / "drafter_init"
    target = load_model(model_dir, "float32")
    size = DRAFT_VOCAB if cfg.drafter_vocab is None else cfg.drafter_vocab
    vocab = frequent_tokens(torch.tensor(data_tokens(), dtype=torch.long), target.args.vocab_size, size,
                            always=target.args.eos_token_ids)
    Drafter.for_target(target, cfg.drafter_size, vocab).save(str(out))
    return str(out)


def attach(llm: LLM, cfg: TrainConfig, resume_from: Path | None):
    """The spot trainer: over ``llm``'s engine, or one per instance of its rollout pool
    (``PoolSpot``: the same interface)."""
    # train once the buffer holds 4 batches' worth of windows (fewer: the same windows over and over)
    spot_cfg = SpotConfig(lr=cfg.drafter_lr, batch=cfg.drafter_batch, threshold=cfg.drafter_spot_batch,
                          max_share=cfg.drafter_spot_share, min_windows=4 * cfg.drafter_batch,
                          stream=cfg.drafter_spot_stream)
    saved = resume_from / CHECKPOINT_SUBDIR if resume_from is not None else None
    state = str(saved) if saved is not None and (saved / STATE_FILE).is_file() else None
    # a drafter that is never trained (no training inside rollouts: neither in the tail nor on
    # idle instances; none between rollout and update) needs no buffer: it drafts as it is, and
    # the engine hands out hidden states only where its calls pay
    inside = cfg.drafter_spot_batch > 0
    collect = inside or cfg.drafter_train_steps > 0
    args = (cfg.drafter_buffer, spot_cfg, cfg.seed, state, collect)
    if llm.pool is not None:
        return PoolSpot(llm.pool, spot_on_engine, args, idle=inside)
    return spot_on_engine(llm.engine, *args)


def spot_on_engine(engine, buffer_size: int, spot_cfg: SpotConfig, seed: int, state: str | None,
                   collect: bool = True) -> SpotTrainer:
    """A spot trainer of ``engine``'s drafter: its speculator collects the rollout's hidden
    states into a new buffer (unless not ``collect``), and it trains between the engine's
    steps (``idle_work``); ``state``: a checkpoint's drafter directory to restore the optimizer
    and version from. (A pool's workers call this in their own processes.)"""
    speculator = engine.speculator
    source = next(s for s in speculator.sources if s.name == "drafter")
    buffer = DrafterBuffer(buffer_size, source.drafter.fc.weight.device)    # the states stay on the engine's device
    spot = SpotTrainer(source.drafter, buffer, spot_cfg, seed=seed)
    if state is not None:
        spot.load(state)
    if collect:
        speculator.collector = buffer
    engine.idle_work = spot
    return spot
