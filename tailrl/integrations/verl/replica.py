"""``TailRLReplica``: verl's ``RolloutReplica`` for ``rollout.name=tailrl``.

verl builds one replica per ``tensor x data x pipeline`` parallel group of its rollout world
and asks it to launch its servers in one of three modes (hybrid: in the trainer's workers;
colocated; standalone: a resource pool of its own). tailrl runs on CPU cores, needs no GPU
placement or CUDA IPC, and shards nothing, so every mode launches the same thing: one Ray actor
per replica (``TailRLServer``, named ``tailrl_server_<rank><suffix>`` so the trainer-side
``ServerAdapter`` finds it for weight updates) with ``num_cpus=0``: its torch threads follow
``engine_kwargs.tailrl.num_threads`` (default: the driver's available cores, passed as
``OMP_NUM_THREADS``, since Ray sets 1 for an actor without CPU slots) and tailrl's thread
governor, not Ray's CPU slots.
"""
from __future__ import annotations

import asyncio

import ray
from verl.workers.rollout.replica import RolloutMode, RolloutReplica

from tailrl.integrations.verl.server import TailRLServer
from tailrl.threads import available_cores


def server_name(replica_rank: int, suffix: str = "") -> str:
    return f"tailrl_server_{replica_rank}{suffix}"


class TailRLReplica(RolloutReplica):
    async def init_hybrid(self, worker_group) -> None:
        self.rollout_mode = RolloutMode.HYBRID
        self.workers = worker_group.workers[self.world_size * self.replica_rank:
                                            self.world_size * (self.replica_rank + 1)]
        await self.launch_servers()

    async def init_hybrid_colocated(self, worker_group, resource_pool) -> None:
        await self.init_hybrid(worker_group)

    async def init_colocated(self, resource_pool) -> None:
        self.rollout_mode = RolloutMode.COLOCATED
        await self.launch_servers()

    async def init_standalone(self) -> None:
        self.rollout_mode = RolloutMode.STANDALONE
        await self.launch_servers()

    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def launch_servers(self) -> None:
        # Ray gives an actor without CPU slots OMP_NUM_THREADS=1: the engine would run one thread
        threads = (self.config.engine_kwargs or {}).get("tailrl", {}).get("num_threads") or available_cores()
        actor = ray.remote(TailRLServer).options(
            name=server_name(self.replica_rank, self.name_suffix), num_cpus=0,
            max_concurrency=self.max_concurrency, runtime_env={"env_vars": {"OMP_NUM_THREADS": str(threads)}})
        server = actor.remote(self.config, self.model_config, self.replica_rank)
        host, port = await server.get_server_address.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    async def update_weights(self, state_dict: dict, global_steps: int | None = None) -> None:
        """Send new weights (Hugging Face names) to every server of the replica (one copy in
        Ray's object store, no disk)."""
        ref = ray.put(state_dict)
        await asyncio.gather(*[s.update_weights.remote(ref, global_steps) for s in self.servers])
