"""Torch threads sized to the cores other processes leave free.

Why: torch's CPU ops and our native kernels run OpenMP parallel regions with one thread per
core, and every region ends at a barrier that waits for all of its threads. When another
process is busy on the machine, the OS deschedules one of our threads for a time slice
(milliseconds) and every region waits for it: on 2 cores beside one pure-Python loop a
16x256x768 bfloat16 matmul went from 40-47 us to 129-251 us with 2 threads, and stayed at 53-63
us with 1 (`python benchmarks/shared_machine.py` shows the same on whole rollouts and GRPO
steps). One thread fewer than the busy cores costs far less than the barrier waits.

So `ThreadGovernor.tick()` (called once per engine step and per training micro-batch) reads,
every ``interval_s`` of wall time, how much CPU the whole machine used (``/proc/stat``) and how
much this process used (``time.process_time``); the rest is other processes' load, in cores.
It then runs as many threads as cores are left free (at least 1, at most the cap), going down
at once and up only after two windows agree (a neighbour's pauses do not make it flap).
In bfloat16 and float64 thread counts do not change results: the engine's matmuls are
row-invariant and its attention splits work by rows and heads, never a reduction
(`tests/test_threads.py` checks outputs, and GRPO updates in float32, at 1 and 2 threads). A
float32 engine's log-probabilities do change with the count (MKL), so a float32 engine keeps a
fixed count. Without ``/proc/stat`` (not Linux) the governor keeps the cap.

Thread counts are process-wide state in torch, so one governor serves the process
(`governor()`); an engine or trainer given a fixed ``num_threads`` sets it and is not governed.

A second cause of slow regions lives inside the process: OpenMP keeps a pool of worker threads
per thread that ever ran a parallel region, and once the pools hold more threads than there are
cores, libgomp stops spinning and parks its workers at every barrier (a futex wake per region).
An engine built on the main thread and run on a server's loop thread (or any worker thread) ran
at 0.7x the main thread's speed for that reason (a 16x256x768 bf16 matmul 85-115 us vs 37-42
us). `release_pool()` frees the calling thread's idle pool (``omp_pause_resource_all``, OpenMP
5.0); `LLM` calls it after building the engine and after each ``generate``, so the thread that
computes next is the only one with a pool.
"""
from __future__ import annotations

import ctypes
import logging
import math
import os
import time

import torch

log = logging.getLogger(__name__)

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def available_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup CPU quota."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def machine_busy_s() -> float | None:
    """CPU seconds every core of the machine has spent busy since boot (None: no /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    # cpu user nice system idle iowait irq softirq steal ...: all but idle and iowait are busy
    # (steal is CPU the hypervisor gave to others: also not ours)
    vals = [int(v) for v in fields[1:9]]
    return (sum(vals) - vals[3] - vals[4]) / _TICK


class ThreadGovernor:
    """``cap``: the most threads to run (default: torch's thread count when made, which is
    the physical cores unless ``OMP_NUM_THREADS`` or the caller said otherwise)."""

    def __init__(self, cap: int | None = None, interval_s: float = 0.25, spare: float = 0.4):
        self.cap = cap or torch.get_num_threads()
        self.interval_s = interval_s
        self.spare = spare               # a thread runs on a core at most this loaded by others
        self.threads = self.cap
        self.others = 0.0                # other processes' load in the last window, in cores
        self.changes = 0                 # thread-count changes made (a metric)
        self.seconds_at: dict[int, float] = {}   # wall seconds of the finished windows by thread count
        self._up_votes = 0
        self._mark = self._sample()
        torch.set_num_threads(self.threads)

    @staticmethod
    def _sample() -> tuple[float, float | None, float]:
        return time.monotonic(), machine_busy_s(), time.process_time()

    def tick(self) -> int:
        """Re-decide the thread count once the window is over; returns the count in use."""
        now = time.monotonic()
        if now - self._mark[0] < self.interval_s:
            return self.threads
        mark, self._mark = self._mark, self._sample()
        if mark[1] is None or self._mark[1] is None:
            return self.threads
        wall = self._mark[0] - mark[0]
        self.seconds_at[self.threads] = self.seconds_at.get(self.threads, 0.0) + wall
        ours = self._mark[2] - mark[2]
        self.others = max(0.0, (self._mark[1] - mark[1] - ours) / wall)
        self._apply(self.want(self.others))
        return self.threads

    def want(self, others: float) -> int:
        """Threads for a machine where other processes use ``others`` cores."""
        free = available_cores() - others
        return max(1, min(self.cap, math.floor(free + self.spare)))

    def _apply(self, target: int) -> None:
        if target > self.threads:        # up only when two windows in a row agree
            self._up_votes += 1
            if self._up_votes < 2:
                return
        self._up_votes = 0
        if target != torch.get_num_threads():    # also when a fixed-count engine changed it since
            log.debug("threads %d -> %d (other processes use %.2f cores)", self.threads, target, self.others)
            self.threads = target
            self.changes += 1
            torch.set_num_threads(target)


_governor: ThreadGovernor | None = None


def governor() -> ThreadGovernor:
    """The process's governor (made on first use)."""
    global _governor
    if _governor is None:
        _governor = ThreadGovernor()
    return _governor


class FixedThreads:
    """A fixed count, set again at each tick: another engine or a governor in this process
    may have changed torch's process-wide count since."""

    def __init__(self, threads: int):
        self.threads = threads
        torch.set_num_threads(threads)

    def tick(self) -> int:
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        return self.threads


def use_threads(num_threads: int | None, dtype: str = "bfloat16") -> ThreadGovernor | FixedThreads | None:
    """``num_threads`` given: that count. None: the process's governor, for an engine whose
    ``dtype`` computes the same bits at any thread count (bfloat16, float64); in float32 MKL's
    GEMMs split reductions by thread, so log-probabilities would follow the machine's load:
    the count stays as torch has it (None)."""
    if num_threads:
        return FixedThreads(num_threads)
    return governor() if dtype != "float32" else None


_OMP_RUNTIMES = ("libgomp", "libomp", "libiomp")
_omp_lib: ctypes.CDLL | None | bool = False      # False: not looked up yet


def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded (from this process's memory map), or None."""
    global _omp_lib
    if _omp_lib is False:
        _omp_lib = None
        try:
            with open("/proc/self/maps") as f:
                paths = {line.split()[-1] for line in f if any(r in line for r in _OMP_RUNTIMES)}
            for path in sorted(paths):
                lib = ctypes.CDLL(path)
                if hasattr(lib, "omp_pause_resource_all"):
                    _omp_lib = lib
                    break
        except OSError:
            pass
    return _omp_lib


def release_pool() -> bool:
    """Free the calling thread's idle OpenMP worker pool (the next parallel region on this
    thread makes a new one, ~0.1 ms). Returns whether a runtime did it. Never call it from
    inside a parallel region (the runtime refuses: returns False)."""
    lib = _openmp()
    if lib is None:
        return False
    return lib.omp_pause_resource_all(1) == 0          # omp_pause_soft
