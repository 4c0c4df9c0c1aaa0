"""Start a module of tailrl as a program of its own, connected to this process by a socket pair.

Why not a `multiprocessing` spawn: spawn re-runs the caller's main script in the child (as
``__mp_main__``, so that objects defined there can be unpickled), and a script without an
``if __name__ == "__main__":`` guard then starts its engine, pool or server again inside the
child, which dies before it can say why. Nothing tailrl sends its own processes is defined in a
caller's script, so the child needs only the tailrl this process imported (``PYTHONPATH``) and
this process's ``sys.path`` (its first message, from the caller).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from multiprocessing.connection import Connection


def start(module: str, *args: str) -> tuple[subprocess.Popen, Connection]:
    """``python -m module FD *args``: the child's end of the pair is file descriptor FD."""
    ours, theirs = socket.socketpair()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))        # above tailrl/
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    try:
        process = subprocess.Popen([sys.executable, "-m", module, str(theirs.fileno()), *args],
                                   pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)
    finally:
        theirs.close()
    return process, Connection(ours.detach())


def connect(argv: list[str], usage: str) -> Connection:
    """The child's end: its connection from ``argv``'s FD, or SystemExit with ``usage``."""
    if not argv or not argv[0].isdigit():
        raise SystemExit(f"usage: {usage}")
    return Connection(int(argv[0]))


def describe_exit(code: int | None) -> str:
    """A process's exit status in words (a negative code is the signal that killed it)."""
    if code is None:
        return "still running with its connection closed (killed now)"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"
