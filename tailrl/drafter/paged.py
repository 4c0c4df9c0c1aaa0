"""The learned drafter's steps (chains and trees) on the engine's kernels, its K/V in blocks.

``Drafter.step`` is written for clarity and for training's twin (``unroll``): about seventy
small PyTorch operations a depth, most of them on a padded copy of every request's past. On
this 2-core CPU a depth of ``small``'s drafter costs ~0.2-0.3 ms at 1-8 rows, nearly all of it
per-operation overhead (its weights are 4 MB), i.e. a 6-token chain costs about one target
step (``benchmarks/drafter_step.py``'s "padded" setting). Here a depth is
the engine's own attention and norm kernels (``tailrl.kernels.select``:
native CPU, Triton, reference) around PyTorch's products:

    e = rms_norm(embed[tok])                     x = fc([f, e])
    att = rope_attend(qkv(rms_norm(x)))          RoPE, this depth's K/V written into the
                                                 drafter's blocks, attention over the row's
                                                 block table (committed past + path so far)
    x, h = add_rms_norm(x, o(att))               y = down(silu(gate(h)) * up(h))
    f' = add_rms_norm(x, y, out_norm)            logits = head(f')

The same function as ``Drafter.step`` (the tests compare them) up to rounding: the norms and
RoPE are computed in the kernels' accumulation type. The products are the backend's fastest
(``Backend.draft_linear``: cuBLAS on a GPU; on a CPU oneDNN / MKL, and the native bfloat16
product below 3 rows), not the engine's batch-invariant matmul everywhere: a draft need not
be row-invariant (it is verified), and the invariant bfloat16 product on this CPU measured
1.5-3x slower than oneDNN's at 8-64 rows of these shapes, 1.8-3x faster at 1 row.

Where the path goes: a request's committed past holds indices ``0 .. length - 1`` of its
blocks (positions ``base ..``; ``tailrl.drafter.past``); a draft rooted at r sees the first
``seen = min(length, r - base)`` of them, and its depth t (0-based, position r + t) writes its
K/V at index ``seen + t`` and sees indices ``0 .. seen + t``: the committed positions < r,
then the path. Scores depend on relative positions only (RoPE at absolute positions), so the
index need not equal the position. The path overwrites only indices >= seen: the root's own
committed K/V (index seen when the root is held), recomputed by depth 0 from the same inputs
(the target's state at r, the token after it), and room past the committed positions, which
later committed positions overwrite in turn. Blocks for the path are reserved before the first
depth; a request with no past drafts in blocks lent for the call. Trees (``TreeLayout``): the
root step at index ``seen``, node j at ``seen + 1 + j``; a node sees the committed indices and
the root step's, then its ancestors' and its own (the kernels' extras).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tailrl.drafter.blocks import KVBlocks
from tailrl.drafter.network import Drafter
from tailrl.kernels import BLOCK, AttentionMeta, Backend, Rope, RopeTables, select

_TABLES: dict[tuple, RopeTables] = {}


def rope_tables(d: Drafter, end: int, dtype: torch.dtype) -> RopeTables:
    """The drafter's rotary tables for the kernels (its ``inv_freq``; at least ``end`` rows,
    sizes doubling): in ``dtype`` and in the kernels' accumulation type."""
    dev = d.fc.weight.device
    size = 4096
    while size < end:
        size *= 2
    key = (size, dtype, str(dev), tuple(d.inv_freq.tolist()))
    t = _TABLES.get(key)
    if t is None:
        angles = torch.arange(size, dtype=torch.float64, device="cpu").unsqueeze(-1) * d.inv_freq.cpu()
        angles = torch.cat([angles, angles], -1)
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        t = _TABLES[key] = RopeTables(angles.cos().to(dev, dtype), angles.sin().to(dev, dtype),
                                      angles.cos().to(dev, acc), angles.sin().to(dev, acc))
    return t


def paged_step(d: Drafter, kernels: Backend, feats: torch.Tensor, toks: torch.Tensor, rope: Rope,
               pool: KVBlocks, meta: AttentionMeta) -> tuple[torch.Tensor, torch.Tensor]:
    """One drafter position per row (``Drafter.step``'s layer): feats [B, H], toks [B] (the
    token after each position), ``rope`` at the positions; this step's K/V are written at
    ``meta.write_slot`` of ``pool`` (its ``k`` and ``v``) and each row attends as ``meta`` says. Returns (next
    feature [B, H], logits [B, V] over the head's tokens)."""
    c = d.cfg
    eps = c.rms_norm_eps
    dt = d.fc.weight.dtype
    e = kernels.rms_norm(F.embedding(toks, d.embed), d.embed_norm, eps)
    linear = kernels.draft_linear
    x = linear(torch.cat([feats.to(dt), e], -1), d.fc.weight, d.fc.bias)
    att = kernels.rope_attend(linear(kernels.rms_norm(x, d.attn_norm, eps), d.qkv.weight), rope, pool.k, pool.v,
                              meta, c.num_heads)
    x, h = kernels.add_rms_norm(x, linear(att, d.o.weight), d.mlp_norm, eps)
    gate, up = linear(h, d.gate_up.weight).chunk(2, dim=-1)
    out = kernels.add_rms_norm(x, linear(F.silu(gate) * up, d.down.weight), d.out_norm, eps)[1]
    return out, linear(out, d.head)


def _table(pool: KVBlocks, lists: list[list[int]]) -> torch.Tensor:
    """The rows' block lists as one block table [B, widest] int32 (padded with the scratch block)."""
    width = max(len(ids) for ids in lists)
    return torch.tensor([ids + [KVBlocks.SCRATCH] * (width - len(ids)) for ids in lists], dtype=torch.int32,
                        device="cpu")


@dataclass
class ChainLayout:
    """Where a call's chains write and what they see, for every depth at once (built on the
    host, copied once): depth t's slots ``slots[t]``, prefixes ``prefix[t]``, positions
    ``positions[t]``; one block table for the call."""

    slots: torch.Tensor          # [T, B] long
    prefix: torch.Tensor         # [T, B] int32
    positions: torch.Tensor      # [T, B] long
    table: torch.Tensor          # [B, blocks] int32
    seen: list[int]              # committed indices each row sees
    zeros: torch.Tensor          # [B] int32 (no extras)
    rows: torch.Tensor           # [B] int32 (row b reads table row b)

    @classmethod
    def build(cls, pool: KVBlocks, lists: list[list[int]], seen: list[int], roots: list[int],
              depths: int) -> "ChainLayout":
        """``lists[b]``: row b's blocks (reserved for ``seen[b] + depths`` indices)."""
        dev, cpu = pool.device, torch.device("cpu")
        b = len(lists)
        slots = [[0] * b for _ in range(depths)]
        for j, (ids, s) in enumerate(zip(lists, seen)):
            for t, slot in enumerate(pool.slots(ids, s, depths)):
                slots[t][j] = slot
        t_idx = torch.arange(depths, device=cpu)[:, None]
        prefix = (torch.tensor(seen, device=cpu)[None, :] + t_idx + 1).to(torch.int32)
        positions = torch.tensor(roots, device=cpu)[None, :] + t_idx
        host = [torch.tensor(slots, dtype=torch.long, device=cpu), prefix, positions, _table(pool, lists)]
        slots_d, prefix_d, pos_d, table_d = (x.to(dev, non_blocking=True) for x in host)
        return cls(slots_d, prefix_d, pos_d, table_d, list(seen), torch.zeros(b, dtype=torch.int32, device=dev),
                   torch.arange(b, dtype=torch.int32, device=dev))

    def meta(self, t: int) -> AttentionMeta:
        """Depth t's visibility: each row's indices ``0 .. seen + t``."""
        widest = max(self.seen) + t + 1
        total = sum(self.seen) + len(self.seen) * (t + 1)
        return AttentionMeta(self.slots[t], self.rows, self.prefix[t], self.zeros, self.zeros, self.zeros[:1],
                             self.table, widest, total, total)


class TreeLayout:
    """Where a call's tree nodes write and what they see. Request b's root step (the draft's
    first drafter position, at its root r) writes at index ``seen[b]``, its node j (j-th node
    made, at position r + depth(j)) at ``seen[b] + 1 + j``: the node budget bounds them, so
    ``seen[b] + 1 + max_tokens`` indices are reserved. A node's step sees the committed indices
    and the root step's (prefix ``seen[b] + 1``), then its ancestors' and its own indices in
    order (the kernels' extras, as the target's tree verify sees a tree)."""

    def __init__(self, pool: KVBlocks, lists: list[list[int]], seen: list[int], roots: list[int]) -> None:
        self.pool, self.lists, self.seen, self.roots = pool, lists, seen, roots
        self.table = _table(pool, lists).to(pool.device, non_blocking=True)

    def meta(self, frontier: list[tuple[int, list[int]]]) -> tuple[AttentionMeta, torch.Tensor]:
        """A depth's visibility and positions: frontier row (b, path), path the node indices
        from the root's child down to the row's node ([]: the root step itself). Rows of one
        request are consecutive."""
        slots, rows, prefix, estart, ecount, extra, positions = [], [], [], [], [], [], []
        for b, path in frontier:
            s, ids = self.seen[b], self.lists[b]
            own = s + 1 + path[-1] if path else s
            slots.append(ids[own // BLOCK] * BLOCK + own % BLOCK)
            rows.append(b)
            prefix.append(s + 1)
            estart.append(len(extra))
            ecount.append(len(path))
            extra += [s + 1 + j for j in path]
            positions.append(self.roots[b] + len(path))
        dev, cpu, i32 = self.pool.device, torch.device("cpu"), torch.int32
        longs = torch.tensor([slots, positions], dtype=torch.long, device=cpu).to(dev, non_blocking=True)
        ints = torch.tensor([rows, prefix, estart, ecount], dtype=i32, device=cpu).to(dev, non_blocking=True)
        ext = torch.tensor(extra or [0], dtype=i32, device=cpu).to(dev, non_blocking=True)
        widest = max(prefix + [e + 1 for e in extra])
        total = sum(prefix) + len(extra)
        meta = AttentionMeta(longs[0], ints[0], ints[1], ints[2], ints[3], ext, self.table, widest, total, total,
                             multi=len(set(rows)) < len(rows))
        return meta, longs[1]


def kernels_for(d: Drafter) -> Backend:
    return select(d.fc.weight.device, d.fc.weight.dtype)
