"""A pool of captured step graphs within a memory budget (TLT's adaptive graph pool).

Each key (a bucket of the step's shape: tailrl/engine/graphs.py) is captured the first time
a step needs it, then replayed. Captured graphs hold GPU memory (their private memory pool:
the step's activations); the pool keeps their sum within ``budget_bytes`` by dropping the
least recently used graph. A key whose capture fails, or whose graph alone exceeds the
budget, is refused for good: its steps run eagerly (``replay`` returns None), and the pool
says so once in the log. The counters (``stats``) are what benchmarks report.

``capture(fn) -> (replay, bytes)`` is injected: ``cuda_capture`` on a GPU; tests and CPUs
use ``eager_capture`` (replay = call the function again), which exercises everything but the
CUDA graph itself.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Callable, Hashable

import torch

log = logging.getLogger(__name__)

Capture = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], torch.Tensor], int]]
_captures = 0          # captures tried in this process, by every pool


def captures_made() -> int:
    """Captures tried so far in this process (every pool's): a step or drafter call during which
    this changed paid for a capture (and its first, compiling run), so its time prices nothing."""
    return _captures


_streams: dict[torch.device, torch.cuda.Stream] = {}


def capture_stream() -> torch.cuda.Stream:
    """The current device's one stream for every capture and the run before it (made once):
    what a library keeps per stream and makes on first use (cuBLAS's workspace: torch keys it
    by handle and stream) is made in that run, never inside a capture, where it would come
    from the graph's private pool, and not once per capture either, as a new side stream each
    time made it. (The H100 run of stop 45 found 70 MB of graphs in a process's first engine
    against 4-8 MB in later ones; with this stream the H200's of stop 46 still found 108 MB
    against 74: the first engine's extra is not, or not only, that.)"""
    device = torch.device("cuda", torch.cuda.current_device())
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device)
    return _streams[device]


def cuda_capture(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], torch.Tensor], int]:
    """Capture ``fn`` (its inputs and outputs: static tensors) into a CUDA graph with its own
    memory pool. ``fn`` runs once first, on the stream of the capture (``capture_stream``; Triton
    compiles its kernels there, outside the capture). Returns (replay, the bytes the graph's
    pool reserved).

    A capture in CUDA's default ("global") mode fails if any thread of the process makes an
    unsafe CUDA call meanwhile; one that fails is tried once more in "thread_local" mode (only
    this thread's calls count). Whatever fails raises ``CaptureError`` with every error of the
    chain (the first one is the cause; CUDA's "operation failed due to a previous error during
    capture" comes after it) and the device's memory at the time."""
    side = capture_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    errors = []
    for mode in ("global", "thread_local"):
        before, free = torch.cuda.memory_reserved(), torch.cuda.mem_get_info()[0]
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=side, capture_error_mode=mode):
                out = fn()
        except Exception as exc:                  # reported whole below
            errors.append(f"{mode}: {error_chain(exc)}")
            continue
        if errors:
            log.warning("graph pool: a capture failed in CUDA's global mode and succeeded in thread_local mode "
                        "(another thread's CUDA call broke the first): %s", errors[0])
        # the graph's private memory pool: what the allocator reserved for it, or what the device lost
        size = max(torch.cuda.memory_reserved() - before, free - torch.cuda.mem_get_info()[0])

        def replay() -> torch.Tensor:
            graph.replay()
            return out
        return replay, size
    free, total = torch.cuda.mem_get_info()
    raise CaptureError("; ".join(errors) + f" (device memory: {free / 2**30:.2f} of {total / 2**30:.2f} GiB free, "
                       f"{torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated, "
                       f"{torch.cuda.memory_reserved() / 2**30:.2f} GiB reserved by torch)")


class CaptureError(RuntimeError):
    pass


def error_chain(exc: BaseException) -> str:
    """``exc`` and what it was raised from or during, first cause first."""
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        chain.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    return " -> ".join(reversed(chain))


def eager_capture(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], torch.Tensor], int]:
    """No graph: replaying calls ``fn`` on the same static inputs (CPUs, tests)."""
    return fn, 0


class GraphPool:
    def __init__(self, budget_bytes: int, capture: Capture):
        if budget_bytes < 0:
            raise ValueError(f"cuda_graph_gib: the graph pool's budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.capture = capture
        # key -> (replay, bytes, what lives as long as the graph: its static inputs)
        self._graphs: OrderedDict[Hashable, tuple[Callable[[], torch.Tensor], int, object]] = OrderedDict()
        self.refused: set[Hashable] = set()
        self.bytes = self.peak_bytes = 0
        self.hits = self.misses = self.captures = self.evictions = self.failures = 0

    def __len__(self) -> int:
        return len(self._graphs)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._graphs

    def replay(self, key: Hashable, fn: Callable[[], torch.Tensor], keep: object = None,
               keep_bytes: int = 0) -> torch.Tensor | None:
        """Replay ``key``'s graph (capturing ``fn`` first if it has none); None when the key is
        refused (the caller runs ``fn`` eagerly). ``keep``: what the graph reads and must
        outlive it (its static inputs, when the caller does not hold them), ``keep_bytes`` of
        memory counted in the budget with the graph's own; dropped with the graph."""
        entry = self._graphs.get(key)
        if entry is not None:
            self.hits += 1
            self._graphs.move_to_end(key)
            return entry[0]()
        self.misses += 1
        if key in self.refused:
            return None
        global _captures
        _captures += 1
        try:
            replay, size = self.capture(fn)
        except Exception as exc:              # a capture failure costs its key the graph, never the step
            self.failures += 1
            self.refused.add(key)
            log.warning("graph pool: capturing %s failed (%s); its steps run eagerly", key, error_chain(exc))
            return None
        self.captures += 1
        size += keep_bytes
        if size > self.budget_bytes:
            self.refused.add(key)
            log.warning("graph pool: the graph of %s takes %.1f MiB, over the whole budget (%.1f MiB, "
                        "cuda_graph_gib); its steps run eagerly", key, size / 2**20, self.budget_bytes / 2**20)
            return None
        while self.bytes + size > self.budget_bytes:
            _, (_, freed, _) = self._graphs.popitem(last=False)
            self.bytes -= freed
            self.evictions += 1
        self._graphs[key] = (replay, size, keep)
        self.bytes += size
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        return replay()

    def clear(self) -> None:
        """Drop every graph (their inputs or the K/V pool they address moved); refusals stay."""
        self._graphs.clear()
        self.bytes = 0

    def stats(self) -> dict[str, float]:
        return {"graphs/hits": self.hits, "graphs/misses": self.misses, "graphs/captures": self.captures,
                "graphs/evictions": self.evictions, "graphs/failures": self.failures, "graphs/held": len(self),
                "graphs/bytes": self.bytes, "graphs/peak_bytes": self.peak_bytes,
                "graphs/budget_bytes": self.budget_bytes}
