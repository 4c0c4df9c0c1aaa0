"""Decode and verify steps replayed from CUDA graphs: static inputs per bucket of step shapes.

A step whose every position samples (decode rows, and rows verifying chains or trees of
drafts: no prefill chunk) is padded to a bucket: its token count rounded up to
``token_buckets`` and its tree-visibility list to a power of two. Each bucket owns one device
buffer of static inputs (token ids, positions, slots, visibility, the block table) that its
graph reads, filled by one host-to-device copy per step from a host staging buffer (pinned on
a GPU; two per bucket, taken in turn, so that a step built while the previous one's copy may
still wait in the stream never rewrites what that copy reads: engine/ahead.py). The graph
runs the model's forward to the final norm. Where every row samples alike
(``sampler.graph_mode``: an RL rollout's T = 1, or greedy) and the bucket's float32 logits
take at most ``EngineConfig.cuda_graph_sample_mib`` (8 MiB: ``sampler.GRAPH_LOGITS_BYTES``), it
runs the LM head and the sampler too, the
rows' uniforms a static input (some 25 launches from the host per step fewer); else those run
after it, on the real rows only.

Padding tokens are inert: each writes its K/V at the K/V pool's scratch slot and sees that
slot alone (through a scratch row of the static block table), so no request's K/V is touched,
and every kernel is row-invariant, so the real rows' results are those of the eager step, bit
for bit (tests/engine/test_step_graphs.py). A model with recurrent layers (Qwen3.5's Gated
DeltaNet) stages its rows' runs beside (``place_states``): a padding run has no tokens, so no
row's states move; its steps that verify drafts run eagerly (the inputs their nodes keep for
acceptance vary with the drafts).

The graphs themselves live in a ``GraphPool`` (memory budget, least recently used evicted);
they address the K/V pool, so a reallocated K/V pool (after ``free_cache``) drops them.
"""
from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from tailrl.config import EngineConfig, device_scope
from tailrl.engine.graph_pool import GraphPool, cuda_capture
from tailrl.engine.kv import KVCache
from tailrl.engine.sampler import GRAPH_LOGITS_BYTES, for_sampling, sample_static
from tailrl.kernels import BLOCK, AttentionMeta, select
from tailrl.kernels.delta import StatePlan
from tailrl.model.transformer import Transformer

log = logging.getLogger(__name__)

LONGS, INTS = 4, 4             # ids, positions, sample index, slots (int64); row, prefix, estart, ecount (int32)
FLOATS = 1                     # the rows' uniforms (float32)
Key = tuple[int, int, "str | None"]   # tokens, tree visibility entries (padded), sampler mode


def token_buckets(max_tokens: int) -> list[int]:
    """1, 2, 4, 8, then steps of a quarter of the last power of two: 8, 10, 12, 14, 16, 20, ..."""
    out, n = [1, 2, 4], 8
    while n < max_tokens:
        out.append(n)
        n += max(2, (1 << (n.bit_length() - 1)) // 4)
    return [b for b in out if b < max_tokens] + [max_tokens]


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _up4(n: int) -> int:
    return -(-n // 4) * 4


@dataclass
class _Bucket:
    n: int                          # tokens (padded)
    e: int                          # tree visibility entries (padded, >= 1)
    host: list[torch.Tensor]        # int32 staging, two taken in turn (pinned on a GPU)
    dev: torch.Tensor               # int32 static inputs on the device
    meta: AttentionMeta             # views of ``dev``: what the graph reads
    ids: torch.Tensor
    pos: torch.Tensor
    sample: torch.Tensor
    u: torch.Tensor                 # float32 uniforms (read where the graph samples)
    mode: str | None = None         # sampler.graph_mode the graph samples in (None: it ends at the final norm)
    pinned: bool = False            # the staging is pinned (a GPU's): its copies run behind the host
    copied: list = field(default_factory=lambda: [None, None])   # per staging buffer: its last copy's event
    pad_from: list = field(default_factory=list)   # per staging buffer: its tokens from here on are padding
    turn: int = 0
    staged: list = field(default_factory=list)   # per staging buffer: numpy views (all, longs [4, n], ints [4, n])
    views: dict = field(default_factory=dict)    # real tokens -> the device views of them ``place`` returns
    seqs: torch.Tensor | None = None             # a model with recurrent layers: its rows' runs [n, 6] (int64)
    seqs_at: int = 0                             # ... their words' offset in the buffers

    @property
    def stride(self) -> int:
        """Words (int32) between the staged inputs' rows: the tokens rounded up to 4, so that
        every input starts 16 bytes apart (Triton compiles a kernel per pattern of its
        pointers' alignment: bucket sizes must not each make one)."""
        return _up4(self.n)

    @property
    def extra_offset(self) -> int:
        return (2 * LONGS + INTS + FLOATS) * self.stride

    @property
    def table_offset(self) -> int:
        return self.extra_offset + _up4(self.e)


class StepGraphs:
    LEVELS = ("graphs/held", "graphs/bytes", "graphs/peak_bytes", "graphs/budget_bytes",   # not counters
              "graphs/warmup_captures", "graphs/warmup_s")

    def __init__(self, model: Transformer, kv: KVCache, pool: GraphPool, max_tokens: int, grouped: bool = False,
                 sample_bytes: int = GRAPH_LOGITS_BYTES):
        """``grouped``: every graph launches attention's query groups (``AttentionMeta.multi``), as
        an engine with a speculator wants (most of its steps verify chains; a decode row alone
        in a group has its own bits all the same), so that no bucket needs a graph for each form
        (a capture costs tens of milliseconds); else none does (a plain engine's graph steps
        have one query a row). ``sample_bytes``: a bucket whose float32 logits take at most this
        samples inside its graph (``EngineConfig.cuda_graph_sample_mib``)."""
        self.model, self.kv, self.pool, self.grouped = model, kv, pool, grouped
        self.sample_bytes = sample_bytes
        # recurrent layers (Qwen3.5's): each bucket stages its rows' runs too (``place_states``); a
        # step verifying drafts runs eagerly (its kept inputs vary with its drafts)
        self.states = bool(model.args.linear_layers)
        self.buckets = token_buckets(max_tokens)
        self._static: dict[Key, _Bucket] = {}
        self._kv_allocations = kv.allocations
        self.replays = self.eager = 0               # steps run from static inputs: replayed / eagerly (refused)
        self.warmup_captures, self.warmup_s = 0, 0.0   # what ``warm_up`` captured, in how long
        # what padding tokens hold: (ids, positions, sample index, the scratch slot); (the scratch
        # row, prefix 1, no extras: they see the scratch slot alone)
        self._pad_longs = np.array([0, 0, 0, kv.scratch_slot], dtype=np.int64)[:, None]
        self._pad_ints = np.array([kv.max_rows, 1, 0, 0], dtype=np.int32)[:, None]

    def key(self, num_tokens: int, num_extra: int, mode: str | None = None, drafted: bool = False) -> Key | None:
        """The bucket of a step with every position sampling, or None (too many tokens, or a
        model with recurrent layers verifying drafts). ``mode``: the step's
        ``sampler.graph_mode``, kept where the bucket's logits are small enough to sample in the
        graph."""
        if num_tokens == 0 or num_tokens > self.buckets[-1] or (drafted and self.states):
            return None
        n = self.buckets[bisect.bisect_left(self.buckets, num_tokens)]
        if n * self.model.args.vocab_size * 4 > self.sample_bytes:
            mode = None
        elif mode == "sample" and self.model.embed.weight.dtype not in (torch.bfloat16, torch.float32):
            mode = None             # its sampler takes the uniforms in float16 or float64, not as staged
        return n, _pow2(max(num_extra, 1)), mode

    def place(self, key: Key, longs: list, ints: list, extra: list, u: np.ndarray, rows: int,
              kv_len: int, reads: int, work: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMeta]:
        """Write one step's inputs into ``key``'s static buffer with one copy; returns views of
        the step's real tokens (ids, positions, sample index, attention meta). ``u``: the rows'
        uniforms (float64), staged as float32 where the graph samples."""
        b = self._static.get(key) or self._new(key)
        b.turn ^= 1
        host = b.host[b.turn]
        if b.copied[b.turn] is not None:
            b.copied[b.turn].synchronize()        # its copy two steps ago has read it (long since, as a rule)
        n = len(longs[0])
        h, lo, it, _ = b.staged[b.turn]
        if n:
            lo[:, :n] = longs
            it[:, :n] = ints
        pad = b.pad_from[b.turn]
        if n < pad:                                # padding tokens: the scratch slot, the scratch row
            lo[:, n:pad] = self._pad_longs         # (beyond ``pad``, written by an earlier step)
            it[:, n:pad] = self._pad_ints
        b.pad_from[b.turn] = n
        if b.mode == "sample":              # rounded to float32 here as the device rounds them
            uoff = (2 * LONGS + INTS) * b.stride
            h[uoff:uoff + n] = np.asarray(u, dtype=np.float64).astype(np.float32).view(np.int32)
        t0, x0 = b.table_offset, b.extra_offset
        h[x0:x0 + len(extra)] = extra
        end = t0 + rows * self.kv.table.shape[1]
        h[t0:end] = self.kv._table[:rows].ravel()
        b.dev[:end].copy_(host[:end], non_blocking=True)
        if b.pinned:
            b.copied[b.turn] = torch.cuda.Event()
            b.copied[b.turn].record()
        m, v = b.meta, b.views.get(n)
        if v is None:
            v = b.views[n] = (b.ids[:n], b.pos[:n], b.sample[:n], m.write_slot[:n], m.q_row[:n], m.prefix[:n],
                              m.estart[:n], m.ecount[:n])
        meta = AttentionMeta(*v[3:], m.extra, m.block_table, kv_len, reads, work, m.multi)
        return v[0], v[1], v[2], meta

    def place_states(self, key: Key, seqs: np.ndarray) -> None:
        """The rows' runs (``StatePlan.host`` [S, 6]) of the step just ``place``d in ``key``'s
        buffer, for its recurrent layers: the bucket's other entries runs of no tokens (inert),
        by a second copy from the same staging buffer (whose event then covers both copies)."""
        b = self._static[key]
        host, runs = b.host[b.turn], b.staged[b.turn][3]
        runs[:len(seqs)] = seqs
        runs[len(seqs):] = 0
        b.dev[b.seqs_at:b.seqs_at + 12 * b.n].copy_(host[b.seqs_at:b.seqs_at + 12 * b.n], non_blocking=True)
        if b.pinned:
            b.copied[b.turn] = torch.cuda.Event()
            b.copied[b.turn].record()

    def _new(self, key: Key) -> _Bucket:
        n, e, mode = key
        kv = self.kv
        rows, width = kv.max_rows + 1, kv.table.shape[1]
        s = _up4(n)                                     # ``_Bucket.stride``, ``extra_offset``, ``table_offset``
        x0 = (2 * LONGS + INTS + FLOATS) * s
        t0 = x0 + _up4(e)
        q0 = t0 + _up4(rows * width)                    # the rows' runs (recurrent layers), 6 int64 a run
        host = torch.zeros(q0 + (12 * n if self.states else 0), dtype=torch.int32, device="cpu")   # pinned on a GPU
        if torch.device(kv.device).type == "cuda":
            host = host.pin_memory()
        host[t0 + (rows - 1) * width:t0 + rows * width] = kv.num_blocks   # the scratch row: the scratch block
        dev = host.to(kv.device, copy=True)
        host = [host, host.clone().pin_memory() if host.is_pinned() else host.clone()]
        lo = dev[:2 * LONGS * s].view(torch.int64).view(LONGS, s)[:, :n]
        it = dev[2 * LONGS * s:(2 * LONGS + INTS) * s].view(INTS, s)[:, :n]
        table = dev[t0:t0 + rows * width].view(rows, width)
        meta = AttentionMeta(lo[3], it[0], it[1], it[2], it[3], dev[x0:x0 + e], table, width * BLOCK, 0, 0,
                             self.grouped)
        u = dev[(2 * LONGS + INTS) * s:(2 * LONGS + INTS) * s + n].view(torch.float32)
        b = _Bucket(n, e, host, dev, meta, lo[0], lo[1], lo[2], u, mode, host[0].is_pinned(), pad_from=[n, n],
                    seqs_at=q0)
        if self.states:                                 # zeros: runs of no tokens (inert) until a step's
            b.seqs = dev[q0:q0 + 12 * n].view(torch.int64).view(n, 6)
            meta.states = StatePlan(b.seqs)
        for t in host:
            h = t.numpy()
            b.staged.append((h, h[:2 * LONGS * s].view(np.int64).reshape(LONGS, s)[:, :n],
                             h[2 * LONGS * s:(2 * LONGS + INTS) * s].reshape(INTS, s)[:, :n],
                             h[q0:q0 + 12 * n].view(np.int64).reshape(-1, 6)))
        self._static[key] = b
        return b

    def run(self, key: Key) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The normed hidden states [bucket tokens, H] of the step placed in ``key``'s buffer,
        and where the key samples (``mode``) its tokens and log-probabilities [bucket tokens]:
        replayed from its graph, or computed eagerly from the same inputs where the pool
        refuses the key. Valid until the next step."""
        if self.kv.allocations != self._kv_allocations:      # the K/V pool the graphs address is gone
            self.pool.clear()
            self._kv_allocations = self.kv.allocations
        b = self._static[key]
        out = self.pool.replay(key, lambda: self._forward(b))
        if out is None:
            self.eager += 1
            return self._forward(b)
        self.replays += 1
        return out

    def _forward(self, b: _Bucket) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What a bucket's graph runs, from its static inputs."""
        hidden = self.model(b.ids, b.pos, self.kv.layers(), b.meta)
        if b.mode is None:
            return hidden
        return (hidden, *sample_static(for_sampling(self.model.logits(hidden)), b.mode, b.u))

    def warm_up(self, max_tokens: int, modes: tuple = ("sample", None)) -> int:
        """Capture now, not in the steps that first need them, the graph of every bucket up to
        ``max_tokens`` tokens in each sampler ``mode`` (chains and plain rows: one visibility
        entry), from steps of padding tokens alone (inert: the scratch row and slot), each
        bucket's step run eagerly first, all of them before any capture (so that no kernel is
        first compiled or loaded between captures), and once more with attention's other form
        (query groups or none: an eager prefill's form where the graphs have the other), so
        that the kernels a rollout's eager steps launch are compiled here, not in it (the H200
        runs of stop 46: the first engine, whose start-up compiled for 15 s, ran its rollout
        2.1-2.6x slower than an engine made after the compiles, its host held in the step's
        forward: most likely Triton compiling for the eager steps, not yet confirmed). Returns
        the number of graphs captured."""
        t0, before = time.perf_counter(), self.pool.captures
        keys = {self.key(n, 0, mode) for n in self.buckets if n <= max_tokens for mode in modes}
        keys = sorted(keys, key=lambda k: (-k[0], str(k[2])))
        for key in keys:                # every kernel compiled and loaded before the first capture
            self._place_nothing(key)
            b = self._static[key]
            self._forward(b)
            meta = b.meta
            b.meta = dataclasses.replace(meta, multi=not meta.multi)
            try:
                self._forward(b)
            finally:
                b.meta = meta
        for key in keys:
            self._place_nothing(key)
            self.run(key)
        self.warmup_captures += self.pool.captures - before
        self.warmup_s += time.perf_counter() - t0
        return self.pool.captures - before

    def _place_nothing(self, key: Key) -> None:
        """A step of padding tokens alone in ``key``'s buffer (and runs of no tokens)."""
        self.place(key, [[]] * LONGS, [[]] * INTS, [], np.zeros(0), 0, 0, 0, 0)
        if self.states:
            self.place_states(key, np.zeros((0, 6), dtype=np.int64))

    def stats(self) -> dict[str, float]:
        return {**self.pool.stats(), "graphs/replayed_steps": self.replays, "graphs/eager_steps": self.eager,
                "graphs/warmup_captures": self.warmup_captures, "graphs/warmup_s": self.warmup_s}


def engine_graphs(model: Transformer, kv: KVCache, config: EngineConfig, dtype: torch.dtype,
                  grouped: bool) -> StepGraphs | None:
    """An engine's decode and verify steps' CUDA graphs, on a GPU with ``cuda_graphs`` and kernels
    a graph can capture (not float64's reference, which waits for the device inside a step)."""
    if torch.device(config.device).type != "cuda" or not config.cuda_graphs:
        return None
    if config.tensor_parallel_size > 1:
        log.info("engine: no CUDA graphs with tensor_parallel_size %d (not captured across ranks yet)",
                 config.tensor_parallel_size)
        return None
    if model.args.mla is not None:
        log.info("engine: no CUDA graphs for %s (its latent attention's absorbed weights are copies a weight update "
                 "makes again, outside any graph)", model.args.architecture)
        return None
    kernels = select(config.device, dtype)
    if not kernels.attends(model.args.head_dim):
        log.info("engine: no CUDA graphs for %s (heads of %d dimensions take the reference attention, which reads a "
                 "step's draft positions on the host)", model.args.architecture, model.args.head_dim)
        return None
    if not kernels.capturable or (model.args.num_experts and not kernels.captures_experts):
        log.info("engine: no CUDA graphs for %s on %s (its kernels, %s, wait for the device inside a step%s)",
                 config.dtype, config.device, kernels.name, ": a mixture of experts' grouping"
                 if kernels.capturable else "")
        return None
    pool = GraphPool(int(config.cuda_graph_gib * 2**30), cuda_capture)
    max_tokens = min(config.cuda_graph_max_tokens, config.max_num_batched_tokens)
    return StepGraphs(model, kv, pool, max_tokens, grouped=grouped,
                      sample_bytes=int(config.cuda_graph_sample_mib * 2**20))


def warm_up(graphs: StepGraphs, config: EngineConfig, drafts: bool) -> None:
    """Every graph a step may replay, captured now (a capture costs tens of milliseconds, which
    inside a rollout would be the rollout's): up to ``max_num_seqs`` tokens, plain decoding's
    steps; with drafts, up to the graphs' token cap."""
    with device_scope(config.device):
        made = graphs.warm_up(graphs.buckets[-1] if drafts else min(graphs.buckets[-1], config.max_num_seqs))
    log.info("CUDA graphs: %d step shapes captured in %.2f s (%.0f MiB; cuda_graph_warmup=False captures "
             "each when a step first needs it)", made, graphs.warmup_s, graphs.pool.bytes / 2**20)
