"""``ServerAdapter``: the trainer-side handle verl's actor workers hold for ``rollout.name=tailrl``.

In verl's colocated ("naive") weight sync, each actor worker process builds
``get_rollout_class(name, "async")`` and, after every optimizer step, calls ``release()``
(rollout asleep while training), ``update_weights(<(name, tensor) generator>)`` and
``resume()``. Every rank walks the generator (gathering a sharded tensor is collective); the
first rank of each replica's rollout group copies the tensors to the CPU and sends them in
buckets (verl's ``update_weights_bucket_megabytes``) through Ray's object store (no disk) to its
replica's ``TailRLServer``, which loads each between two engine steps. The rank arithmetic is
verl's: replica = rank // rollout world size.
"""
from __future__ import annotations

import os

import ray
import torch
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.utils import ensure_async_iterator

from tailrl.integrations.verl.replica import server_name

DEFAULT_BUCKET_MB = 2048           # verl's own default


class ServerAdapter(BaseRollout):
    def __init__(self, config, model_config, device_mesh=None, replica_rank: int = -1, **unused) -> None:
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", 0))
        world = (self.config.tensor_model_parallel_size * self.config.data_parallel_size
                 * self.config.pipeline_model_parallel_size)
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        self.is_leader_rank = rank % world == 0
        self._server = None

    def server(self):
        if self._server is None:
            self._server = ray.get_actor(server_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]) -> None:
        if self.is_leader_rank:
            await self.server().wake_up.remote(tags=tags)

    async def release(self) -> None:
        if self.is_leader_rank:
            await self.server().sleep.remote()

    @torch.no_grad()
    async def update_weights(self, weights, global_steps: int | None = None,
                             wire_format: str = "named_tensors", peft_config=None, **unused) -> None:
        """Every rank walks ``weights`` (a generator or async iterator of (name, tensor));
        the leader sends them in buckets of ``checkpoint_engine.update_weights_bucket_megabytes``
        (verl's knob), each loaded as it arrives, so the host holds one bucket, not the model.
        A LoRA policy's weights come merged (``model.lora.merge=True``); verl's separate
        adapters (``peft_config``) are refused on every rank alike, before any is read."""
        if wire_format != "named_tensors":
            raise ValueError(f"tailrl takes wire_format='named_tensors' only, got {wire_format!r}")
        if peft_config is not None:
            raise ValueError("tailrl takes a LoRA policy's merged weights: set actor_rollout_ref.model.lora.merge=True "
                             "(verl then sends whole Hugging Face tensors); separate adapters are not loaded")
        limit = bucket_bytes(self.config)
        bucket, size = [], 0
        async for name, tensor in ensure_async_iterator(weights):
            if not self.is_leader_rank:
                continue
            if bucket and size + tensor.numel() * tensor.element_size() > limit:
                await self.server().update_weights.remote(ray.put(bucket), global_steps, done=False)
                bucket, size = [], 0
            bucket.append((name, tensor.detach().to("cpu", copy=True)))
            size += tensor.numel() * tensor.element_size()
        if self.is_leader_rank:
            await self.server().update_weights.remote(ray.put(bucket), global_steps, done=True)


def bucket_bytes(config) -> int:
    """The bytes of one bucket of a weight update: verl's ``update_weights_bucket_megabytes``."""
    engine = getattr(config, "checkpoint_engine", None)
    return int(getattr(engine, "update_weights_bucket_megabytes", DEFAULT_BUCKET_MB)) << 20
