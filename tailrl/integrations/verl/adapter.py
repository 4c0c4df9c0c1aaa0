"""``ServerAdapter``: the trainer-side handle verl's actor workers hold for ``rollout.name=tailrl``.

In verl's colocated ("naive") weight sync, each actor worker process builds
``get_rollout_class(name, "async")`` and, after every optimizer step, calls ``release()``
(rollout asleep while training), ``update_weights(<(name, tensor) generator>)`` and
``resume()``. Every rank walks the generator (gathering a sharded tensor is collective); the
first rank of each replica's rollout group copies the tensors to the CPU and sends them, in one
object through Ray's object store (no disk), to its replica's ``TailRLServer``, which loads them
between two engine steps. The rank arithmetic is verl's: replica = rank // rollout world size.
"""
from __future__ import annotations

import os

import ray
import torch
from verl.workers.rollout.base import BaseRollout

from tailrl.integrations.verl.replica import server_name


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
                             wire_format: str = "named_tensors", **unused) -> None:
        if wire_format != "named_tensors":
            raise ValueError(f"tailrl takes wire_format='named_tensors' only, got {wire_format!r}")
        state = {}
        for name, tensor in weights:
            if self.is_leader_rank:
                state[name] = tensor.detach().to("cpu", copy=True)
        if self.is_leader_rank:
            await self.server().update_weights.remote(ray.put(state), global_steps)
