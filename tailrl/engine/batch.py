"""Build one step's flat batch from scheduled rows and drafts, and run the model on it.

Row r's new tokens are its committed tokens [computed, computed + n) followed by its draft
nodes. They are written at consecutive positions of the row (slots through its block table:
the scheduler and the drafts' check have given it the blocks); draft node j gets RoPE position
computed + n - 1 + depth(j). Sampled positions: the last committed token of every row that is
caught up (the root) and every draft node. Every new token attends to
its own row (see ``AttentionMeta``): a committed token or chain node at cache position p sees
[0, p]; a tree node sees the committed prefix, then its ancestors and itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tailrl.engine.graphs import Key, StepGraphs
from tailrl.engine.kv import KVCache
from tailrl.engine.logits_process import positions
from tailrl.engine.request import Request
from tailrl.engine.sampler import Fetched, for_sampling, graph_mode, sample_async
from tailrl.kernels import AttentionMeta
from tailrl.model.transformer import Transformer
from tailrl.noise import uniforms

FEW_TOKENS = 16         # a step of at most this many tokens finds its K/V slots in Python's ints
CHAIN_ROWS = 8          # a verify step of more rows builds its chains in arrays (_chain_batch)


def node_depths(parents: list[int]) -> list[int]:
    """Depth of each draft node; children of the root (-1) have depth 1."""
    depth: list[int] = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return depth


@dataclass(slots=True)
class RowPlan:
    """A row that samples this step."""
    req: Request
    n: int                          # committed tokens computed this step
    parents: list[int]              # draft tree ([] = plain decode)
    draft_tokens: list[int]
    entry: int                      # index of its root among the sampled positions; nodes follow
    draft: object = None            # the Draft it verifies (None = plain decode)
    last: int = -1                  # sampled index of the last token commit appended (set by commit)
    rows: list[int] = field(default_factory=list)   # sampled index of every token commit appended
    follow: "FollowUps | None" = None   # a row's follow-ups of its draft in the step before (below)


@dataclass(slots=True)
class FollowUps:
    """A row that verifies a draft in a step still on the device follows it up in the next step,
    launched ahead, for a few of the accept lengths the draft may get (engine/ahead_drafts.py):
    for each length ``a``, the token the target emits after ``a`` accepted nodes (sampled by the
    step before: a placeholder here, fed on the device) at its position, seeing the row's cache
    up to it, its own K/V written at a scratch position past the draft. When the draft's step
    settles, the follow-up of its accept length, if any, is the row's next token (engine/ahead.py:
    its K/V moved into place); the others are dropped."""
    lengths: list[int]              # the accept lengths followed up, one query each, in this order
    depth: int                      # nodes of the draft they follow
    outputs: int = 0                # the request's output tokens when built (the draft's root sampled that index)
    scratch: int = 0                # cache position of the first query's K/V (the others follow it)


@dataclass
class Batch:
    input_ids: torch.Tensor         # [N]
    positions: torch.Tensor         # [N]
    meta: AttentionMeta
    sample_index: torch.Tensor      # [M] flat index of each sampled position
    plans: list[RowPlan]
    temperature: list[float]        # [M] sampling params of each sampled position
    top_k: list[int]
    top_p: list[float]
    u: np.ndarray                   # [M] counter-based uniforms
    num_draft_tokens: int
    # per row with committed tokens other than a decode row's: (request, first position, flat index, count) of the
    # committed tokens computed this step (their hidden states, for a drafter's past)
    spans: list[tuple[Request, int, int, int]] = field(default_factory=list)
    graph: Key | None = None        # the bucket whose static inputs hold this step (engine/graphs.py)
    # (flat index, request, offset) of the queries whose input token a step still on the device
    # samples: the request's root there plus offset (a placeholder here; engine/ahead.py fills
    # it in on the device)
    ahead: list[tuple[int, Request, int]] = field(default_factory=list)
    processed: bool = False         # some row may process its logits (logits_process.py): sampled outside graphs
    # (write rows, positions, sample index) as the host built them (every builder sets them): what a
    # model with recurrent layers plans its rows from (kv/states.py) without reading the device
    host: tuple | None = None


def build_batch(rows: list[tuple[Request, int]], drafts: dict, kv: KVCache, graphs: StepGraphs | None = None,
                follow: dict | None = None, processed: bool = False) -> Batch:
    """``rows``: (request, committed tokens to compute) in row order (request ``rows[r]`` holds
    row r of ``kv``'s block table); ``drafts``: request id -> Draft to verify; ``follow``:
    request id -> ``FollowUps`` of a row with nothing to compute. With ``graphs``, a step
    without prefill goes to the static inputs of its graph's bucket (``Batch.graph``), which
    samples in the graph where its rows allow (never with ``processed``: some row may process
    its logits, engine/logits_process.py)."""
    batch = _build(rows, drafts, kv, graphs, follow, processed)
    if kv.states is not None:                   # a model with recurrent layers: its rows' runs (kv/states.py)
        batch.meta.states = kv.states.plan(batch, [req for req, _ in rows])
        if batch.graph is not None:             # staged beside the step's other inputs
            graphs.place_states(batch.graph, batch.meta.states.host)
    return batch


def _build(rows: list[tuple[Request, int]], drafts: dict, kv: KVCache, graphs: StepGraphs | None,
           follow: dict | None, processed: bool) -> Batch:
    if not follow and len(rows) > (CHAIN_ROWS if drafts else FEW_TOKENS):
        batch = _chain_batch(rows, drafts, kv, graphs, processed) if drafts else _decode_batch(rows, kv, graphs,
                                                                                                processed)
        if batch is not None:
            batch.processed = processed
            return batch
    ids: list[int] = []
    pos: list[int] = []
    wpos: list[int] = []
    wrow: list[int] = []
    prefix: list[int] = []
    estart: list[int] = []
    ecount: list[int] = []
    extra: list[int] = []
    sample_idx: list[int] = []
    plans: list[RowPlan] = []
    temps, topk, topp = [], [], []      # per sampled position
    keys, upos = [], []                 # noise of each sampled position: (seed key, output position)
    num_draft = reads = work = 0
    spans: list[tuple[Request, int, int, int]] = []
    ahead: list[tuple[int, Request, int]] = []
    for r, (req, n) in enumerate(rows):
        start = req.num_computed_tokens
        out = req.output_token_ids
        if n == 0:
            f = follow.get(req.request_id) if follow else None
            if f is not None:
                # query i: the token after lengths[i] accepted nodes, at position start + a,
                # seeing [0, start + a) and its own K/V at the scratch position start + depth + i
                f.outputs, f.scratch = len(out), start + f.depth
                plans.append(RowPlan(req, 0, [], [], len(sample_idx), None, follow=f))
                p, h, flat0, at = req.params, len(f.lengths), len(ids), [start + a for a in f.lengths]
                ahead += [(flat0 + i, req, a) for i, a in enumerate(f.lengths)]
                sample_idx += range(flat0, flat0 + h)
                ids += [-1] * h
                pos += at
                prefix += at
                estart += range(len(extra), len(extra) + h)
                ecount += [1] * h
                extra += range(f.scratch, f.scratch + h)
                reads += sum(at) + h
                work += sum(at) + h
                wrow += [r] * h
                wpos += range(f.scratch, f.scratch + h)
                temps += [p.temperature] * h
                topk += [p.top_k] * h
                topp += [p.top_p] * h
                keys += [req.seed_key] * h
                upos += [len(out) + a + 1 for a in f.lengths]
            continue
        samples = n > 0 and start + n == len(req.prompt_token_ids) + len(out)
        draft = drafts.get(req.request_id) if samples and drafts else None
        if n == 1 and samples and draft is None:
            # a plain decode row (most rows of most steps): what the general path below makes
            # of it, without its per-row lists and ranges (host time per row is what a GPU
            # step waits on at hundreds of rows)
            plans.append(RowPlan(req, 1, [], [], len(sample_idx), None))
            sample_idx.append(len(ids))
            tok = out[-1] if out else req.prompt_token_ids[-1]
            if tok < 0:                     # sampled by a step still on the device (engine/ahead.py)
                ahead.append((len(ids), req, 0))
            ids.append(tok)
            pos.append(start)
            wrow.append(r)
            wpos.append(start)
            prefix.append(start + 1)
            estart.append(0)
            ecount.append(0)
            reads += start + 1
            work += start + 1
            p = req.params
            temps.append(p.temperature)
            topk.append(p.top_k)
            topp.append(p.top_p)
            keys.append(req.seed_key)
            upos.append(len(out))
            continue
        if n == 1 and samples and draft.is_chain:
            # a decode row verifying a chain of d nodes (the bulk of speculative steps): root
            # and nodes at consecutive positions, each seeing [0, its position], all sampled
            d, flat0, t0, p = len(draft.tokens), len(ids), len(out), req.params
            plans.append(RowPlan(req, 1, list(draft.parents), list(draft.tokens), len(sample_idx), draft))
            sample_idx += range(flat0, flat0 + d + 1)
            tok = out[-1] if out else req.prompt_token_ids[-1]
            if tok < 0:                     # its root: a step still on the device samples it (ahead_drafts.py)
                ahead.append((flat0, req, 0))
            ids.append(tok)
            ids += draft.tokens
            pos += range(start, start + d + 1)
            wrow += [r] * (d + 1)
            wpos += range(start, start + d + 1)
            prefix += range(start + 1, start + d + 2)
            estart += [0] * (d + 1)
            ecount += [0] * (d + 1)
            num_draft += d
            reads += start + d + 1
            work += (d + 1) * (start + 1) + d * (d + 1) // 2
            temps += [p.temperature] * (d + 1)
            topk += [p.top_k] * (d + 1)
            topp += [p.top_p] * (d + 1)
            keys += [req.seed_key] * (d + 1)
            upos += range(t0, t0 + d + 1)
            continue
        dtoks = draft.tokens if draft is not None else ()
        cnt = n + len(dtoks)
        if cnt == 0:
            continue
        flat0 = len(ids)
        if n > 1 or (n and not samples):   # a decode row's one position is handed out after sampling
            spans.append((req, start, flat0, n))
        ids += req.tokens(start, start + n)
        pos += range(start, start + n)
        wrow += [r] * cnt
        wpos += range(start, start + cnt)
        prefix += range(start + 1, start + n + 1)           # committed token at p sees [0, p]
        estart += [0] * n
        ecount += [0] * n
        depths = node_depths(draft.parents) if dtoks else []
        if dtoks:
            ids += dtoks
            pos += [start + n - 1 + d for d in depths]
            num_draft += len(dtoks)
            _draft_visibility(start + n, draft.parents, draft.is_chain, prefix, estart, ecount, extra)
        reads += start + cnt
        work += sum(prefix[flat0:]) + sum(ecount[flat0:])
        if samples:
            plans.append(RowPlan(req, n, list(draft.parents) if dtoks else [], list(dtoks), len(sample_idx), draft))
            sample_idx.append(flat0 + n - 1)
            sample_idx += range(flat0 + n, flat0 + cnt)
            k, p, t0 = 1 + len(dtoks), req.params, req.num_output_tokens
            temps += [p.temperature] * k
            topk += [p.top_k] * k
            topp += [p.top_p] * k
            keys += [req.seed_key] * k
            upos += [t0] + [t0 + d for d in depths]
    slots, kv_len = _slots(kv, wrow, wpos)
    longs, ints = [ids, pos, sample_idx, slots], [wrow, prefix, estart, ecount]
    u = uniforms(keys, upos)
    key, (ids_t, pos_t, sample_t, meta) = _place(longs, ints, extra or [0], u, (temps, topk, topp), len(rows),
                                                 kv_len, reads, work, kv, graphs, processed, num_draft > 0)
    return Batch(ids_t, pos_t, meta, sample_t, plans, temps, topk, topp, u, num_draft, spans, key, ahead, processed,
                 host=(wrow, pos, sample_idx))


def _decode_batch(rows: list[tuple[Request, int]], kv: KVCache, graphs: StepGraphs | None,
                  processed: bool = False) -> Batch | None:
    """``build_batch`` of a step whose every row is a plain decode row or has nothing to compute
    (waiting for room, or sitting out a step after a verification: engine/ahead_drafts.py):
    most steps of a rollout's bulk, hundreds of rows. One pass over the rows for what is their
    own, the rest in arrays; the same batch as the general path (tests/engine/test_batch.py).
    None where a row is neither (a prefill chunk, a draft)."""
    own = []
    idle = 0
    for req, n in rows:
        if n != 1:
            if n == 0:
                idle += 1
                continue
            return None
        out = req.output_token_ids
        start = req.num_computed_tokens
        if start + 1 != len(req.prompt_token_ids) + len(out):
            return None
        own.append((out[-1] if out else req.prompt_token_ids[-1], start, len(out), req.seed_key, req.params))
    if not own:
        return None
    ids, starts, upos, keys, params = zip(*own)
    m = len(own)
    index = np.arange(m, dtype=np.int64)
    if idle:                                            # each live row keeps its row of the block table
        rix, reqs = zip(*[(r, req) for r, (req, n) in enumerate(rows) if n])
        wrow = np.array(rix, dtype=np.int64)
    else:
        reqs, wrow = [req for req, _ in rows], index
    plans = [RowPlan(req, 1, [], [], i, None) for i, req in enumerate(reqs)]
    ahead = [(i, reqs[i], 0) for i, tok in enumerate(ids) if tok < 0]   # sampled by a step still on the device
    pos = np.array(starts, dtype=np.int64)
    prefix = pos + 1
    zeros = np.zeros(m, dtype=np.int64)
    reads = int(prefix.sum())
    slots = kv.slots(wrow, pos)
    temps, topk, topp = [p.temperature for p in params], [p.top_k for p in params], [p.top_p for p in params]
    u = uniforms(list(keys), list(upos))
    key, (ids_t, pos_t, sample_t, meta) = _place([list(ids), pos, index, slots], [wrow, prefix, zeros, zeros], [0],
                                                 u, (temps, topk, topp), len(rows), int(pos.max()) + 1, reads, reads,
                                                 kv, graphs, processed)
    return Batch(ids_t, pos_t, meta, sample_t, plans, temps, topk, topp, u, 0, [], key, ahead, host=(wrow, pos, index))


def _chain_batch(rows: list[tuple[Request, int]], drafts: dict, kv: KVCache,
                 graphs: StepGraphs | None, processed: bool = False) -> Batch | None:
    """``build_batch`` of a step whose every row is a plain decode row, a decode row verifying a
    chain (its root and nodes at consecutive positions, each seeing [0, its position], all
    sampled) or a row with nothing to compute: a verify step of a rollout's tail. One pass over
    the rows for what is their own, the rest in arrays (positions, write rows, noise: the
    general path's per-row lists cost ~5 us a row, most of a 64-row verify step's building);
    the same batch as the general path (tests/engine/test_batch.py). None where a row is none
    of these (a prefill chunk, a tree)."""
    own = []
    for r, (req, n) in enumerate(rows):
        if n != 1:
            if n == 0:
                continue
            return None
        out = req.output_token_ids
        start = req.num_computed_tokens
        d = drafts.get(req.request_id)
        if start + 1 != len(req.prompt_token_ids) + len(out) or (d is not None and not d.is_chain):
            return None
        own.append((r, req, out[-1] if out else req.prompt_token_ids[-1], start, len(out), d))
    if not own:
        return None
    rix, reqs, ids, starts, upos, ds = zip(*own)
    counts = np.fromiter((1 + len(d.tokens) if d is not None else 1 for d in ds), np.int64, len(own))
    total = int(counts.sum())
    entries = np.cumsum(counts) - counts                # each row's root among the step's positions
    entry = entries.tolist()
    plans = [RowPlan(req, 1, list(d.parents), list(d.tokens), e, d) if d is not None else
             RowPlan(req, 1, [], [], e, None) for req, d, e in zip(reqs, ds, entry)]
    ahead = [(e, req, 0) for e, req, tok in zip(entry, reqs, ids) if tok < 0]   # sampled by a step still on the device
    index = np.arange(total, dtype=np.int64)
    within = index - np.repeat(entries, counts)         # 0 at a row's root, then its nodes' depths
    starts_a = np.array(starts, dtype=np.int64)
    pos = np.repeat(starts_a, counts) + within
    wrow = np.repeat(np.array(rix, dtype=np.int64), counts)
    flat_ids = []
    for tok, d in zip(ids, ds):
        flat_ids.append(tok)
        if d is not None:
            flat_ids += d.tokens
    temps, topk, topp = _per_position([req.params for req in reqs], counts.tolist(), total)
    u = uniforms(np.repeat(np.array([req.seed_key for req in reqs], dtype=np.uint64), counts),
                 np.repeat(np.array(upos, dtype=np.int64), counts) + within)
    zeros = np.zeros(total, dtype=np.int64)
    reads = int(starts_a.sum()) + total                 # a row reads its K/V once: start + d + 1
    d_a = counts - 1                                    # a row's work: (d + 1)(start + 1) + d(d + 1) / 2
    work = int((counts * (starts_a + 1) + d_a * counts // 2).sum())
    key, (ids_t, pos_t, sample_t, meta) = _place([flat_ids, pos, index, kv.slots(wrow, pos)],
                                                 [wrow, pos + 1, zeros, zeros], [0], u, (temps, topk, topp),
                                                 len(rows), int(pos.max()) + 1, reads, work, kv, graphs, processed,
                                                 total > len(own))
    return Batch(ids_t, pos_t, meta, sample_t, plans, temps, topk, topp, u, int(d_a.sum()), [], key, ahead,
                 host=(wrow, pos, index))


def _per_position(params: list, counts: list[int], total: int) -> tuple[list, list, list]:
    """Each of ``total`` positions' temperature, top-k and top-p: its row's (row i has
    ``counts[i]`` positions), by list multiplication."""
    kinds = {(p.temperature, p.top_k, p.top_p) for p in params}
    if len(kinds) == 1:                                 # one way of sampling (an RL rollout's)
        (t, k, p), = kinds
        return [t] * total, [k] * total, [p] * total
    temps, topk, topp = [], [], []
    for p, c in zip(params, counts):
        temps += [p.temperature] * c
        topk += [p.top_k] * c
        topp += [p.top_p] * c
    return temps, topk, topp


def _slots(kv: KVCache, rows: list[int], positions: list[int]) -> tuple[list[int] | np.ndarray, int]:
    """The K/V slots of (row, position) pairs and the key positions the step spans (its
    largest position + 1); a few pairs in Python's ints (``FEW_TOKENS``)."""
    if len(positions) <= FEW_TOKENS:
        return kv.slot_list(rows, positions), max(positions, default=-1) + 1
    p = np.asarray(positions, dtype=np.int64)
    return kv.slots(np.asarray(rows), p), int(p.max(initial=-1)) + 1


def _place(longs: list, ints: list, extra: list, u: np.ndarray, sampling: tuple, rows: int, kv_len: int,
           reads: int, work: int, kv: KVCache, graphs: StepGraphs | None,
           processed: bool = False, drafted: bool = False) -> tuple[Key | None, tuple]:
    """A step's inputs on the device: (its graph bucket or None, (ids, positions, sample index,
    attention meta)). A step where every position samples (no prefill chunk) goes to its
    bucket's static inputs (with ``u``, the uniforms, where its graph samples: ``sampling``, the
    rows' temperatures, top-k and top-p, decide, and ``processed`` forbids); any other step, or
    one without graphs, to fresh tensors."""
    key = graphs.key(len(longs[0]), len(extra), None if processed else graph_mode(*sampling), drafted) \
        if graphs is not None and len(longs[2]) == len(longs[0]) else None
    if key is not None:
        return key, graphs.place(key, longs, ints, extra, u, rows, kv_len, reads, work)
    table = kv.table[:rows]
    (ids_t, pos_t, sample_t, slots), vis = to_device(longs, ints + [extra, table], kv.device)
    multi = len(longs[0]) > rows                        # some row has several queries (attention may group them)
    return None, (ids_t, pos_t, sample_t, AttentionMeta(slots, *vis[:5], vis[5].view(table.shape), kv_len, reads, work,
                                                        multi))


def to_device(longs: list, ints: list, device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Integer lists / arrays -> int64 and int32 tensors on ``device``, with one host-to-device
    copy (pinned and non-blocking on a GPU: the step's inputs are built on the host). Each
    tensor starts 16 bytes into the copy's buffer times some whole number: Triton compiles a
    kernel once per pattern of its pointers' 16-byte alignment, so tensors at the offsets of
    the step's sizes made it compile in the rollout (seconds a kernel on the H200 machine's
    host), whenever an eager step brought a pattern not seen before."""
    arrays = ([np.asarray(a, dtype=np.int64).ravel() for a in longs]
              + [np.asarray(a, dtype=np.int32).ravel() for a in ints])
    sizes = [len(a) for a in arrays]
    words = [2 * n for n in sizes[:len(longs)]] + sizes[len(longs):]      # int32 words each
    starts = np.concatenate([[0], np.cumsum([-(-w // 4) * 4 for w in words])])   # 16-byte steps
    flat = np.zeros(int(starts[-1]), dtype=np.int32)
    for a, at, w in zip(arrays, starts, words):
        flat[at:at + w] = a.view(np.int32)
    host = torch.from_numpy(flat)
    if torch.device(device).type != "cpu":
        host = host.pin_memory().to(device, non_blocking=True)
    out = [host[at:at + w] for at, w in zip(starts, words)]
    return [t.view(torch.int64) for t in out[:len(longs)]], out[len(longs):]


def _draft_visibility(base: int, parents: list[int], chain: bool, prefix: list[int], estart: list[int],
                      ecount: list[int], extra: list[int]) -> None:
    """Append what each draft node sees (node j sits at cache position base + j). A chain's
    cache order is its visible order: node j sees [0, base + j]. A tree node sees the
    committed prefix [0, base), then its ancestors and itself, root first."""
    d = len(parents)
    if chain:
        prefix += range(base + 1, base + d + 1)
        estart += [0] * d
        ecount += [0] * d
        return
    for j in range(d):
        path = [j]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        prefix.append(base)
        estart.append(len(extra))
        ecount.append(len(path))
        extra += [base + a for a in reversed(path)]


class ModelRunner:
    """Builds and runs a step; with ``graphs``, steps without prefill replay CUDA graphs."""

    def __init__(self, model: Transformer, kv: KVCache, graphs: StepGraphs | None = None):
        self.model = model
        self.kv = kv
        self.graphs = graphs

    def build(self, rows: list[tuple[Request, int]], drafts: dict, follow: dict | None = None,
              processed: bool = False) -> Batch:
        return build_batch(rows, drafts, self.kv, self.graphs, follow, processed)

    def run(self, batch: Batch, return_hidden: bool = False):
        """Returns logits [M, V] of the sampled positions (float32 where the model is bfloat16),
        or, where the step's graph sampled them (``Batch.graph``'s mode), its tokens and
        log-probabilities (a ``Fetched``): ``sample`` takes either; if asked, also the hidden
        states [M, H] of the sampled positions and those of every position computed [N, H]
        (normed, as the LM head reads them)."""
        if batch.graph is not None:                    # every position samples: M = N
            m = len(batch.input_ids)
            out = self.graphs.run(batch.graph)
            hidden = (out if batch.graph[2] is None else out[0])[:m]
            h = hidden = hidden.clone() if return_hidden else hidden   # the graph's output is rewritten next step
            if batch.graph[2] is not None:
                sampled = Fetched((out[1][:m], out[2][:m]))
                return (sampled, h, hidden) if return_hidden else sampled
        else:
            hidden = self.model(batch.input_ids, batch.positions, self.kv.layers(), batch.meta)
            h = hidden[batch.sample_index]
        logits = self.logits_of(h)
        return (logits, h, hidden) if return_hidden else logits

    def logits_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's logits of normed states [R, H], as ``run`` hands them to the sampler."""
        return for_sampling(self.model.logits(hidden))

    def sample(self, batch: Batch, out) -> Fetched:
        """The step's tokens and log-probabilities, not waited for: those its graph sampled, or
        the sampler's on ``run``'s logits; in a batch built ``processed``, each row's logits
        processed where its request asks (logits_process.py)."""
        if isinstance(out, Fetched):
            return out
        procs = None
        if batch.processed:                        # a row's last token fed on the device: its input there
            pending = {id(req): batch.input_ids[i] for i, req, k in batch.ahead if k == 0}
            procs = positions(batch.plans, len(batch.temperature), self.model.args.eos_token_ids, pending)
        return sample_async(out, batch.temperature, batch.top_k, batch.top_p, batch.u, procs)
