"""The program of a tensor-parallel rank other than 0: ``python -m tailrl.engine.rank_worker FD``
(started by tensor_parallel.py through tailrl/programs.py).

Messages on its socket pair, each a pickled tuple: first rank 0's ``sys.path``, then
``(rank, store port, EngineConfig, max_len, K/V budget in tokens)``; then, one at a time,
``("copies", [K/V pool copies])``, ``("forward", ids, positions, AttentionMeta)``,
``("export", block ids, length)``, ``("import", block ids, K/V part)``,
``("load", [(name, part)])``, ``("free",)`` and ``("stop",)``. It answers ``("up", None)``
before joining the process group, ``("ready", None)`` once it holds its part of the model,
``("done", K/V part)`` to an export, ``("done", None)`` after a load, and
``("error", traceback)`` before it exits on a failure.
"""
from __future__ import annotations

import pickle
import sys
import traceback
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from tailrl import programs
from tailrl.config import EngineConfig
from tailrl.engine.kv import KVCache
from tailrl.model.loader import DTYPES, load_model
from tailrl.model.parallel import OrderedSum, Shard
from tailrl.model.transformer import Transformer
from tailrl.threads import use_threads

TIMEOUT = timedelta(minutes=10)         # a collective left waiting this long (a rank died mid-step) fails


def reply(conn, kind: str, value) -> None:
    """An answer to rank 0, pickled plainly (``Connection.send`` would hand a tensor over in shared
    memory, which only a process of the same ``multiprocessing`` authkey may open)."""
    conn.send_bytes(pickle.dumps((kind, value), protocol=pickle.HIGHEST_PROTOCOL))


def rank_device(device: str, rank: int) -> str:
    """Rank ``rank``'s device: on CUDA the ``rank``-th after the engine's, else the engine's."""
    d = torch.device(device)
    return f"cuda:{(d.index or 0) + rank}" if d.type == "cuda" else str(d)


def process_group(store, rank: int, size: int, device: str):
    """The ranks' process group, outside torch.distributed's default group (the caller's own):
    NCCL between GPUs, gloo between CPU processes."""
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(device)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = TIMEOUT
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, TIMEOUT)


def moved(meta, move, kind=torch.Tensor):
    """An AttentionMeta with ``move`` applied to every field of type ``kind``."""
    return type(meta)(**{k: move(v) if isinstance(v, kind) else v for k, v in vars(meta).items()})


def run(conn, rank: int, port: int, config: EngineConfig, max_len: int, budget: int) -> None:
    size, device = config.tensor_parallel_size, rank_device(config.device, rank)
    threads = use_threads(config.num_threads, config.dtype)     # as rank 0's engine, governed per forward
    reply(conn, "up", None)
    store = dist.TCPStore("127.0.0.1", port, size, False, timeout=TIMEOUT)
    model = load_model(config.model, config.dtype, device, max_len, Shard(rank, size),
                       OrderedSum(process_group(store, rank, size, device), size))
    model.prepare_kernels()
    kv = KVCache(model.args, DTYPES[config.dtype], device, budget, config.max_num_seqs, max_len)
    reply(conn, "ready", None)
    serve(conn, model, kv, device, threads)


def serve(conn, model: Transformer, kv: KVCache, device: str, threads) -> None:
    """Every message in turn, until "stop" or rank 0's end is closed. Integer tensors come as
    numpy arrays; a K/V part as a tensor."""
    tensor = lambda x: torch.from_numpy(x).to(device) if isinstance(x, np.ndarray) else x   # noqa: E731
    plan = None                                         # a recurrent model's last forward's rows (kv/states.py)
    while True:
        msg = pickle.loads(conn.recv_bytes())
        if msg[0] == "copies":                          # KVCache.copy_block / move_slots, as rank 0 made them
            for op, *a in msg[1]:
                getattr(kv, op)(*map(tensor, a))
        elif msg[0] == "forward":
            _, ids, pos, meta = msg
            if threads is not None:
                threads.tick()
            meta = moved(meta, tensor, np.ndarray)
            if meta.states is not None:
                meta.states = plan = meta.states.on(device)
            model(tensor(ids), tensor(pos), kv.layers(), meta)
        elif msg[0] == "accept":                        # its accepted draft nodes, from its own kept inputs
            model.advance_states(kv.states, plan, msg[1])
        elif msg[0] == "export":
            reply(conn, "done", kv.read_blocks(msg[1], msg[2]))
        elif msg[0] == "import":
            kv.write_blocks(msg[1], msg[2])
        elif msg[0] == "load":
            model.load_weights(msg[1], complete=False)
            reply(conn, "done", None)
        elif msg[0] == "free":
            kv.free_memory()
        elif msg[0] == "stop":
            return


def main(argv: list[str]) -> None:
    conn = programs.connect(argv, "python -m tailrl.engine.rank_worker FD (started by a tensor-parallel engine)")
    try:
        sys.path[:] = pickle.loads(conn.recv_bytes())     # where rank 0 imports from, before any payload
        run(conn, *pickle.loads(conn.recv_bytes()))
    except (EOFError, OSError):                           # rank 0's process is gone
        return
    except BaseException:
        try:
            reply(conn, "error", traceback.format_exc())
        except OSError:
            pass
        raise


if __name__ == "__main__":
    main(sys.argv[1:])
