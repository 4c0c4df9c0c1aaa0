"""Tensor parallelism: one engine's model split over ``tensor_parallel_size`` devices
(model/parallel.py: the part each rank holds, and the sums across ranks).

Rank 0 is the engine's own process: it schedules, speculates, samples and verifies as without
tensor parallelism, on its part of the model and of the K/V pool (``ParallelModel``;
kv/mirrored.py), and computes the logits (the LM head is whole there). Every other rank is a
program of its own (rank_worker.py), one per device (CUDA: the devices after the engine's;
CPU: the same cores), holding its part of the model and of the K/V pool: the same blocks, its
K/V heads. It runs every forward rank 0 runs, in the same order, each sent as one message on a
socket pair (the step's integer inputs as numpy arrays), after the K/V copies rank 0 made since
the last message. Activations cross ranks in each layer's two sums (``OrderedSum``: gloo on
CPUs, NCCL on GPUs). A request's K/V leaving or joining the engine (a rollout pool's
migrations) is gathered from or scattered over every rank's heads; a weight update is cut into
every rank's parts by rank 0.

Not yet: CUDA graphs (a split engine's forwards run eagerly), the learned drafter, a
vocabulary-parallel LM head.
"""
from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import time
import weakref
from collections.abc import Mapping

import numpy as np
import torch
import torch.distributed as dist

from tailrl import programs
from tailrl.config import EngineConfig
from tailrl.engine.kv.mirrored import MirroredKV
from tailrl.engine.rank_worker import TIMEOUT, moved, process_group, rank_device
from tailrl.model.args import ModelArgs
from tailrl.model.hf_names import pairs_of
from tailrl.model.loader import DTYPES, load_model, read_args
from tailrl.model.parallel import OrderedSum, Shard, shard_args, shard_tensor
from tailrl.model.transformer import Transformer

log = logging.getLogger(__name__)


class RankLost(RuntimeError):
    """A rank of a split engine failed or is gone: the engine cannot step any more (a rollout
    pool takes its instance as lost and runs its requests elsewhere)."""


def check_devices(device: str, size: int) -> None:
    d = torch.device(device)
    if d.type == "cuda" and (d.index or 0) + size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size: {size} devices from {device} are needed, "
                         f"{torch.cuda.device_count()} are visible")


def parallel_args(config: EngineConfig, args: ModelArgs, speculative) -> ModelArgs:
    """The shape of each rank's part of the model, or a ValueError naming ``tensor_parallel_size``
    (the devices, the model's split, a learned drafter), before any process starts."""
    size = config.tensor_parallel_size
    check_devices(config.device, size)
    if speculative is not None and getattr(speculative, "drafter", None) is not None:
        raise ValueError(f"tensor_parallel_size: {size} is not supported with a learned drafter yet "
                         "(speculative drafter); use method 'suffix'")
    return shard_args(args, size)


def _compact(t: torch.Tensor) -> torch.Tensor:
    """A host copy holding only ``t``'s elements (a pickled view would carry its whole storage)."""
    return torch.empty(t.shape, dtype=t.dtype).copy_(t)


def _array(t: torch.Tensor) -> np.ndarray:
    """A step's integer tensor as a numpy copy: pickled in microseconds where a tensor takes ~100."""
    return t.numpy(force=True).copy()


class ParallelModel:
    """Rank 0's side, used by the engine as a Transformer (``__call__``, ``logits``, ``args``:
    its own part's shape); ``load_weights`` checks names and shapes against the whole model and
    sends each rank its parts."""

    def __init__(self, config: EngineConfig, max_len: int, budget: int):
        self.size, self.conns, self.procs = config.tensor_parallel_size, [], []
        self.whole = read_args(config.model)
        with torch.device("meta"):
            self.table = Transformer(self.whole, 1, DTYPES[config.dtype], "meta")   # names and shapes
        store = dist.TCPStore("127.0.0.1", 0, self.size, True, timeout=TIMEOUT, wait_for_workers=False)
        for rank in range(1, self.size):
            proc, conn = programs.start("tailrl.engine.rank_worker")
            self.procs.append(proc)
            self.conns.append(conn)
            for msg in (list(sys.path), (rank, store.port, config, max_len, budget)):
                conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
        self._stop = weakref.finalize(self, _stop, self.conns, self.procs)
        try:
            self.replies()                                  # every rank is up before any joins the group
            device = rank_device(config.device, 0)
            self.group = process_group(store, 0, self.size, device)
            self.local = load_model(config.model, config.dtype, device, max_len, Shard(0, self.size),
                                    OrderedSum(self.group, self.size))
            self.local.prepare_kernels()
            self.replies()                                  # every rank holds its part
        except BaseException:
            self.close()
            raise
        self.store = store                                   # rank 0 holds the group's store
        self.forwards, self.message_s = 0, 0.0               # forwards sent, and the host time it took
        self.args = self.local.args
        self.kv: MirroredKV | None = None
        log.info("tensor parallelism: %s split over %d ranks on %s (rank 0 pid %d, others %s)",
                 config.model, self.size, ", ".join(rank_device(config.device, r) for r in range(self.size)),
                 os.getpid(), [p.pid for p in self.procs])

    def kv_cache(self, *args, **kwargs) -> MirroredKV:
        """Rank 0's K/V pool (``KVCache``'s arguments), whose copies the other ranks repeat."""
        self.kv = MirroredKV(*args, ranks=self, **kwargs)
        return self.kv

    # ---- messages ---------------------------------------------------------------------------
    def _copies(self) -> list[tuple]:
        """The K/V pool's copies since the last message, its tensors as numpy arrays."""
        ops = self.kv.take_ops() if self.kv is not None else []
        return [(op, *(_array(x) if isinstance(x, torch.Tensor) else x for x in a)) for op, *a in ops]

    def send(self, msg: tuple) -> None:
        """``msg`` to every other rank, after the pool's copies they have not made yet."""
        self.send_each([msg] * (self.size - 1))

    def send_each(self, msgs: list[tuple]) -> None:
        """``msgs[r - 1]`` to rank r, after the pool's copies they have not made yet."""
        copies = self._copies()
        data = pickle.dumps(("copies", copies), protocol=pickle.HIGHEST_PROTOCOL) if copies else b""
        for conn, msg in zip(self.conns, msgs):
            try:
                if data:
                    conn.send_bytes(data)
                conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
            except OSError as e:                # its process is gone
                self._failed(e)

    def replies(self) -> list:
        """Every worker's answer to the last message, or RankLost with a failed one's traceback."""
        out = []
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs), 1):
            while not conn.poll(0.2):
                if proc.poll() is not None:
                    raise _gone(rank, proc)
            try:
                kind, value = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError) as e:
                raise _gone(rank, proc) from e
            if kind == "error":
                raise RankLost(f"tensor parallelism: rank {rank} failed:\n{value}")
            out.append(value)
        return out

    def _failed(self, error: BaseException) -> None:
        """A message or a collective failed (``error``): RankLost with the worker's own error where
        it sent one, else which rank's process is gone, else ``error``."""
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs), 1):
            try:
                kind, value = pickle.loads(conn.recv_bytes()) if conn.poll(1.0) else (None, None)
            except (EOFError, OSError):
                kind = None
            if kind == "error":
                raise RankLost(f"tensor parallelism: rank {rank} failed:\n{value}") from error
            if proc.poll() is not None:
                raise _gone(rank, proc) from error
        raise RankLost(f"tensor parallelism: {error}") from error

    # ---- what the engine calls ----------------------------------------------------------------
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, caches, meta) -> torch.Tensor:
        t0 = time.perf_counter()                            # the step's tensors go as numpy arrays
        sent = moved(meta, _array)
        if sent.states is not None:                         # recurrent layers' plan: host arrays
            sent.states = sent.states.portable()
        self.send(("forward", _array(input_ids), _array(positions), sent))
        self.forwards, self.message_s = self.forwards + 1, self.message_s + time.perf_counter() - t0
        try:
            return self.local(input_ids, positions, caches, meta)
        except RuntimeError as e:
            self._failed(e)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.local.logits(hidden)

    def advance_states(self, states, plan, runs) -> None:
        """Accepted draft nodes into every rank's recurrent states (each rank's own heads, from
        the inputs its last forward kept)."""
        self.send(("accept", runs))
        self.local.advance_states(states, plan, runs)

    def prepare_kernels(self) -> None:
        self.local.prepare_kernels()

    def weight_names(self) -> list[str]:
        return self.table.weight_names()

    def check_weights(self, shapes, complete: bool) -> set[str]:
        return self.table.check_weights(shapes, complete)

    def load_weights(self, weights, complete: bool) -> set[str]:
        """Hugging Face tensors of the whole model into every rank's part: a mapping or a list
        checked whole (names and shapes) before anything is copied, an iterator one tensor at a
        time. Returns the checkpoint names written."""
        pairs = pairs_of(weights)
        if complete or isinstance(weights, (Mapping, list, tuple)):
            pairs = list(pairs)
            written = self.check_weights([(n, t.shape) for n, t in pairs], complete)
            self._load(pairs)
            return written
        written = set()
        for name, t in pairs:
            written |= self.check_weights([(name, t.shape)], False)
            self._load([(name, t)])
        return written

    def _load(self, pairs: list) -> None:
        self.send_each([("load", [(n, _compact(shard_tensor(n, t, self.whole, Shard(rank, self.size))))
                                  for n, t in pairs]) for rank in range(1, self.size)])
        self.local.load_weights([(n, shard_tensor(n, t, self.whole, Shard(0, self.size))) for n, t in pairs],
                                complete=False)
        self.replies()

    def close(self) -> None:
        """Stop the other ranks' processes."""
        self._stop()


def _gone(rank: int, proc: subprocess.Popen) -> RankLost:
    try:
        code = proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        code = None
    return RankLost(f"tensor parallelism: rank {rank} (pid {proc.pid}) {programs.describe_exit(code)}")


def _stop(conns, procs) -> None:
    for c in conns:
        try:
            c.send_bytes(pickle.dumps(("stop",)))
        except OSError:
            pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for c in conns:
        c.close()
