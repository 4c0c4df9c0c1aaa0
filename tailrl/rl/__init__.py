"""GRPO training with accelerated rollouts: ``Trainer(TrainConfig(...)).train()`` or
``tailrl train CONFIG.yaml``."""
from tailrl.rl.config import TrainConfig, load_config
from tailrl.rl.grpo import group_advantages, grpo_loss

__all__ = ["TrainConfig", "load_config", "group_advantages", "grpo_loss"]
