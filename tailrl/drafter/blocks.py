"""The learned drafter's K/V in blocks, laid out as the engine's K/V pool (``kernels.layout``).

Keys [blocks, heads, BLOCK * D] and values [blocks, heads, BLOCK, D]: the layout every
attention kernel of the engine reads (native CPU, Triton, reference), so a drafter depth is
the engine's fused RoPE + K/V write + attention over block tables, one call
(``tailrl.drafter.paged``), instead of a padded copy of every request's past and a dozen
small products.

A request's past is a list of block ids (``_Past.blocks`` in ``past.py``); its index i (its
position ``base + i``) sits at lane i % BLOCK of block ``blocks[i // BLOCK]``. Blocks are
handed out from a free list; when none is left the pool doubles (a new allocation, the old
blocks copied: ids stay valid). Block ``SCRATCH`` (0) is never handed out: the padding rows of
a depth replayed from a graph write there and read only it (``graphs.py``). The pool is in the
dtype of the drafter that computes the K/V, on its device.
"""
from __future__ import annotations

import torch

from tailrl.kernels.layout import BLOCK, unpack_keys
from tailrl.kernels.reference import write_kv


class KVBlocks:
    SCRATCH = 0

    def __init__(self, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, blocks: int = 16) -> None:
        self.heads, self.head_dim, self.dtype, self.device = heads, head_dim, dtype, device
        with torch.inference_mode(False):       # normal tensors: written inside and outside inference mode
            self.k = torch.zeros(blocks, heads, BLOCK * head_dim, dtype=dtype, device=device)
            self.v = torch.zeros(blocks, heads, BLOCK, head_dim, dtype=dtype, device=device)
        self._free = list(range(blocks - 1, self.SCRATCH, -1))   # popped from the end: low ids first

    @property
    def num_blocks(self) -> int:
        return self.k.shape[0]

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    @property
    def used(self) -> int:
        """Blocks held by pasts (or lent to a call)."""
        return self.num_blocks - 1 - len(self._free)

    def reserve(self, ids: list[int], n: int) -> None:
        """Grow the block list ``ids`` (in place) to hold indices ``0 .. n - 1``."""
        need = -(-n // BLOCK) - len(ids)
        if need <= 0:
            return
        if need > len(self._free):
            self._grow(need - len(self._free))
        ids += [self._free.pop() for _ in range(need)]

    def release(self, ids: list[int]) -> None:
        self._free += ids
        ids.clear()

    def _grow(self, more: int) -> None:
        old = self.num_blocks
        new = max(2 * old, old + more)
        with torch.inference_mode(False):
            k = self.k.new_zeros(new, *self.k.shape[1:])
            v = self.v.new_zeros(new, *self.v.shape[1:])
            k[:old], v[:old] = self.k, self.v
        self.k, self.v = k, v
        self._free = list(range(new - 1, old - 1, -1)) + self._free

    def slots(self, ids: list[int], start: int, n: int) -> list[int]:
        """The slots (block * BLOCK + lane) of indices ``start .. start + n - 1``."""
        return [ids[i // BLOCK] * BLOCK + i % BLOCK for i in range(start, start + n)]

    def write(self, ids: list[int], start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [n, heads, D] at indices ``start ..`` (blocks reserved here as needed)."""
        n = k.shape[0]
        self.reserve(ids, start + n)
        self.write_slots(self.slots(ids, start, n), k, v)

    def write_slots(self, slots: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [n, heads, D] at ``slots`` (reserved), in one indexed write."""
        if slots:
            at = torch.tensor(slots, dtype=torch.long, device=self.device)
            write_kv(self.k, self.v, at, k.to(self.dtype), v.to(self.dtype))

    def read(self, ids: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Indices ``0 .. n - 1`` as plain K/V: keys [heads, D, n], values [heads, n, D] (copies)."""
        if n == 0:
            return (self.k.new_empty(self.heads, self.head_dim, 0), self.v.new_empty(self.heads, 0, self.head_dim))
        nb = -(-n // BLOCK)
        idx = torch.tensor(ids[:nb], device=self.device)
        k = self.k[idx].transpose(0, 1).reshape(self.heads, nb * BLOCK * self.head_dim)
        v = self.v[idx].transpose(0, 1).reshape(self.heads, nb * BLOCK, self.head_dim)
        return unpack_keys(k, self.head_dim)[:, :, :n].contiguous(), v[:, :n].contiguous()
