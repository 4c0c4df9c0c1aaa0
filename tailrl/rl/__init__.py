"""GRPO training with accelerated rollouts: ``tailrl train CONFIG.yaml``, or from Python
``tailrl.rl.train("configs/demo.yaml")`` / ``Trainer(TrainConfig(...)).train()``."""
from __future__ import annotations

from tailrl.rl.config import TrainConfig, load_config
from tailrl.rl.grpo import group_advantages, grpo_loss

__all__ = ["TrainConfig", "load_config", "group_advantages", "grpo_loss", "train"]


def train(config: TrainConfig | str, overrides: list[str] | None = None, resume: bool = False,
          reward_fn=None) -> list[dict[str, float]]:
    """Run (or resume) a training run; returns the metrics of the steps run. ``config`` is a
    TrainConfig or a YAML path; ``overrides`` are ``key=value`` strings for a YAML path."""
    from tailrl.rl.trainer import Trainer  # torch + engine: imported on use

    cfg = config if isinstance(config, TrainConfig) else load_config(config, overrides)
    return Trainer(cfg, reward_fn=reward_fn, resume=resume).train()
