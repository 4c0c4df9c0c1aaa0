"""The Python heap during a rollout: what existed before it is left out of full collections.

CPython's cyclic garbage collector runs a full (generation 2) collection whenever enough
objects have survived the younger ones, and a full collection walks every tracked object of
the process: torch's, transformers' and Triton's modules and caches, the model's parameters,
the user's own. A rollout allocates many long-lived objects (tokens, drafts, metrics), so it
triggers full collections; measured on this CPU, a tiny model's rollout at 512 rows with
drafts verified every step (the shape of ``benchmarks/host_step.py --speculative fixed``,
~1.1 s) spent 173 ms in one full collection that found nothing to free. On a GPU, where a
rollout step is a few milliseconds of host work, such a pause is dozens of steps.

``frozen_heap()`` moves every object alive when the rollout starts to CPython's permanent
generation (``gc.freeze``) and back into the oldest generation when it ends
(``gc.unfreeze``); both are list splices, independent of the heap's size. Inside, full
collections walk only what the rollout allocated. Garbage made before the rollout waits until
after it; nothing is leaked (unlike a ``gc.freeze()`` at start-up, which would keep an
engine's reference cycles, and with them its device memory, after the engine is dropped).
Where the heap is already frozen (a caller's ``gc.freeze()``: on the H100 machine 375
objects were, before any rollout, so that a freeze of ours would have been skipped and full
collections of 250 ms ran inside rollouts) it never unfreezes what someone else froze: it
holds off full collections instead, for the block (``gc.set_threshold``'s third threshold
raised, then restored), so the older heap is not walked either; young collections go on.
Where the collector is off it does nothing. Either way it times the collections inside
(``HeapStats``; a rollout's ``timing_s/gc``).
"""
from __future__ import annotations

import gc
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator


@dataclass
class HeapStats:
    """The cyclic collector inside a ``frozen_heap`` block (any thread's collections: they
    hold the interpreter lock)."""
    gc_s: float = 0.0               # seconds in collections
    collections: int = 0
    full: int = 0                   # of them full (generation 2)
    frozen: int = 0                 # objects left out of them (CPython's permanent generation)


@contextmanager
def timed_collections() -> Iterator[HeapStats]:
    """The collections inside the block, counted and timed (nothing frozen)."""
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


HELD = 1 << 30                      # the third threshold while full collections are held off


@contextmanager
def frozen_heap() -> Iterator[HeapStats]:
    """The objects alive now stay out of the collector's walks until the block ends; the
    block's collections are counted and timed."""
    enabled = gc.isenabled()
    freeze = enabled and not gc.get_freeze_count()
    thresholds = gc.get_threshold()
    with timed_collections() as stats:
        if freeze:
            gc.freeze()
        elif enabled:                   # someone else's freeze: no full collection until the block ends
            gc.set_threshold(thresholds[0], thresholds[1], HELD)
        stats.frozen = gc.get_freeze_count()
        try:
            yield stats
        finally:
            if freeze:
                gc.unfreeze()
            elif enabled:
                gc.set_threshold(*thresholds)
