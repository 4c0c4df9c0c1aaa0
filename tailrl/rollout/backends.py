"""Where the pool's engine instances live: in this process, or in local worker processes.

A backend starts `EngineWorker`s and carries their messages; it decides nothing. Every
instance handle has the same face: `submit(op, payload)` sends one message, `result()`
blocks for its reply, and the backend's `wait(handles)` returns the handles whose reply has
arrived. A dead instance (its process gone) raises `InstanceDied` from `result()`, and the
pool carries on without it. The Ray backend (one actor per instance) is in `ray_backend.py`.

Local worker processes are spawned, not forked: torch's thread pools do not survive a fork.
Messages go over `multiprocessing` pipes (pickled; tensors travel by value).
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import traceback
from multiprocessing.connection import Connection, wait as wait_connections

from tailrl.config import EngineConfig, SpeculativeConfig
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


def _serve(conn: Connection, config: EngineConfig, speculative: SpeculativeConfig | None) -> None:
    """Main loop of a local worker process: one reply per message, errors sent back as text."""
    try:
        worker = EngineWorker(config, speculative)
        conn.send((True, None))
    except Exception:
        conn.send((False, traceback.format_exc()))
        return
    while True:
        try:
            op, payload = conn.recv()
        except EOFError:
            return
        if op == "close":
            return
        try:
            conn.send((True, worker.handle(op, payload)))
        except Exception:
            conn.send((False, traceback.format_exc()))


class ProcessInstance:
    """A worker in a local process of its own (spawned; its own torch threads)."""

    def __init__(self, index: int, config: EngineConfig, speculative: SpeculativeConfig | None) -> None:
        self.index, self.alive = index, True
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, config, speculative), daemon=True,
                                   name=f"tailrl-instance-{index}")
        self.process.start()
        child.close()
        self.pid = self.process.pid

    def submit(self, op: str, payload=None) -> None:
        try:
            self.conn.send((op, payload))
        except (BrokenPipeError, ConnectionResetError, OSError) as e:
            self.alive = False
            raise InstanceDied(f"instance {self.index} (pid {self.pid}) is gone: {e}") from e

    @property
    def ready(self) -> bool:
        return self.conn.poll()

    def result(self):
        try:
            ok, value = self.conn.recv()
        except (EOFError, ConnectionResetError, OSError) as e:
            self.alive = False
            raise InstanceDied(f"instance {self.index} (pid {self.pid}) died "
                               f"(exit code {self.process.exitcode})") from e
        if not ok:
            raise RuntimeError(f"instance {self.index} failed:\n{value}")
        return value

    def call(self, op: str, payload=None):
        self.submit(op, payload)
        return self.result()

    def close(self) -> None:
        if self.alive:
            try:
                self.conn.send(("close", None))
            except OSError:
                pass
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
        self.alive = False


class LocalBackend:
    """One instance in this process, or one local process per instance."""

    def __init__(self, processes: bool) -> None:
        self.processes = processes

    def start(self, config: EngineConfig, speculative: SpeculativeConfig | None, n: int) -> list:
        if not self.processes:
            return [InProcessInstance(i, config, speculative) for i in range(n)]
        insts = [ProcessInstance(i, config, speculative) for i in range(n)]
        for inst in insts:                      # they load the model in parallel
            inst.result()
        return insts

    def wait(self, busy: list) -> list:
        ready = [h for h in busy if h.ready]
        if ready or not self.processes:
            return ready
        conns = wait_connections([h.conn for h in busy])
        return [h for h in busy if h.conn in conns]
