"""The Ray backend: one actor per engine instance, on this machine or across a cluster.

Messages are actor method calls; arguments and replies go through Ray's object store, which
is how an exported request's K/V reaches another machine. A killed actor (or its node)
surfaces as `InstanceDied`, and the pool recomputes its requests elsewhere. Ray is an
optional extra (``pip install 'tailrl[ray]'``), imported only here.
"""
from __future__ import annotations

import logging
import os
import time
import traceback

from tailrl.config import EngineConfig, SpeculativeConfig
from tailrl.engine.tensor_parallel import RankLost
from tailrl.extras import require
from tailrl.rollout.backends import InstanceDied
from tailrl.rollout.worker import EngineWorker

log = logging.getLogger(__name__)


def _ray():
    return require("ray", "ray")


def actor_options(config: EngineConfig) -> dict:
    """Ray resources of one instance's actor: ``tensor_parallel_size`` GPUs of its own when the engine runs on CUDA (CPU
    threads are set by ``EngineConfig.num_threads``, not reserved as Ray CPU slots)."""
    return {"num_cpus": 0, "num_gpus": config.tensor_parallel_size if config.device.startswith("cuda") else 0}


class _Actor:
    """The actor body: an EngineWorker (Ray wraps this class with ray.remote)."""

    def __init__(self, config: EngineConfig, speculative: SpeculativeConfig | None) -> None:
        self.worker = EngineWorker(config, speculative)

    def handle(self, op: str, payload=None):
        try:
            return self.worker.handle(op, payload)
        except RankLost:        # its model split over ranks lost one: the actor dies, as if killed
            traceback.print_exc()
            os._exit(1)

    def pid(self) -> int:
        return os.getpid()


class RayInstance:
    def __init__(self, index: int, actor) -> None:
        self.index, self.actor, self.alive = index, actor, True
        self.ref = None
        self.pid: int | None = None

    def submit(self, op: str, payload=None) -> None:
        self.ref = self.actor.handle.remote(op, payload)

    def result(self):
        ray = _ray()
        ref, self.ref = self.ref, None
        try:
            return ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError) as e:
            self.alive = False
            raise InstanceDied(f"instance {self.index} (ray actor) died: {type(e).__name__}") from e

    def call(self, op: str, payload=None):
        self.submit(op, payload)
        return self.result()

    def kill(self) -> None:
        """Kill the actor (fault injection; what a lost node looks like to the pool)."""
        _ray().kill(self.actor, no_restart=True)

    def close(self) -> None:
        if self.alive:
            self.kill()
        self.alive = False


class RayBackend:
    def __init__(self, address: str | None = None) -> None:
        ray = _ray()
        t0 = time.perf_counter()
        if not ray.is_initialized():
            ray.init(address=address, include_dashboard=False, log_to_driver=False,
                     ignore_reinit_error=True)
        self.init_s = time.perf_counter() - t0
        self.remote = ray.remote(_Actor)

    def start(self, configs: list[EngineConfig], speculative: SpeculativeConfig | None) -> list[RayInstance]:
        """One actor per config (each with a GPU of its own where its device is CUDA)."""
        ray = _ray()
        t0 = time.perf_counter()
        n = len(configs)
        insts = [RayInstance(i, self.remote.options(**actor_options(c)).remote(c, speculative))
                 for i, c in enumerate(configs)]
        pids = ray.get([h.actor.pid.remote() for h in insts])   # waits for every actor's model
        for h, pid in zip(insts, pids):
            h.pid = pid
        self.start_s = time.perf_counter() - t0
        log.info("ray backend: init %.1f s, %d actors up in %.1f s", self.init_s, n, self.start_s)
        return insts

    def put(self, payload):
        """``payload`` in Ray's object store once, for a message to every actor (a reference
        passed to an actor's method arrives as its value; without it each call would store a
        copy: a model's weights once per instance)."""
        return _ray().put(payload)

    def wait(self, busy: list[RayInstance]) -> list[RayInstance]:
        ray = _ray()
        by_ref = {h.ref: h for h in busy}
        ready, _ = ray.wait(list(by_ref), num_returns=1)
        more, _ = ray.wait(list(by_ref), num_returns=len(by_ref), timeout=0)
        return [by_ref[r] for r in {*ready, *more}]
