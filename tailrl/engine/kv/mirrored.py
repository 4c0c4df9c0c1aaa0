"""Rank 0's K/V pool in an engine whose model is split over ranks (engine/tensor_parallel.py).

Every rank holds the same blocks, each for its own K/V heads; rank 0 alone keeps the
bookkeeping (rows' tables, references, cached prefixes). What rank 0 does to the pool's
contents outside a forward the other ranks must do too, in the same order: the copies inside
the pool (a shared prefix's partial block, accepted tree nodes; a recurrent model's states lent
to a sibling or moved with a row) wait in ``ops`` for the next message; a request's K/V leaving
(``export_row``) or arriving (``import_row``) gathers or scatters every rank's heads; giving the
memory back (``free_memory``) tells them at once.
"""
from __future__ import annotations

import numpy as np
import torch

from tailrl.engine.kv.cache import KVCache


class MirroredKV(KVCache):
    """``ranks``: the other ranks' side (``size``, ``send``, ``send_each``, ``replies``)."""

    def __init__(self, *args, ranks, **kwargs):
        self.ops: list[tuple] = []
        self.ranks = ranks
        super().__init__(*args, **kwargs)

    def take_ops(self) -> list[tuple]:
        """The copies made since the last call, for the other ranks to repeat."""
        ops, self.ops = self.ops, []
        return ops

    def copy_block(self, src: int, dst: int) -> None:
        super().copy_block(src, dst)
        self.ops.append(("copy_block", src, dst))

    def move_slots(self, at: torch.Tensor) -> None:
        super().move_slots(at)
        self.ops.append(("move_slots", at))

    def lend_states(self, src: int, dst: int) -> None:
        super().lend_states(src, dst)
        self.ops.append(("lend_states", src, dst))

    def move_states(self, src: int, dst: int) -> None:
        super().move_states(src, dst)
        self.ops.append(("move_states", src, dst))

    def free_memory(self) -> None:
        super().free_memory()
        self.ranks.send(("free",))

    @property
    def kv_heads(self) -> int:
        """A request's K/V moves with the whole model's heads."""
        return self.args.num_kv_heads * self.ranks.size

    def export_row(self, row: int, length: int) -> torch.Tensor:
        ids = self.row_blocks(row, length)
        self.ranks.send(("export", ids, length))
        own = self.read_blocks(ids, length)
        return torch.cat([own, *self.ranks.replies()], dim=2)

    def write_blocks(self, ids: np.ndarray, kv: torch.Tensor) -> None:
        parts = kv.chunk(self.ranks.size, dim=2)             # rank r's K/V heads
        self.ranks.send_each([("import", ids, p.contiguous()) for p in parts[1:]])
        super().write_blocks(ids, parts[0])
