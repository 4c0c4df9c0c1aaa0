"""The K/V cache: one pool of blocks allocated once per engine, a block table per running request.

Pool: one tensor [L, 2, blocks, KV, BLOCK * D] sized by the budget (budget.py) and allocated
once, with the engine (on a CPU the OS hands out its pages on first use, and they stay with
the engine: no allocation, copy or page fault of the cache's size while a rollout runs). A block
holds BLOCK positions of one request in the kernels' layout (tailrl/kernels/layout.py).

Rows: the scheduler's running request r owns row r of ``table`` [max rows, max blocks]; its
position p lives in block ``table[r, p // BLOCK]`` at lane p % BLOCK. The attention kernels
read K/V through the table, so moving a request to another row copies its table row, not its
K/V. Blocks come from a free list as rows grow (``grow``, ``grow_rows``: all or nothing,
False when the pool cannot give them, and the scheduler preempts) and go back when a request
leaves (``release``; a stack, so the next request reuses the pages just touched).

Sharing: blocks carry reference counts. A sibling admitted after its group's prompt is in the
cache takes the prompt's full blocks by reference and a copy of the partial last block, the
only one it will write (``share``): a group of n samples holds its prompt once, plus n
partial blocks. A shared block is never written: a request writes only its positions from
its computed count on, which lie past the blocks it shares.

Prefix caching (``prefix_caching``, prefix.py): full blocks of computed tokens are kept under a
key naming their prefix; a block no row holds stays, idle, counted free, until the free list
runs out (``_take``), and an admitted request takes the blocks of its longest cached prefix
(``lookup``, ``take_cached``).

Exports and imports use the plain [L, 2, KV, n, D] layout (L: the attention layers).

A model with Gated DeltaNet layers (Qwen3.5) keeps K/V for its attention layers only, and a
row of recurrent states per running request beside them (states.py: they move with the row's
table, and a sibling sharing a prompt starts from the lender's snapshot of them); its prefixes
are not cached.

One block past the budget is never handed out: ``scratch_slot``, where the padding tokens of
a step replayed from a CUDA graph (tailrl/engine/graphs.py) write and read.
"""
from __future__ import annotations

import numpy as np
import torch

from tailrl.engine.kv.prefix import PrefixCache
from tailrl.engine.kv.states import RecurrentStates
from tailrl.kernels import BLOCK, blocks
from tailrl.model.args import ModelArgs


def num_blocks(positions: int) -> int:
    return -(-positions // BLOCK)


class KVCache:
    def __init__(self, args: ModelArgs, dtype: torch.dtype, device: str | torch.device,
                 budget_tokens: int, max_rows: int, max_len: int, prefix_caching: bool = False):
        if budget_tokens < blocks(max_len):
            raise ValueError(f"kv_cache_tokens must be >= max_model_len rounded up to whole blocks of {BLOCK} "
                             f"({blocks(max_len)}) so one request always fits, got {budget_tokens}")
        self.args, self.dtype, self.device = args, dtype, device
        self.budget_tokens, self.max_rows, self.max_len = budget_tokens, max_rows, max_len
        self.num_blocks = budget_tokens // BLOCK
        self.table = torch.zeros(max_rows, num_blocks(max_len), dtype=torch.int32, device="cpu")   # rows' tables
        self._table = self.table.numpy()                                            # the same memory
        self.held = [0] * max_rows                                 # blocks each row holds
        self.refs = np.zeros(self.num_blocks, dtype=np.int32)      # rows holding each block
        self._free = list(range(self.num_blocks - 1, -1, -1))      # a stack: low block ids first
        self.shared = 0                                            # blocks held by more than one row
        self.allocations = 0                                       # times the pool was allocated
        self.peak_used = self.peak_shared = 0
        self.scratch_slot = self.num_blocks * BLOCK                 # lane 0 of the block past the budget
        # a DeltaNet layer's state at a prefix's end is not kept: no prefix cache for it (states.py)
        self.prefix = PrefixCache(max_rows) if prefix_caching and not args.linear_layers else None
        self.states = RecurrentStates(args, dtype, device, max_rows) if args.linear_layers else None
        self._data: torch.Tensor | None = self._allocate()

    # ---- the pool ---------------------------------------------------------------------------
    def _allocate(self) -> torch.Tensor:
        a = self.args
        self.allocations += 1
        return torch.empty(len(a.attention_layers), 2, self.num_blocks + 1, a.num_kv_heads, BLOCK * a.head_dim,
                           dtype=self.dtype, device=self.device)

    @property
    def data(self) -> torch.Tensor:
        """[L, 2, blocks + 1, KV, BLOCK * D] (L: the attention layers; the last block: the scratch
        block; allocated again at first use after ``free_memory``, which ``allocations`` counts)."""
        if self._data is None:
            self._data = self._allocate()
        return self._data

    def free_memory(self) -> None:
        """Give the pool's memory back while no row holds a block (a rollout asleep during
        training); it is allocated again at the next use."""
        if self.used:
            raise RuntimeError("KVCache.free_memory: rows still hold blocks")
        self.clear_prefixes()
        self._data = None
        if self.states is not None:
            self.states.free()

    def clear_prefixes(self) -> None:
        """Forget the cached prefixes (new weights: their K/V were the old ones'); idle blocks
        go back to the free list."""
        if self.prefix is not None:
            self._free += self.prefix.clear()

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (keys [blocks, KV, BLOCK * D], values [blocks, KV, BLOCK, D]), a DeltaNet
        layer's (conv states, delta-rule states): what the model writes and reads."""
        d = self.data
        layers, _, nb, kv, flat = d.shape
        values = d[:, 1].view(layers, nb, kv, BLOCK, flat // BLOCK)
        attending = list(zip(d[:, 0].unbind(0), values.unbind(0)))
        if self.states is None:
            return attending
        at = iter(attending)
        return [self.states.layer(i) if i in self.states.layers else next(at) for i in range(self.args.num_layers)]

    @property
    def bytes(self) -> int:
        """The pool's bytes while it is allocated (0 after ``free_memory``)."""
        return 0 if self._data is None else self._data.numel() * self._data.element_size()

    @property
    def free_blocks(self) -> int:
        """Blocks a row can take: free, or cached and idle."""
        return len(self._free) + (len(self.prefix.idle) if self.prefix is not None else 0)

    @property
    def used(self) -> int:
        return self.num_blocks - self.free_blocks

    def reset_peaks(self) -> None:
        self.peak_used, self.peak_shared = self.used, self.shared

    # ---- rows' blocks -----------------------------------------------------------------------
    def need(self, row: int, length: int) -> int:
        """Blocks ``row`` lacks to hold ``length`` positions."""
        return max(0, -(-length // BLOCK) - self.held[row])

    def grow(self, row: int, length: int) -> bool:
        return self.grow_rows([(row, length)])

    def grow_rows(self, lengths: list[tuple[int, int]]) -> bool:
        """Give each (row, length) the blocks to hold ``length`` positions, all or none: False
        (and no change) when the pool lacks them."""
        held, needs, total = self.held, [], 0
        for row, length in lengths:            # every running row, every step: kept lean
            n = -(-length // BLOCK) - held[row]
            if n > 0:
                needs.append((row, n))
                total += n
        if total > len(self._free) and total > self.free_blocks:
            return False
        for row, n in needs:
            h = held[row]
            for j in range(h, h + n):
                self._table[row, j] = self._take()
            held[row] = h + n
        if needs:
            self.peak_used = max(self.peak_used, self.used)
        return True

    def _take(self) -> int:
        b = self._free.pop() if self._free else self.prefix.evict()
        self.refs[b] = 1
        return b

    def _drop(self, ids: np.ndarray) -> None:
        for b in ids.tolist():
            self.refs[b] -= 1
            if self.refs[b] == 1:
                self.shared -= 1
            elif self.refs[b] == 0 and (self.prefix is None or not self.prefix.released(b)):
                self._free.append(b)

    def release(self, row: int) -> None:
        """The row's blocks go back (a shared one when its last holder lets go; a cached one
        stays, idle)."""
        h = self.held[row]
        self._drop(self._table[row, :h][::-1].copy())     # reversed: the first block is reused first
        self.held[row] = 0
        if self.prefix is not None:
            self.prefix.reset_row(row)

    # ---- cached prefixes (prefix.py) -------------------------------------------------------------
    def register(self, row: int, tokens, length: int) -> None:
        """Cache row ``row``'s full blocks of its first ``length`` positions (computed;
        ``tokens(start, stop)``: their tokens)."""
        if self.prefix is not None and length // BLOCK > self.prefix.done[row]:
            self.prefix.register(row, self._table[row], tokens, length)

    def lookup(self, tokens: list[int], max_blocks: int) -> list[tuple[int, int]]:
        """The cached blocks of ``tokens``' longest prefix in whole blocks (at most ``max_blocks``)."""
        return self.prefix.lookup(tokens, max_blocks) if self.prefix is not None and max_blocks > 0 else []

    def cached_cost(self, found: list[tuple[int, int]]) -> int:
        """Free blocks taking ``found`` uses up: its idle ones."""
        return sum(1 for b, _ in found if self.refs[b] == 0)

    def take_cached(self, row: int, found: list[tuple[int, int]], queried: int = 0) -> None:
        """Empty row ``row`` takes ``found`` (``lookup``'s, possibly none, for ``queried``
        positions) as its leading blocks."""
        if self.prefix is None:
            return
        self.prefix.took(row, found, queried)
        for i, (b, _) in enumerate(found):
            self._table[row, i] = b
            self.refs[b] += 1
            if self.refs[b] == 2:
                self.shared += 1
        self.held[row] = len(found)
        if found:
            self.peak_used = max(self.peak_used, self.used)
            self.peak_shared = max(self.peak_shared, self.shared)

    def share(self, src: int, dst: int, length: int) -> bool:
        """Empty row ``dst`` gets ``src``'s first ``length`` positions: the full blocks by
        reference, the partial last one copied (``dst`` writes its next positions there).
        False (no change) when the copy finds no free block."""
        full, part = divmod(length, BLOCK)
        if part and not self.free_blocks:
            return False
        ids = self._table[src, :full]
        self._table[dst, :full] = ids
        for b in ids.tolist():
            self.refs[b] += 1
            if self.refs[b] == 2:
                self.shared += 1
        self.held[dst] = full
        if part:
            b = self._take()
            self.copy_block(int(self._table[src, full]), b)
            self._table[dst, full] = b
            self.held[dst] = full + 1
        if self.states is not None:             # (``length``: a prompt but its last token, the lender's snapshot)
            self.lend_states(src, dst)
        self.peak_used = max(self.peak_used, self.used)
        self.peak_shared = max(self.peak_shared, self.shared)
        return True

    def move_row(self, src: int, dst: int) -> None:
        """Row ``src``'s blocks become row ``dst``'s (``dst`` holds none)."""
        h = self.held[src]
        self._table[dst, :h] = self._table[src, :h]
        self.held[dst], self.held[src] = h, 0
        if self.prefix is not None:
            self.prefix.move_row(src, dst)
        if self.states is not None:
            self.move_states(src, dst)

    def lend_states(self, src: int, dst: int) -> None:
        """Row ``dst``'s recurrent states start from row ``src``'s snapshot (states.py ``lend``)."""
        self.states.lend(src, dst)

    def move_states(self, src: int, dst: int) -> None:
        """Row ``src``'s recurrent states become row ``dst``'s."""
        self.states.move_row(src, dst)

    # ---- positions ----------------------------------------------------------------------------
    def slots(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Pool slots (block * BLOCK + lane) of (row, position) pairs: where their K/V go."""
        return self._table[rows, positions // BLOCK].astype(np.int64) * BLOCK + positions % BLOCK

    def slot_list(self, rows: list[int], positions: list[int]) -> list[int]:
        """``slots`` of a few pairs in Python's ints (numpy's fixed cost per call is most of the
        build of a step of a few rows)."""
        t = self._table
        return [int(t[r, p // BLOCK]) * BLOCK + p % BLOCK for r, p in zip(rows, positions)]

    def move_positions(self, row: int | list[int], src: list[int], dst: list[int]) -> None:
        """Copy K/V of positions src -> dst inside one row, or each inside its own (``row`` a
        list: one per position): accepted tree-draft nodes, follow-ups (engine/ahead.py). One
        gather and one scatter for the keys and one each for the values (every layer, KV head
        and dimension of each position), the blocks and lanes indexed in one tensor: on a GPU
        one pinned copy not waited for and four kernels, queued after what is queued there
        already (a step may be in flight)."""
        rows = np.full(len(src), row, dtype=np.int64) if isinstance(row, int) else np.asarray(row, dtype=np.int64)
        slots = np.stack([self.slots(rows, np.asarray(src, dtype=np.int64)),
                          self.slots(rows, np.asarray(dst, dtype=np.int64))])
        self.move_slots(torch.from_numpy(np.concatenate([slots // BLOCK, slots % BLOCK])))

    def copy_block(self, src: int, dst: int) -> None:
        """Block ``dst``'s K/V (every layer) become a copy of block ``src``'s."""
        self.data[:, :, dst] = self.data[:, :, src]

    def move_slots(self, at: torch.Tensor) -> None:
        """``move_positions``'s copies: ``at`` [4, n] on the CPU, blocks and lanes from and to."""
        d = self.data
        if at.device != d.device:
            at = at.pin_memory().to(d.device, non_blocking=True)
        layers, _, nb, kvh, flat = d.shape
        dim = flat // BLOCK
        keys = d[:, 0].view(layers, nb, kvh, dim // 2, BLOCK, 2)     # a block's keys: [D/2][BLOCK][2]
        values = d[:, 1].view(layers, nb, kvh, BLOCK, dim)
        keys[:, at[1], :, :, at[3]] = keys[:, at[0], :, :, at[2]]
        values[:, at[1], :, at[3]] = values[:, at[0], :, at[2]]

    def row_blocks(self, row: int, length: int) -> np.ndarray:
        """The ids of the blocks that hold a row's first ``length`` positions."""
        return self._table[row, :num_blocks(length)].astype(np.int64)

    def export_row(self, row: int, length: int) -> torch.Tensor:
        """[L, 2, KV, length, D], a copy on the CPU."""
        return self.read_blocks(self.row_blocks(row, length), length)

    def read_blocks(self, ids: np.ndarray, length: int) -> torch.Tensor:
        """The first ``length`` positions held by blocks ``ids`` as [L, 2, KV, length, D] on the CPU."""
        a = self.args
        nb, dim = len(ids), a.head_dim
        parts = self.data[:, :, torch.from_numpy(ids).to(self.device)]     # [L, 2, nb, KV, BLOCK * D]
        layers, kv = len(a.attention_layers), a.num_kv_heads
        # a block's keys are [D/2][BLOCK][2]; values [BLOCK][D]
        k = parts[:, 0].view(layers, nb, kv, dim // 2, BLOCK, 2).permute(0, 2, 1, 4, 3, 5)
        k = k.reshape(layers, kv, nb * BLOCK, dim)
        v = parts[:, 1].view(layers, nb, kv, BLOCK, dim).transpose(1, 2).reshape(layers, kv, nb * BLOCK, dim)
        return torch.stack([k[:, :, :length], v[:, :, :length]], dim=1).to("cpu", copy=True)

    @property
    def kv_heads(self) -> int:
        """The K/V heads of an exported or imported request."""
        return self.args.num_kv_heads

    def check_shape(self, kv: torch.Tensor) -> None:
        a = self.args
        want = (len(a.attention_layers), 2, self.kv_heads, a.head_dim)
        if kv.dim() != 5 or (kv.shape[0], kv.shape[1], kv.shape[2], kv.shape[4]) != want:
            raise ValueError(f"kv: shape {tuple(kv.shape)} does not match this model (L, 2, KV, n, D) = {want}")

    def import_row(self, row: int, kv: torch.Tensor) -> None:
        """Write ``kv`` [L, 2, KV, n, D] as the row's first n positions (the row holds their blocks)."""
        self.check_shape(kv)
        nb = num_blocks(kv.shape[3])
        if self.held[row] < nb:
            raise ValueError(f"import_row: row {row} holds {self.held[row]} blocks, {nb} needed")
        self.write_blocks(self.row_blocks(row, kv.shape[3]), kv)

    def write_blocks(self, ids: np.ndarray, kv: torch.Tensor) -> None:
        """Write ``kv`` [L, 2, KV, n, D] as the positions held by blocks ``ids`` (n within them)."""
        layers, _, kvh, n, dim = kv.shape
        nb = len(ids)
        x = torch.nn.functional.pad(kv.to(device=self.device, dtype=self.dtype), (0, 0, 0, nb * BLOCK - n))
        k = x[:, 0].reshape(layers, kvh, nb, BLOCK, dim // 2, 2).permute(0, 2, 1, 4, 3, 5)
        k = k.reshape(layers, nb, kvh, BLOCK * dim)
        v = x[:, 1].reshape(layers, kvh, nb, BLOCK, dim).transpose(1, 2).reshape(layers, nb, kvh, BLOCK * dim)
        at = torch.from_numpy(ids).to(self.device)
        self.data[:, 0, at] = k
        self.data[:, 1, at] = v
