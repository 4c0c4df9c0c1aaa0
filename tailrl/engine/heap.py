"""The Python heap during a rollout: no full garbage collection inside it.

CPython's cyclic garbage collector runs a full (generation 2) collection whenever enough
objects have survived the younger ones, and a full collection walks every tracked object of
the process: torch's, transformers' and Triton's modules and caches, the model's parameters,
the user's own. A rollout allocates many long-lived objects (tokens, drafts, metrics), so it
triggers full collections; measured on this CPU, a tiny model's rollout at 512 rows with
drafts verified every step (the shape of ``benchmarks/host_step.py --speculative fixed``,
~1.1 s) spent 173 ms in one full collection that found nothing to free; on the H100 machine,
226-260 ms inside rollouts of 1.6-3.3 s. On a GPU, where a rollout step is a few milliseconds
of host work, such a pause is dozens of steps.

``held_collections()`` raises the collector's third threshold for the block and restores it
after (two calls, whatever the heap's size): no full collection starts inside, young ones go
on, and garbage that reached the oldest generation during the block is collected after it
(nothing leaks). Blocks may nest and overlap across threads (the server's loop beside a
caller's rollout): the first to enter holds, the last to leave restores. Freezing the older
heap instead (``gc.freeze``) would have to leave alone a heap someone else froze (on the H100
machine 375 objects were, before any rollout) and, to know that, ask ``gc.get_freeze_count()``,
which walks every frozen object (16 ms a call on this CPU). Where the collector is off nothing
changes. Either way the block's collections are timed
(``HeapStats``; a rollout's ``timing_s/gc``).
"""
from __future__ import annotations

import gc
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

HELD = 1 << 30                      # the third threshold while full collections are held off
_lock = threading.Lock()
_held = [0, None]                   # blocks inside, the thresholds to restore


@dataclass
class HeapStats:
    """The cyclic collector inside a ``held_collections`` block (any thread's collections:
    they hold the interpreter lock)."""
    gc_s: float = 0.0               # seconds in collections
    collections: int = 0
    full: int = 0                   # of them full (generation 2)


@contextmanager
def timed_collections() -> Iterator[HeapStats]:
    """The collections inside the block, counted and timed (nothing held off)."""
    stats, started = HeapStats(), [0.0]

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        stats.gc_s += time.perf_counter() - started[0]
        stats.collections += 1
        stats.full += info["generation"] == 2
    gc.callbacks.append(timed)
    try:
        yield stats
    finally:
        gc.callbacks.remove(timed)


@contextmanager
def held_collections() -> Iterator[HeapStats]:
    """No full collection starts inside the block (young ones do); its collections are
    counted and timed."""
    hold = gc.isenabled()
    if hold:
        with _lock:
            if _held[0] == 0:
                _held[1] = gc.get_threshold()
                gc.set_threshold(_held[1][0], _held[1][1], HELD)
            _held[0] += 1
    try:
        with timed_collections() as stats:
            yield stats
    finally:
        if hold:
            with _lock:
                _held[0] -= 1
                if _held[0] == 0:
                    gc.set_threshold(*_held[1])
