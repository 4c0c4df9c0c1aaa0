"""TLT's spot trainer over a rollout pool: the drafter trained on the instances themselves.

Every instance gets its own ``SpotTrainer`` (built in its worker by ``factory(engine, *args)``),
fed by the rollouts that instance generates. Training happens where capacity is idle:
- inside the rollout, on an instance that has nothing to run and nothing the scheduler could
  give it (the pool's driver sends it one training step at a time, so a chunk that turns up
  waits for at most one step: `pool/idle_train_steps`), and, as on one engine, after an engine
  step whose batch is in the tail (within `drafter_spot_share`);
- between rollout and update, on every instance at once (``train(steps)``: each its share).
The instances then agree on one drafter: ``train`` ends by averaging their trainable weights
(each trained on its own data from the same start: local SGD) and publishing the average on
every instance as a new version, so the pool drafts with one drafter at every rollout.
Each instance keeps its own optimizer state; a checkpoint saves instance 0's with the average.
"""
from __future__ import annotations

import math
from typing import Any

import torch

# metrics that add up over instances (the others are averaged; versions agree after a sync)
SUMMED = ("drafter/train_steps", "drafter/spot_steps", "drafter/buffer_tokens", "timing_s/spot_train",
          "timing_s/drafter_train")


class PoolSpot:
    def __init__(self, pool: Any, factory, args: tuple, idle: bool = True) -> None:
        """``idle``: instances with nothing to run train (False: only ``train`` does)."""
        self.pool = pool
        pool.spot("setup", factory, *args)
        pool.idle_training = idle

    def reset_metrics(self) -> None:
        self.pool.spot("reset_metrics")

    def train(self, steps: int) -> int:
        """Up to ``steps`` training steps in all, split over the live instances and run in
        parallel; then one drafter for all (``sync``). Returns the steps run."""
        per = math.ceil(steps / len(self.pool.alive)) if steps > 0 else 0
        done = sum(self.pool.spot("train", per)) if per else 0
        if done or self.pool.idle_training:        # else no instance trained: nothing to average
            self.sync()
        return done

    def sync(self) -> None:
        """Average the instances' trainable drafter weights and publish the average on all."""
        parts = self.pool.spot("weights")
        if len(parts) > 1:
            avg = {k: sum(p[k] for p in parts) / len(parts) for k in parts[0]}
            self.pool.spot("set_weights", avg)

    def weights(self) -> dict[str, torch.Tensor]:
        """The first live instance's trainable drafter weights: the drafter every instance
        drafts with after a ``sync`` (``SpotTrainer.weights``)."""
        return self.pool.spot_first("weights")

    def metrics(self) -> dict[str, float]:
        """The instances' ``SpotTrainer.metrics``: counts and times summed, loss and agreement
        averaged over all their training steps, the newest version, the longest spot step."""
        parts = self.pool.spot("metrics")
        steps = sum(p["drafter/train_steps"] for p in parts)
        out = {k: sum(p[k] for p in parts) for k in SUMMED}
        for k in ("drafter/loss", "drafter/agreement"):
            out[k] = sum(p[k] * p["drafter/train_steps"] for p in parts) / steps if steps else 0.0
        out["drafter/version"] = max(p["drafter/version"] for p in parts)
        out["timing_s/spot_step_max"] = max(p["timing_s/spot_step_max"] for p in parts)
        return out

    def save(self, path: str) -> None:
        """The averaged drafter with the first live instance's optimizer (written by its
        worker: on a Ray cluster the path must be on storage the driver's node shares)."""
        self.sync()
        self.pool.spot_first("save", path)
