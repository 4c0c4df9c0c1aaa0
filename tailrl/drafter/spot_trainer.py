"""TLT's spot trainer: the learned drafter trained online, on the rollout's own hidden states,
on capacity the rollout leaves idle.

Data: a ``DrafterBuffer`` (tailrl/drafter/buffer.py) set as the engine speculator's
``collector`` receives the hidden states of every position of every running and finished
request, prompt included (the drafter attends over them); the target computed them anyway.

When: the engine calls ``after_step(batch_size)`` between steps (``engine.idle_work``). Below
``threshold`` running requests (the tail: the batch has drained and the machine idles on a
small batch) it runs **one** training step, so a rollout step never waits for more than one
drafter step (preemptible at step granularity; ``batch`` bounds a step's cost), and only
while the training time stays within ``max_share`` of the rollout's time so far: on a CPU
the trainer and the engine share the cores, so the tail is not free capacity (measured on the
`small` model: a training step of 256 positions, unrolled 3 steps, takes about 45 ms, an
engine step at batch 1 about 2 ms). The GRPO loop also calls ``train(steps)`` between
rollout and update.

Versions: training updates a ``shadow`` copy; ``publish`` copies it into the drafter the
engine drafts with and bumps ``version``. Both run between engine steps (the engine calls
``after_step`` after a step's last use of the drafter), so every step drafts with exactly one
version and never with half-written weights; a new version is used from the next step.
Drafts are verified, so outputs do not depend on the drafter or on training at all.

Where (``SpotConfig.stream``): ``"between"`` (the default) runs the training step between two
engine steps and waits for it (on a GPU too: its time is then the rollout's). ``"side"`` (a
drafter on a CUDA device) queues it on a stream of its own (side_stream.py) and returns: the
rollout's next steps are launched at once and share the GPU with it. A later ``after_step``
that finds it finished queues its weights' copy into the drafter on the rollout's stream
(published between steps, as above) and may start the next; at most one training step is in
flight. Then ``timing_s/spot_train`` counts the host's time to queue the steps; what sharing
the device costs the rollout's steps is the rollout's own time (benchmarks/drafter_online.py
compares). Nothing in a training step reads a value back from the device (``drafter_loss``
indexes the positions that count with indices built on the host), so queueing it never waits.

Departures from TLT: training runs in the rollout's process, interleaved with engine steps
or beside them on the same GPU, not on separate idle GPUs; between steps it costs wall time
(measured: ``timing_s/spot_train``).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from tailrl.config import SPOT_STREAMS
from tailrl.drafter.buffer import DrafterBuffer
from tailrl.drafter.network import Drafter
from tailrl.drafter.side_stream import SideStream
from tailrl.drafter.train import drafter_loss, sample_batch

STATE_FILE = "spot_trainer.pt"
BUFFER_FILE = "buffer.safetensors"     # the training buffer (``DrafterBuffer.save``)


@dataclass
class SpotConfig:
    lr: float = 1e-4            # fine-tuning: 1e-3 measured to undo a warm start's first steps
    batch: int = 256            # positions per step (bounds one step's time): sequence crops
    unroll: int = 3             # drafter steps trained on its own features (as the warm start)
    threshold: int = 8          # train inside a rollout while fewer requests than this run
    max_share: float = 0.03     # inside a rollout, train only while the training time stays
                                # below this share of the rollout's time so far (1 = no limit)
    min_windows: int = 256      # train only once the buffer holds this many draft roots
    publish_every: int = 1      # training steps between published versions
    stream: str = "between"     # inside a rollout: "between" its steps, waited for; "side": queued
                                # on a CUDA stream of its own beside them (module docstring)

    def __post_init__(self) -> None:
        if self.stream not in SPOT_STREAMS:
            raise ValueError(f"spot trainer: stream must be one of {SPOT_STREAMS}, got {self.stream!r}")
        for key in ("batch", "unroll", "min_windows", "publish_every"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"spot trainer: {key} must be an integer >= 1, got {v!r}")
        if not isinstance(self.threshold, int) or self.threshold < 0:
            raise ValueError(f"spot trainer: threshold must be an integer >= 0, got {self.threshold!r}")
        if not 0 < self.max_share <= 1:
            raise ValueError(f"spot trainer: max_share must be in (0, 1], got {self.max_share!r}")
        if not 0 < self.lr < 1:
            raise ValueError(f"spot trainer: lr must be in (0, 1), got {self.lr!r}")


class SpotTrainer:
    """``drafter``: the one the engine drafts with (never trained in place). ``lane``: where
    ``stream="side"`` queues its steps (default: a ``SideStream`` on the drafter's GPU)."""

    def __init__(self, drafter: Drafter, buffer: DrafterBuffer, config: SpotConfig | None = None, seed: int = 0,
                 lane=None):
        self.drafter = drafter
        self.buffer = buffer
        self.config = config or SpotConfig()
        dev = drafter.fc.weight.device
        if self.config.stream == "side" and lane is None:
            if dev.type != "cuda":
                raise ValueError(f"spot trainer: stream='side' needs a drafter on a CUDA device, got {dev}")
            lane = SideStream(dev)
        self.lane = lane if self.config.stream == "side" else None
        self._queued = False                   # a step on the side stream, not yet landed
        self.shadow = drafter.shadow().train()
        self.optimizer = torch.optim.AdamW(list(self.shadow.parameters()), lr=self.config.lr, weight_decay=0.0)
        self.gen = torch.Generator().manual_seed(seed)
        self.version = 0
        self.steps = 0                 # training steps ever
        self._unpublished = 0
        self._step_s = 0.0             # the last training step's seconds
        self.reset_metrics()

    # ---- the engine's hook ------------------------------------------------------------
    def after_step(self, batch_size: int) -> None:
        """Between engine steps: one training step if the batch is in the tail and the step is
        expected to keep the training time within ``max_share`` of the time since
        ``reset_metrics`` (the trainer calls it before each rollout)."""
        if self._queued:
            if not self.lane.done():           # still training beside the rollout: nothing more now
                return
            self._land()
        if batch_size >= self.config.threshold:
            return
        budget = self.config.max_share * (time.perf_counter() - self._t0)
        if self._m_spot_s + self._step_s <= budget and self.train_step(spot=True):
            self._m_spot_steps += 1

    def _land(self) -> None:
        """The step on the side stream finished: the rollout's stream waits for it (on the
        device) and, if due, its weights are published."""
        self.lane.join()
        self._queued = False
        if self._unpublished >= self.config.publish_every:
            self.publish()

    def sync(self) -> None:
        """Wait for a step on the side stream, if any, and land it (before the host reads the
        shadow, the optimizer or the metrics)."""
        if self._queued:
            self.lane.wait()
            self._land()

    # ---- training ---------------------------------------------------------------------
    def train(self, steps: int) -> int:
        """Up to ``steps`` training steps now (between rollout and update); publishes at the
        end. Returns the steps run (0 while the buffer is too small)."""
        self.sync()
        done = 0
        while done < steps and self.train_step():
            done += 1
        if self._unpublished:
            self.publish()
        return done

    def train_step(self, spot: bool = False) -> bool:
        """One AdamW step of the shadow on a random batch of sequence crops; False when the
        buffer has fewer than ``min_windows`` draft roots."""
        cfg = self.config
        data = self.buffer.data(cfg.unroll)
        if data is None or data.windows(cfg.unroll) < cfg.min_windows:
            return False
        t0 = time.perf_counter()
        batch = sample_batch(data, cfg.batch, self.gen, self.shadow.fc.weight.device)

        def step() -> None:
            loss, agree = drafter_loss(self.shadow, batch, cfg.unroll)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(self.shadow.parameters()), 1.0)
            self.optimizer.step()
            self._m_loss.append(loss.detach())
            self._m_agree.append(agree)
        side = spot and self.lane is not None
        if side:
            self.lane.launch(step, [batch.hidden, batch.tokens, batch.lengths, batch.first])
            self._queued = True
        else:
            step()
            self._m_loss[-1].item()                  # waits for the step: its time is the rollout's
        self.steps += 1
        self._unpublished += 1
        if not side and self._unpublished >= cfg.publish_every:
            self.publish()
        dt = time.perf_counter() - t0
        self._step_s = dt                            # the next step's expected cost
        self._m_steps += 1
        if spot:
            self._m_spot_s += dt
            self._m_spot_max = max(self._m_spot_max, dt)
        else:
            self._m_idle_s += dt
        return True

    def publish(self) -> None:
        """The shadow's weights become the engine's drafter: a new version."""
        self.drafter.copy_weights_from(self.shadow)
        self.version += 1
        self._unpublished = 0

    def weights(self) -> dict[str, torch.Tensor]:
        """The shadow's trainable weights (the newest), detached copies."""
        self.sync()
        return {k: v.detach().clone() for k, v in self.shadow.named_parameters()}

    def set_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Overwrite the shadow's trainable weights (same names and shapes) and publish them: a
        pool of instances training apart agrees on one drafter this way."""
        self.sync()
        with torch.no_grad():
            for k, p in self.shadow.named_parameters():
                p.copy_(weights[k])
        self.publish()

    # ---- metrics ------------------------------------------------------------------------
    def reset_metrics(self) -> None:
        """Start counting (and budgeting spot training) afresh: call before each rollout."""
        self._t0 = time.perf_counter()
        self._m_steps = self._m_spot_steps = 0
        self._m_loss: list[torch.Tensor] = []      # per step, on the device (read in ``metrics``)
        self._m_agree: list[torch.Tensor] = []
        self._m_spot_s = self._m_idle_s = self._m_spot_max = 0.0

    def metrics(self) -> dict[str, float]:
        """Since ``reset_metrics``: ``drafter/train_steps``, ``drafter/spot_steps`` (inside the
        rollout), ``drafter/loss`` and ``drafter/agreement`` (mean over the steps; first-step
        top-1 agreement with the target on training windows), ``drafter/version``,
        ``drafter/buffer_tokens``, ``timing_s/spot_train`` (training inside the rollout; on the
        side stream, the host's time to queue it), ``timing_s/spot_step_max`` (the longest of
        those steps: the most a rollout step waited for training), ``timing_s/drafter_train``
        (training between rollout and update). Waits for a step on the side stream."""
        self.sync()
        n = max(self._m_steps, 1)
        mean = lambda xs: float(torch.stack(xs).sum().item()) / n if xs else 0.0   # noqa: E731
        return {"drafter/train_steps": float(self._m_steps), "drafter/spot_steps": float(self._m_spot_steps),
                "drafter/loss": mean(self._m_loss), "drafter/agreement": mean(self._m_agree),
                "drafter/version": float(self.version), "drafter/buffer_tokens": float(len(self.buffer)),
                "timing_s/spot_train": self._m_spot_s, "timing_s/spot_step_max": self._m_spot_max,
                "timing_s/drafter_train": self._m_idle_s}

    # ---- checkpoint ---------------------------------------------------------------------
    def save(self, path: str) -> None:
        """The shadow (the newest weights) as a deployable drafter checkpoint, plus the
        optimizer, counters, batch sampler and the buffer: everything the next training step
        reads, so a resumed run trains exactly as the uninterrupted one (a cold buffer would
        wait for ``min_windows`` and then train on other data). Saving the buffer costs its
        size on disk (the target's dtype per state; measured in docs/training.md)."""
        self.sync()
        self.shadow.save(path)
        torch.save({"optimizer": self.optimizer.state_dict(), "version": self.version, "steps": self.steps,
                    "gen": self.gen.get_state()}, f"{path}/{STATE_FILE}")
        self.buffer.save(f"{path}/{BUFFER_FILE}")

    def load(self, path: str) -> None:
        """Restore what ``save`` wrote (the drafter's weights were loaded from ``path`` too); a
        checkpoint written before buffers were saved leaves the buffer empty."""
        self.sync()
        state = torch.load(f"{path}/{STATE_FILE}", weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.version, self.steps = state["version"], state["steps"]
        self.gen.set_state(state["gen"])
        if os.path.isfile(f"{path}/{BUFFER_FILE}"):
            self.buffer.load(f"{path}/{BUFFER_FILE}")
