"""The drafter's chain steps replayed from CUDA graphs (TLT: the drafter's calls in graphs).

One depth of a batch of greedy chains (``Drafter.step``, then the most likely next token and
its probability) is about seventy small kernels. Launched one by one from Python on a GPU it
would cost more host time than the target's whole step replayed from its graph, so the
drafter alone would lose to plain decoding wherever drafting is worth the most. Here each
depth is one graph replay: ``DrafterGraphs.depth`` copies the depth's inputs into the static
buffers of its key and replays the graph captured for it (captured on first use).

Key: the drafter copy (base or low-precision: ``LowPrecision`` updates its copy in place, so
graphs stay valid across published versions; the base drafter's weights are updated in place
too), its RoPE tables (grown tables make new keys; a graph keeps the tables it reads alive),
the rows padded to a power of two, the committed past's width padded to a power of two (0:
none) and the path's depth. Padding: rows past the call's are stale but finite copies of
earlier inputs (buffers start at zero) whose outputs are ignored; past columns past the
call's width are masked with -inf, so a real row's result does not read them.

The graphs live in the engine's graph pool, within its budget (``cuda_graph_gib``): each
key's static inputs go with its graph (``GraphPool.replay``'s ``keep``) and count in the
budget, so an evicted graph frees its buffers. Each graph also holds its step's
vocabulary-sized logits and probabilities (rows x V x ~10 bytes, V the head's tokens: 12 MB
at 8 rows of a 151,936-token vocabulary, 2.6 MB with a 32,768-token draft vocabulary), so
graphs serve up to ``max_rows`` (64) rows: the tail, where a launch per kernel would
dominate; a wider call, or a key whose static inputs alone would exceed ``max_static_bytes``,
runs eagerly (the bulk, where launches weigh least against the target's step). Trees run
eagerly (their rows change per depth). Drafts are verified: nothing here can change an
output, only which drafts are made.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch

from tailrl.drafter.network import Drafter


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _shapes(d: Drafter, rows: int, width: int, depth: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """A key's static inputs, (shape, dtype) in order: features, tokens, positions, then the
    past (keys, values, bias) if ``width``, then the path (keys, values) if ``depth``."""
    c, dt = d.cfg, d.fc.weight.dtype
    out = [((rows, c.hidden_size), dt), ((rows,), torch.long), ((rows,), torch.long)]
    if width:
        out += [((rows, c.num_heads, c.head_dim, width), dt), ((rows, c.num_heads, width, c.head_dim), dt),
                ((rows, width), dt)]
    if depth:
        out += [((rows, c.num_heads, depth, c.head_dim), dt)] * 2
    return out


def static_bytes(d: Drafter, rows: int, width: int, depth: int) -> int:
    """The bytes of a key's static inputs (without building them)."""
    return sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in _shapes(d, rows, width, depth))


class _Static:
    """One key's input buffers (zeros first: padding must stay finite) and the tensors its
    graph reads besides the drafter's weights."""

    def __init__(self, d: Drafter, rows: int, width: int, depth: int, end: int, rope: tuple) -> None:
        dev = d.fc.weight.device
        t = [torch.zeros(shape, dtype=dtype, device=dev) for shape, dtype in _shapes(d, rows, width, depth)]
        self.drafter, self.rope, self.end = d, rope, end
        self.feats, self.toks, self.pos = t[:3]
        self.past = tuple(t[3:6]) if width else None
        self.path = tuple(t[-2:]) if depth else None
        self.nbytes = static_bytes(d, rows, width, depth)

    def forward(self) -> tuple[torch.Tensor, ...]:
        """(next feature, probability of the most likely token, that token (the target's id), k, v) per row."""
        out, logits, k, v = self.drafter.step(self.feats, self.toks, self.pos, self.past, None, self.path, self.end)
        q, t = torch.softmax(logits.float(), -1).max(-1)
        return out, q, self.drafter.token_ids(t), k, v


class DrafterGraphs:
    def __init__(self, pool: Any, max_rows: int = 64, max_static_bytes: int = 64 << 20) -> None:
        self.pool, self.max_rows, self.max_static_bytes = pool, max_rows, max_static_bytes
        self._static: weakref.WeakValueDictionary = weakref.WeakValueDictionary()   # alive while its graph is
        self.replays = self.eager = 0

    def depth(self, d: Drafter, feats: torch.Tensor, toks: torch.Tensor, pos: torch.Tensor,
              past: tuple[torch.Tensor, ...] | None, path: tuple[torch.Tensor, torch.Tensor] | None,
              end: int) -> tuple[torch.Tensor, ...] | None:
        """One depth of ``feats.shape[0]`` chains (``Drafter.step``'s arguments) from a graph:
        (next feature, top probability, top token, k, v), views of the graph's outputs valid
        until its next replay; None where no graph serves this shape (run it eagerly)."""
        b = feats.shape[0]
        width = past[0].shape[-1] if past is not None else 0
        depth = path[0].shape[2] if path is not None else 0
        rows, wide = _pow2(b), _pow2(width) if width else 0
        if rows > self.max_rows or static_bytes(d, rows, wide, depth) > self.max_static_bytes:
            self.eager += 1
            return None
        rope = d.rope_table(_pow2(max(end, 4096)), d.fc.weight.dtype)   # grown here, never inside a capture
        key = ("drafter", id(d), id(rope[0]), rows, wide, depth)
        if key in self.pool.refused:
            self.eager += 1
            return None
        s = self._static.get(key) if key in self.pool else None
        if s is None:
            s = _Static(d, rows, wide, depth, rope[0].shape[0], rope)
            self._static[key] = s
        s.feats[:b].copy_(feats)
        s.toks[:b].copy_(toks)
        s.pos[:b].copy_(pos)
        if past is not None:
            s.past[0][:b, :, :, :width].copy_(past[0])
            s.past[1][:b, :, :width].copy_(past[1])
            s.past[2][:b, :width].copy_(past[2])
            s.past[2][:b, width:] = float("-inf")
        if path is not None:
            s.path[0][:b].copy_(path[0])
            s.path[1][:b].copy_(path[1])
        out = self.pool.replay(key, s.forward, keep=s, keep_bytes=s.nbytes)
        if out is None:
            self.eager += 1
            return None
        self.replays += 1
        return tuple(t[:b] for t in out)
