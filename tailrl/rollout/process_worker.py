"""The program of a local worker process: ``python -m tailrl.rollout.process_worker FD``.

`backends.ProcessInstance` starts it with one end of a socket pair as file descriptor FD and
talks to it in `multiprocessing.connection` messages: first the parent's `multiprocessing`
authkey and ``sys.path``, then ``(EngineConfig, SpeculativeConfig | None)``, then
``(op, payload)`` per request, each answered with ``(True, result)`` or
``(False, traceback text)``.

Why a program of its own rather than a `multiprocessing` spawn: spawn re-runs the parent's
main script in the child (as ``__mp_main__``, so that objects defined there can be
unpickled), and a script without an ``if __name__ == "__main__":`` guard then builds a
second pool inside the worker, which dies before it can say why. Nothing the pool sends a
worker is defined in the caller's script (configs, tensors, functions of tailrl), so the
worker needs only the parent's ``sys.path`` to unpickle what it gets.
"""
from __future__ import annotations

import multiprocessing
import sys
import traceback
from multiprocessing.connection import Connection

from tailrl import programs
from tailrl.engine.tensor_parallel import RankLost
from tailrl.rollout.worker import EngineWorker


def serve(conn: Connection) -> None:
    """Build the worker, then answer one message at a time until "close" or the parent is gone."""
    try:
        config, speculative = conn.recv()
        worker = EngineWorker(config, speculative)
        reply = (True, None)
    except Exception:
        reply = (False, traceback.format_exc())
    if not _send(conn, reply) or not reply[0]:
        return
    while True:
        try:
            op, payload = conn.recv()
        except (EOFError, OSError):             # the parent closed its end or exited
            return
        if op == "close":
            return
        try:
            reply = (True, worker.handle(op, payload))
        except RankLost:                        # its model split over ranks lost one: this instance is
            traceback.print_exc()               # lost, as if killed (the pool runs its requests elsewhere)
            raise SystemExit(1) from None
        except Exception:
            reply = (False, traceback.format_exc())
        if not _send(conn, reply):
            return


def _send(conn: Connection, reply: tuple[bool, object]) -> bool:
    """False when the parent is gone (nobody left to answer)."""
    try:
        conn.send(reply)
    except (BrokenPipeError, ConnectionResetError):
        return False
    except Exception:                           # a result that cannot be pickled (nothing was sent)
        conn.send((False, traceback.format_exc()))
    return True


def main(argv: list[str]) -> None:
    conn = programs.connect(argv, "python -m tailrl.rollout.process_worker FD (started by the rollout pool)")
    try:
        authkey, path = conn.recv()
    except (EOFError, OSError):
        return
    # the parent's key: torch tensors it sends arrive through shared memory handed over by
    # multiprocessing's resource sharer, which checks the key
    multiprocessing.current_process().authkey = authkey
    sys.path[:] = path                          # what the parent imports from, before any payload
    serve(conn)
    conn.close()


if __name__ == "__main__":
    main(sys.argv[1:])
