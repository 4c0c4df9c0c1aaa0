"""Automatic prefix caching (vLLM's ``enable_prefix_caching``): a request admitted with a prefix
whose K/V some earlier request computed takes those blocks instead of computing them again.

What is cached: full blocks (``BLOCK`` positions) of committed tokens, a request's prompt and
its output alike, whose K/V is computed: registered while the request runs (at each admission
the scheduler registers what the running rows computed since) and when it leaves (finished,
preempted, exported). A block's key is its tokens and its parent's key, so it names its whole
prefix: exactly, a dict key compared in full (no hash is trusted), the parent named by the
serial number its registration got (``uid``: a block whose content changes gets a new one, so
no stale child is ever reached through it). Several blocks with the same key (two requests
computing one prompt at once) keep the first registered.

A cached block no row holds is idle: counted free (``KVCache.free_blocks``), handed out again
when the free list is empty, least recently released first (a request's blocks are released
last block first, so a prefix loses its tail before its head). Registered blocks are never
written: a request writes only positions from its computed count on, past its full committed
blocks. Loading new weights forgets every key (``clear``): the K/V were the old weights'.

Lossless: a position's K/V depends on the tokens up to it alone (every kernel is row-invariant;
preemption and migration recompute the same bits), so a request that takes a cached prefix
computes every later token as it would have (tests/engine/test_prefix_cache.py).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from tailrl.kernels import BLOCK

NEVER = 1 << 62             # a row's registered blocks where it must register none


class PrefixCache:
    def __init__(self, max_rows: int) -> None:
        self.by_key: dict[tuple, tuple[int, int]] = {}       # (parent uid, tokens) -> (block, uid)
        self.key_of: dict[int, tuple] = {}                   # block -> its key
        self.idle: OrderedDict[int, None] = OrderedDict()    # cached blocks no row holds, oldest first
        self.done = [0] * max_rows                           # each row's leading blocks registered
        self.uid = [0] * max_rows                            # the uid of its last one (0: none yet)
        self._serial = 0
        self.query_tokens = self.hit_tokens = 0              # looked up at admission, and found
        self.evictions = 0

    def register(self, row: int, blocks, tokens: Callable[[int, int], list[int]], length: int) -> None:
        """Register row ``row``'s full blocks (``blocks``: its block ids) of its first ``length``
        positions, whose K/V is computed (``tokens(start, stop)``: their tokens; a negative one,
        sampled by a step still on the device, ends the registration there)."""
        done, parent = self.done[row], self.uid[row]
        for i in range(done, length // BLOCK):
            toks = tuple(tokens(i * BLOCK, (i + 1) * BLOCK))
            if min(toks) < 0:
                break
            key = (parent, toks)
            got = self.by_key.get(key)
            if got is None:
                self._serial += 1
                b = int(blocks[i])
                got = self.by_key[key] = (b, self._serial)
                self.key_of[b] = key
            parent, done = got[1], i + 1
        self.done[row], self.uid[row] = done, parent

    def lookup(self, tokens: list[int], max_blocks: int) -> list[tuple[int, int]]:
        """The cached blocks (block, uid) of the longest prefix of ``tokens`` in whole blocks, at
        most ``max_blocks`` of them."""
        found: list[tuple[int, int]] = []
        parent = 0
        for i in range(max_blocks):
            got = self.by_key.get((parent, tuple(tokens[i * BLOCK:(i + 1) * BLOCK])))
            if got is None:
                break
            found.append(got)
            parent = got[1]
        return found

    def took(self, row: int, found: list[tuple[int, int]], queried: int) -> None:
        """Row ``row`` (empty) now holds ``found`` (``lookup``'s, for ``queried`` positions) as
        its leading blocks."""
        self.query_tokens += queried
        self.hit_tokens += len(found) * BLOCK
        for b, _ in found:
            self.idle.pop(b, None)
        self.done[row], self.uid[row] = len(found), (found[-1][1] if found else 0)

    def evict(self) -> int:
        """The least recently released idle block, forgotten (the free list is empty)."""
        b, _ = self.idle.popitem(last=False)
        del self.by_key[self.key_of.pop(b)]
        self.evictions += 1
        return b

    def released(self, b: int) -> bool:
        """Block ``b`` lost its last holder: True (it stays, idle) where it is cached."""
        if b in self.key_of:
            self.idle[b] = None
            return True
        return False

    def reset_row(self, row: int) -> None:
        self.done[row] = self.uid[row] = 0

    def move_row(self, src: int, dst: int) -> None:
        self.done[dst], self.uid[dst] = self.done[src], self.uid[src]
        self.reset_row(src)

    def clear(self) -> list[int]:
        """Forget every key (new weights, or the pool's memory given back); returns the idle
        blocks, free now. A row running now is never registered (its K/V are the old weights')."""
        idle = list(self.idle)
        self.by_key.clear()
        self.key_of.clear()
        self.idle.clear()
        self.done = [NEVER] * len(self.done)         # rows running now hold K/V of the old weights
        self.uid = [0] * len(self.uid)
        return idle
