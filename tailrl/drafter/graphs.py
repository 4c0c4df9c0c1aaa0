"""The drafter's chain depths replayed from CUDA graphs (TLT: the drafter's calls in graphs).

One depth of a batch of greedy chains (``paged.paged_step``, then the most likely next token
and its probability) is about twenty kernels. Launched one by one from Python on a GPU they
would cost more host time than the target's whole step replayed from its graph. Here each
depth is one graph replay: ``DrafterGraphs.depth`` copies the depth's inputs into the static
buffers of its key (features, tokens, positions, write slots, prefixes, and once per call the
block table) and replays the graph captured for it (captured on first use). The K/V stay in
the drafter's blocks: nothing of the past is copied.

Key: the drafter copy (base or low-precision: ``LowPrecision`` updates its copy in place, so
graphs stay valid across published versions; the base drafter's weights are updated in place
too), its RoPE tables, the blocks' tensors (a grown pool makes new keys), the rows padded to a
power of two and the block table's width padded to a power of two. Padding rows write into
the pool's scratch block (``KVBlocks.SCRATCH``) and see only it: a real row never reads them,
and they never write into a request's blocks.

The graphs live in the engine's graph pool, within its budget (``cuda_graph_gib``): each key's
static inputs go with its graph (``GraphPool.replay``'s ``keep``) and count in the budget. Each
graph also holds its step's vocabulary-sized logits and probabilities (rows x V x ~10 bytes, V
the head's tokens: 12 MB at 8 rows of a 151,936-token vocabulary, 2.6 MB with a 32,768-token
draft vocabulary), so graphs serve up to ``max_rows`` (64) rows: the tail, where a launch per
kernel would dominate; a wider call is launched (the bulk, where launches weigh least
against the target's step). Trees are launched (their rows change per depth). Drafts are
verified: nothing here can change an output, only which drafts are made.

``DrafterGraphs.chain`` replays a call's every depth from one graph instead (its depths padded
to a power of two, each depth's feature and token fed to the next inside the graph, every
depth's slots and positions loaded once): one launch and one read a call where ``depth`` takes
a launch, its input copies and a read per depth. It computes the depths the walk depth after
depth would not have reached; the caller cuts the chains where that walk would have stopped.
Off until measured on a GPU (``DrafterSource.whole_chains``, ``TAILRL_DRAFTER_WHOLE_CHAINS=1``):
at stop 68 on an H200 a depth-8 call took 1.6 ms at one row, ~0.14 ms a depth from its graph.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch

from tailrl.drafter.blocks import KVBlocks
from tailrl.drafter.network import Drafter
from tailrl.drafter.paged import ChainLayout, paged_step
from tailrl.kernels import BLOCK, AttentionMeta, Backend, RopeTables


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def static_bytes(d: Drafter, rows: int, width: int) -> int:
    """The bytes of a key's static inputs."""
    return rows * (d.cfg.hidden_size * d.fc.weight.dtype.itemsize + 3 * 8 + 3 * 4 + width * 4)


class _Held:
    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v


class _Static:
    """One key's input buffers (padding rows: the scratch block's first slot, seeing it alone)
    and what its graph reads besides the drafter's weights."""

    def __init__(self, d: Drafter, kernels: Backend, tables: RopeTables, blocks: KVBlocks, rows: int,
                 width: int) -> None:
        dev = d.fc.weight.device
        self.drafter, self.kernels, self.tables, self.width = d, kernels, tables, width
        # the pool's tensors as captured, held as long as the graph: a grown pool has new ones
        # (a new key), and these stay alive, so no later tensor reuses their memory or their id
        self.pool = _Held(blocks.k, blocks.v)
        self.feats = torch.zeros(rows, d.cfg.hidden_size, dtype=d.fc.weight.dtype, device=dev)
        self.toks, self.pos = (torch.zeros(rows, dtype=torch.long, device=dev) for _ in range(2))
        self.slots = torch.full((rows,), KVBlocks.SCRATCH * BLOCK, dtype=torch.long, device=dev)
        self.prefix = torch.ones(rows, dtype=torch.int32, device=dev)
        self.table = torch.full((rows, width), KVBlocks.SCRATCH, dtype=torch.int32, device=dev)
        self.rows = torch.arange(rows, dtype=torch.int32, device=dev)
        self.zeros = torch.zeros(rows, dtype=torch.int32, device=dev)
        self.layout: ChainLayout | None = None          # the call whose block table is loaded
        self.nbytes = static_bytes(d, rows, width)

    def load(self, layout: ChainLayout, t: int, feats: torch.Tensor, toks: torch.Tensor) -> None:
        b = feats.shape[0]
        if self.layout is not layout:                   # a new call: its table; padding rows reset
            self.layout = layout
            self.table[:b, :layout.table.shape[1]].copy_(layout.table)
            self.table[:b, layout.table.shape[1]:] = KVBlocks.SCRATCH
            self.table[b:] = KVBlocks.SCRATCH
            self.slots[b:] = KVBlocks.SCRATCH * BLOCK
            self.prefix[b:] = 1
        self.feats[:b].copy_(feats)
        self.toks[:b].copy_(toks)
        self.pos[:b].copy_(layout.positions[t])
        self.slots[:b].copy_(layout.slots[t])
        self.prefix[:b].copy_(layout.prefix[t])

    def forward(self) -> tuple[torch.Tensor, ...]:
        """(next feature, probability of the most likely token, that token (the target's id)) per row."""
        d, n = self.drafter, self.width * BLOCK
        meta = AttentionMeta(self.slots, self.rows, self.prefix, self.zeros, self.zeros, self.zeros[:1], self.table,
                             n, n * len(self.rows), n * len(self.rows))
        out, logits = paged_step(d, self.kernels, self.feats, self.toks, self.kernels.rope(self.tables, self.pos),
                                 self.pool, meta)
        q, t = torch.softmax(logits.float(), -1).max(-1)
        return out, q, d.token_ids(t)


class _ChainStatic(_Static):
    """A whole call's chains in one graph (``DrafterGraphs.chain``): every depth's slots,
    prefixes and positions loaded at once ([depths, rows]; depths past the call's write the
    scratch block), each depth's feature and token fed to the next inside the graph."""

    def __init__(self, d: Drafter, kernels: Backend, tables: RopeTables, blocks: KVBlocks, rows: int,
                 width: int, depths: int) -> None:
        super().__init__(d, kernels, tables, blocks, rows, width)
        dev = d.fc.weight.device
        self.depths = depths
        self.slots = torch.full((depths, rows), KVBlocks.SCRATCH * BLOCK, dtype=torch.long, device=dev)
        self.prefix = torch.ones(depths, rows, dtype=torch.int32, device=dev)
        self.pos = torch.zeros(depths, rows, dtype=torch.long, device=dev)
        self.nbytes = chain_bytes(d, rows, width, depths)

    def load_call(self, layout: ChainLayout, feats: torch.Tensor, toks: torch.Tensor) -> None:
        b, t, w = feats.shape[0], layout.slots.shape[0], layout.table.shape[1]
        self.layout = layout
        self.table.fill_(KVBlocks.SCRATCH)
        self.table[:b, :w].copy_(layout.table)
        self.slots.fill_(KVBlocks.SCRATCH * BLOCK)
        self.slots[:t, :b].copy_(layout.slots)
        self.prefix.fill_(1)
        self.prefix[:t, :b].copy_(layout.prefix)
        self.pos[:t, :b].copy_(layout.positions)
        self.feats[:b].copy_(feats)
        self.toks[:b].copy_(toks)

    def forward(self) -> tuple[torch.Tensor, ...]:
        """(probability of each depth's most likely token [rows, depths], those tokens (the
        target's ids) [rows, depths])."""
        d, n, r = self.drafter, self.width * BLOCK, len(self.rows)
        feats, toks, qs, ts = self.feats, self.toks, [], []
        for t in range(self.depths):
            meta = AttentionMeta(self.slots[t], self.rows, self.prefix[t], self.zeros, self.zeros, self.zeros[:1],
                                 self.table, n, n * r, n * r)
            feats, logits = paged_step(d, self.kernels, feats, toks, self.kernels.rope(self.tables, self.pos[t]),
                                       self.pool, meta)
            q, top = torch.softmax(logits.float(), -1).max(-1)
            toks = d.token_ids(top)
            qs.append(q)
            ts.append(toks)
        return torch.stack(qs, 1), torch.stack(ts, 1)


def chain_bytes(d: Drafter, rows: int, width: int, depths: int) -> int:
    """The bytes of a whole-chain key's static inputs and outputs."""
    return static_bytes(d, rows, width) + depths * rows * (3 * 8 + 4 + 4)


class DrafterGraphs:
    def __init__(self, pool: Any, max_rows: int = 64, max_static_bytes: int = 64 << 20) -> None:
        self.pool, self.max_rows, self.max_static_bytes = pool, max_rows, max_static_bytes
        self._static: weakref.WeakValueDictionary = weakref.WeakValueDictionary()   # alive while its graph is
        self.replays = self.eager = self.chains = 0

    def _static_for(self, key: tuple, rows: int, nbytes: int, make: Any) -> _Static | None:
        """``key``'s static inputs (made by ``make()`` where it has none), or None where no
        graph may serve it (over ``max_rows`` or the static budget, or refused by the pool)."""
        if rows > self.max_rows or nbytes > self.max_static_bytes or key in self.pool.refused:
            return None
        s = self._static.get(key) if key in self.pool else None
        if s is None:
            s = self._static[key] = make()
        return s

    def depth(self, d: Drafter, kernels: Backend, tables: RopeTables, blocks: KVBlocks, layout: ChainLayout, t: int,
              feats: torch.Tensor, toks: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """Depth ``t`` of ``layout``'s chains from a graph: (next feature, top probability, top
        token), views of the graph's outputs valid until its next replay; None where no graph
        serves this shape (run it eagerly)."""
        b = feats.shape[0]
        rows, width = _pow2(b), _pow2(layout.table.shape[1])
        key = ("drafter", id(d), id(tables.cos_acc), id(blocks.k), rows, width)
        s = self._static_for(key, rows, static_bytes(d, rows, width),
                             lambda: _Static(d, kernels, tables, blocks, rows, width))
        if s is not None:
            s.load(layout, t, feats, toks)
        out = None if s is None else self.pool.replay(key, s.forward, keep=s, keep_bytes=s.nbytes)
        if out is None:
            self.eager += 1
            return None
        self.replays += 1
        return tuple(x[:b] for x in out)

    def chain(self, d: Drafter, kernels: Backend, tables: RopeTables, blocks: KVBlocks, layout: ChainLayout,
              feats: torch.Tensor, toks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every depth of ``layout``'s chains from one graph (its depths padded to a power of
        two): (top probabilities [B, depths], top tokens [B, depths]), views of the graph's
        outputs valid until its next replay; None where no graph serves this shape (walk the
        depths instead). The same bits as ``depth`` depth after depth (each depth's inputs are
        the last one's outputs)."""
        b, t = feats.shape[0], layout.slots.shape[0]
        rows, width, depths = _pow2(b), _pow2(layout.table.shape[1]), _pow2(t)
        key = ("drafter-chain", id(d), id(tables.cos_acc), id(blocks.k), rows, width, depths)
        s = self._static_for(key, rows, chain_bytes(d, rows, width, depths),
                             lambda: _ChainStatic(d, kernels, tables, blocks, rows, width, depths))
        if s is not None:
            s.load_call(layout, feats, toks)
        out = None if s is None else self.pool.replay(key, s.forward, keep=s, keep_bytes=s.nbytes)
        if out is None:                 # the caller walks the depths (each counted there)
            return None
        self.chains += 1
        return out[0][:b, :t], out[1][:b, :t]
