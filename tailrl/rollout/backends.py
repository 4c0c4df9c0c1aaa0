"""Where the pool's engine instances live: in this process, or in local worker processes.

A backend starts `EngineWorker`s and carries their messages; it decides nothing. Every
instance handle has the same face: `submit(op, payload)` sends one message, `result()`
blocks for its reply, and the backend's `wait(handles)` returns the handles whose reply has
arrived. A dead instance (its process gone) raises `InstanceDied` from `result()`, and the
pool carries on without it. The Ray backend (one actor per instance) is in `ray_backend.py`.

A local worker process runs ``python -m tailrl.rollout.process_worker``, not a
`multiprocessing` fork or spawn: torch's thread pools do not survive a fork, and spawn re-runs
the caller's main script in every worker, which breaks scripts without an
``if __name__ == "__main__":`` guard (tailrl/programs.py). Messages go over a socket pair as
`multiprocessing.connection` messages, pickled by multiprocessing's pickler: torch tensors
travel through shared memory, which the worker may open because it shares this process's
`multiprocessing` authkey, as a spawned child would.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import subprocess
import sys
from multiprocessing.connection import wait as wait_connections

from tailrl import programs
from tailrl.config import EngineConfig, SpeculativeConfig
from tailrl.engine.tensor_parallel import RankLost
from tailrl.rollout.worker import EngineWorker

log = logging.getLogger(__name__)


class InstanceDied(RuntimeError):
    """An instance's process or actor is gone; what it held must be recomputed elsewhere."""


class InProcessInstance:
    """A worker in this process: `submit` runs the message at once (instances take turns)."""

    def __init__(self, index: int, config: EngineConfig, speculative: SpeculativeConfig | None) -> None:
        self.index, self.alive, self.pid = index, True, os.getpid()
        self.worker = EngineWorker(config, speculative)
        self._reply: tuple[bool, object] | None = None

    def submit(self, op: str, payload=None) -> None:
        try:
            self._reply = (True, self.worker.handle(op, payload))
        except RankLost as e:    # its model split over ranks lost one: the instance is lost
            self.alive = False
            self.worker.engine.close()
            self._reply = (False, InstanceDied(f"instance {self.index} died: {e}"))
        except Exception as e:   # surfaced by result(), like the other backends
            self._reply = (False, e)

    @property
    def ready(self) -> bool:
        return self._reply is not None

    def result(self):
        ok, value = self._reply
        self._reply = None
        if not ok:
            raise value
        return value

    def call(self, op: str, payload=None):
        self.submit(op, payload)
        return self.result()

    def close(self) -> None:
        self.alive = False


# how long a worker whose connection broke gets to exit before its exit status is read
DEATH_WAIT_S = 5.0


class ProcessInstance:
    """A worker in a local process of its own (its own torch threads)."""

    def __init__(self, index: int, config: EngineConfig, speculative: SpeculativeConfig | None) -> None:
        self.index, self.alive = index, True
        self.process, self.conn = programs.start("tailrl.rollout.process_worker")
        self.pid = self.process.pid
        # before any payload: the key tensors' shared memory is handed over with, and where
        # the classes it will unpickle come from
        self._send((bytes(mp.current_process().authkey), list(sys.path)))
        self._send((config, speculative))   # answered once the engine is built (LocalBackend.start)

    def _send(self, message) -> None:
        try:
            self.conn.send(message)
        except (BrokenPipeError, ConnectionResetError, OSError) as e:
            raise self._died() from e

    def submit(self, op: str, payload=None) -> None:
        self._send((op, payload))

    @property
    def ready(self) -> bool:
        return self.conn.poll()

    def result(self):
        try:
            ok, value = self.conn.recv()
        except (EOFError, ConnectionResetError, OSError) as e:
            raise self._died() from e
        if not ok:
            raise RuntimeError(f"instance {self.index} failed:\n{value}")
        return value

    def call(self, op: str, payload=None):
        self.submit(op, payload)
        return self.result()

    def _died(self) -> InstanceDied:
        """The process is gone (or going): collect it, then say how it ended."""
        self.alive = False
        try:
            code = self.process.wait(timeout=DEATH_WAIT_S)
        except subprocess.TimeoutExpired:
            code = None
            self.process.kill()
            self.process.wait()
        return InstanceDied(f"instance {self.index} (pid {self.pid}) died: {programs.describe_exit(code)}")

    def close(self) -> None:
        if self.alive:
            try:
                self.conn.send(("close", None))
            except OSError:
                pass
        self.alive = False
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.conn.close()


class LocalBackend:
    """One instance in this process, or one local process per instance."""

    def __init__(self, processes: bool) -> None:
        self.processes = processes

    def start(self, configs: list[EngineConfig], speculative: SpeculativeConfig | None) -> list:
        """One instance per config (instance i: ``configs[i]``)."""
        if not self.processes:
            return [InProcessInstance(i, c, speculative) for i, c in enumerate(configs)]
        insts = []
        try:
            for i, c in enumerate(configs):
                insts.append(ProcessInstance(i, c, speculative))
            for inst in insts:                  # they load the model in parallel
                inst.result()
        except BaseException:                   # no worker outlives a pool that never started
            for inst in insts:
                inst.close()
            raise
        return insts

    def put(self, payload):
        """A payload for a message to every instance, as it is (torch moves a tensor's storage into
        shared memory when it is first sent, and every local process maps that one copy)."""
        return payload

    def wait(self, busy: list) -> list:
        ready = [h for h in busy if h.ready]
        if ready or not self.processes:
            return ready
        conns = wait_connections([h.conn for h in busy])
        return [h for h in busy if h.conn in conns]
