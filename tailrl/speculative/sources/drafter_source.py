"""The learned drafter as a draft source: chains and trees grown from the target's hidden state.

A request can be drafted for once the engine has kept the hidden state that sampled its last
token (``req.last_hidden``, position r = num_tokens - 2; the engine keeps it when a source
has ``needs_hidden``). The draft's first drafter step sits at r with that state and the last
token; depth d sits at r + d - 1. Every step attends over the request's committed positions
< r (``DrafterPast``, fed by ``observe_hidden`` with the states the engine computed anyway:
prompt positions from the prefill, emitted tokens after verification) and over the draft
positions on its own path. The node probabilities of the draft are the drafter's own
softmax probabilities, so the draft's score (expected accepted length) is what the drafter
believes; at temperature 1 a point-mass draft token x is accepted with the target's p(x),
which the drafter is trained to match.

Tree shape (EAGLE-2-like, but with a fixed width): at each depth every frontier node offers
its ``max_paths`` most likely children, and the ``max_paths`` candidates of highest path
probability (within the node budget) become the next depth's nodes and frontier. With
``max_paths == 1`` this is the greedy chain. A path stops when its probability falls below
``min_path_prob`` (a node that unlikely costs a verify slot for almost nothing).

Batching: ``prepare(requests, max_tokens, max_paths)`` (called by the speculator once per
step) drafts for every ready request in one set of batched drafter steps; ``propose`` then
hands out the prepared draft, or drafts that one request alone if it was not prepared.
Every drafter step runs on the engine's kernels, each row reading its past in place from the
drafter's K/V blocks (``tailrl.drafter.paged``: a step is ~15 operations; a chain's depth on a
GPU engine is one graph replay, ``tailrl.drafter.graphs``; a tree's nodes see their paths as
the target's tree verify does). Per-request state: the committed K/V
(freed in ``finish``; ``export`` / ``adopt`` move them with a migrating request) and this
step's prepared drafts.

Precision. With ``fast_dtype`` (bfloat16, given for a bfloat16 target) the drafter drafts and
computes its committed K/V in a copy of itself in that dtype (``LowPrecision``), the dtype of
its blocks. On the kernels that copy steps faster than the float32 drafter, or about as fast,
at every row count measured (``benchmarks/drafter_step.py`` on the 2-core CPU: `small`'s
drafter 0.12 vs 0.13 ms at 1 row, 0.64 vs 1.47 ms at 64; a 0.5B-shaped one 2.7 vs 10.9 ms at
1 row), so no per-call choice between them is kept.

Depth. A chain is grown one drafter step at a time, for all rows at once. Given the value of
an expected accepted token and the verify cost of a node (``pricing``, set by the speculator
per call from its measured prices under the priced policy), growing stops once the next depth could not pay for its
own step: the rows' path probabilities bound the next depth's expected accepted tokens, so a
step is taken only while ``sum(max(path_prob * value - node_cost, 0)) > step_seconds`` (the
measured seconds of one drafter step at this row count). So a drafter that is cheap next to
its target drafts deep, an expensive one only as deep as its confidence pays for.
"""
from __future__ import annotations

import copy
import logging
import os
import time
from typing import Any

import torch

from tailrl.drafter.graphs import DrafterGraphs
from tailrl.drafter.network import Drafter
from tailrl.drafter.paged import ChainLayout, TreeLayout, kernels_for, paged_step, rope_tables
from tailrl.drafter.past import DrafterPast, PastState
from tailrl.speculative.draft import Draft

log = logging.getLogger(__name__)

TRIES = 2          # calls per row bucket whose best step time stands before an average is kept


class StepMeter:
    """Seconds of one drafter step per row bucket (powers of two): the best of the first
    ``TRIES`` calls (the first call of a shape builds its kernels), then an average with
    forgetting."""

    def __init__(self, decay: float = 0.8) -> None:
        self.decay = decay
        self._tried: dict[int, list[float]] = {}
        self._step_s: dict[int, float] = {}

    @staticmethod
    def bucket(rows: int) -> int:
        return 1 << max(rows - 1, 0).bit_length()

    def observe(self, rows: int, step_seconds: float) -> None:
        b = self.bucket(rows)
        tried = self._tried.setdefault(b, [])
        if len(tried) < TRIES:
            tried.append(step_seconds)
        else:
            old = self._step_s.get(b, min(tried))
            self._step_s[b] = self.decay * old + (1 - self.decay) * step_seconds

    def step_seconds(self, rows: int) -> float | None:
        """Seconds of one step at this row count; None before any was measured."""
        b = self.bucket(rows)
        tried = self._tried.get(b)
        return self._step_s.get(b, min(tried)) if tried else None


class DrafterSource:
    name = "drafter"
    observes = False            # its observe does nothing (the speculator need not call it)
    needs_hidden = True

    def __init__(self, drafter: Drafter, min_path_prob: float = 0.0, fast_dtype: torch.dtype | None = None):
        self.drafter = drafter.eval()
        self.min_path_prob = min_path_prob
        self._ready: dict[str, tuple[int, int, Draft | None]] = {}   # id -> (num_tokens, paths, draft)
        self.fast = LowPrecision(self.drafter, fast_dtype) if fast_dtype not in (None, torch.float32) else None
        self.past = DrafterPast(self.drafter, self.fast.get if self.fast is not None else None)
        self.step_time = StepMeter()                   # one drafter step's seconds per row bucket
        self.out_of_memory = 0                         # calls that ran out of device memory
        # (seconds an expected accepted token is worth, seconds a verified node costs), set per
        # call by the speculator: chains grow only as deep as pays (None: to the node budget)
        self.pricing: tuple[float, float] | None = None
        self.graphs: DrafterGraphs | None = None      # chain depths replayed from graphs (a GPU engine's)
        # a chain's next depth launched before the last one's end is read (``_chains``); None: on a GPU
        self.depth_ahead: bool | None = None
        # a call's chains from one graph of all its depths (``DrafterGraphs.chain``): off until measured
        # on a GPU (TAILRL_DRAFTER_WHOLE_CHAINS=1 turns it on)
        self.whole_chains = os.environ.get("TAILRL_DRAFTER_WHOLE_CHAINS", "0") == "1"

    def use_graphs(self, pool: Any) -> None:
        """Replay chain depths from CUDA graphs kept in the engine's graph ``pool``."""
        self.graphs = DrafterGraphs(pool)

    def start(self, req: Any) -> None:
        pass

    def observe(self, req: Any, new_tokens: list[int]) -> None:
        pass

    def observe_hidden(self, hidden: torch.Tensor, spans: list[tuple[Any, int, int, int]]) -> None:
        """A step's committed states (see ``Speculator.observe_hidden``)."""
        self.past.add_spans(hidden, spans)

    def pending(self, req: Any) -> int:
        """Positions of ``req`` whose drafter K/V the next draft for it computes first."""
        return self.past.pending(req)

    def finish(self, req: Any) -> None:
        self._ready.pop(req.request_id, None)
        self.past.free(req)

    def export(self, req: Any) -> PastState | None:
        """What ``req`` takes to another instance to draft there as here (its past; the
        state at its draft root travels with the request itself: ``RequestState.hidden``)."""
        return self.past.export(req)

    def adopt(self, req: Any, state: PastState) -> None:
        """``req`` arrived from another instance with ``export``'s state."""
        self.past.adopt(req, state)

    def target_updated(self, model: Any) -> None:
        """The target's weights changed: the drafter reads its embedding and head anew."""
        self.drafter.share_target(model)

    def prepare(self, requests: list[Any], max_tokens: int, max_paths: int) -> None:
        """Draft for all ``requests`` with a current hidden state, batched."""
        ready = [r for r in requests if r.last_hidden is not None]
        drafts = self.grow(ready, max_tokens, max_paths)
        self._ready = {r.request_id: (r.num_tokens, max_paths, d) for r, d in zip(ready, drafts)}

    def propose(self, req: Any, max_tokens: int, max_paths: int) -> Draft | None:
        hit = self._ready.pop(req.request_id, None)
        if hit is not None and hit[:2] == (req.num_tokens, max_paths):
            d = hit[2]
        elif req.last_hidden is not None:
            d = self.grow([req], max_tokens, max_paths)[0]
        else:
            return None
        return d.truncate(max_tokens) if d is not None else None

    @torch.inference_mode()
    def grow(self, requests: list[Any], max_tokens: int, max_paths: int) -> list[Draft | None]:
        """One draft per request (None when no node clears ``min_path_prob``): in the drafter
        copy whose dtype the blocks hold (the bfloat16 one with a bfloat16 target). Out of
        device memory (its blocks grow with the requests' pasts, outside the engine's K/V
        budget), a call drafts nothing: drafts are optional, the rollout goes on."""
        if not requests or max_tokens <= 0:
            return [None] * len(requests)
        try:
            return self._grow(requests, max_tokens, max_paths)
        except torch.OutOfMemoryError as exc:
            self.out_of_memory += 1
            if self.out_of_memory == 1:
                log.warning("drafter: out of device memory (%s); calls that run out draft nothing (the drafter's "
                            "K/V blocks: %d MiB; a lower gpu_memory_utilization leaves it more room)",
                            str(exc).splitlines()[0], self.past.pool.nbytes >> 20)
            return [None] * len(requests)

    def _grow(self, requests: list[Any], max_tokens: int, max_paths: int) -> list[Draft | None]:
        width = max(1, max_paths)
        drafter = self.past.compute()
        self.past.flush(requests)
        roots = [r.num_tokens - 2 for r in requests]                           # where last_hidden sits
        dev = drafter.fc.weight.device                                          # the target's
        feats = torch.stack([r.last_hidden.to(dev) for r in requests])          # [B, H] (imported: on the host)
        toks = torch.tensor([r.output_token_ids[-1] if r.output_token_ids else r.prompt_token_ids[-1]
                             for r in requests], device=dev)                    # [B]
        pool = self.past.pool
        # a tree's root step takes an index of its own before its nodes
        lists, seen, lent = self.past.draft_blocks(requests, roots, max_tokens + (width > 1))
        captures = self.graphs.pool.captures if self.graphs is not None else 0
        t0, steps = time.perf_counter(), [0]
        try:
            kernels = kernels_for(drafter)
            tables = rope_tables(drafter, max(roots) + max_tokens + 1, drafter.fc.weight.dtype)
            if width == 1:
                layout = ChainLayout.build(pool, lists, seen, roots, max_tokens)
                return self._chains(drafter, kernels, tables, layout, feats, toks, max_tokens, steps)
            return self._tree(drafter, kernels, tables, TreeLayout(pool, lists, seen, roots), feats, toks,
                              max_tokens, width, steps)
        finally:
            for ids in lent:
                pool.release(ids)
            # a call that captured a graph is not timed: a capture costs far more than a step
            if steps[0] and (self.graphs is None or self.graphs.pool.captures == captures):
                self.step_time.observe(len(requests), (time.perf_counter() - t0) / steps[0])

    def _price(self, rows: int) -> tuple[float, float, float] | None:
        """(seconds an expected accepted token is worth, a verified node's cost, one drafter
        step's seconds at ``rows`` rows), or None while any is unknown (no depth limit)."""
        step_s = self.step_time.step_seconds(rows) if self.pricing is not None else None
        return None if step_s is None else (*self.pricing, step_s)

    def _deeper(self, path_probs: list[float], rows: int) -> bool:
        """Whether one more drafter step for these paths' children can pay for itself."""
        price = self._price(rows)
        if price is None:
            return True
        value, node_cost, step_s = price
        return sum(max(p * value - node_cost, 0.0) for p in path_probs) > step_s

    def _chains_end(self, path_prob: torch.Tensor) -> bool:
        """Whether every chain fell below ``min_path_prob`` or one more step could not pay
        (``_deeper`` on the device's path probabilities): one read from the device."""
        ended = (path_prob < self.min_path_prob).all()
        price = self._price(len(path_prob))
        if price is None:
            return bool(ended)
        value, node_cost, step_s = price
        gain = (path_prob.double() * value - node_cost).clamp(min=0).sum()
        ended, gain = torch.stack([ended.double(), gain]).tolist()
        return ended > 0 or gain <= step_s

    def _tree(self, drafter: Drafter, kernels: Any, tables: Any, layout: TreeLayout, feats: torch.Tensor,
              toks: torch.Tensor, max_tokens: int, width: int, steps: list[int]) -> list[Draft | None]:
        """Trees of ``width`` paths (see the module docstring), every node's step on the
        engine's kernels over the requests' blocks (``TreeLayout``: a node sees the committed
        positions, then its path)."""
        n = len(toks)
        nodes: list[tuple[list[int], list[int], list[float]]] = [([], [], []) for _ in range(n)]
        # frontier entries, one per row of feats / toks: (request index, node index (-1 = root), path prob)
        frontier = [(b, -1, 1.0) for b in range(n)]
        paths: list[list[int]] = [[] for _ in range(n)]           # per frontier row: its node path
        while frontier:
            meta, pos = layout.meta([(b, path) for (b, _, _), path in zip(frontier, paths)])
            feats, logits = paged_step(drafter, kernels, feats, toks, kernels.rope(tables, pos), layout.pool, meta)
            steps[0] += 1
            top_p, top_t = torch.softmax(logits.float(), -1).topk(width, dim=-1)   # [F, width]
            top_t = drafter.token_ids(top_t)
            chosen = self._choose(frontier, top_p.tolist(), top_t.tolist(), nodes, max_tokens, width)
            parents = paths
            frontier, rows, new_toks = self._append(chosen, nodes)
            if not frontier or not self._deeper([f[2] for f in frontier], len(frontier)):
                break
            paths = [parents[row] + [j] for row, (_, j, _) in zip(rows, frontier)]
            idx = torch.tensor(rows, device=feats.device)
            feats, toks = feats[idx], torch.tensor(new_toks, device=feats.device)
        return [Draft.unchecked(t, p, q, self.name) if t else None for t, p, q in nodes]

    def _chains(self, drafter: Drafter, kernels: Any, tables: Any, layout: ChainLayout, feats: torch.Tensor,
                toks: torch.Tensor, max_tokens: int, steps: list[int]) -> list[Draft | None]:
        """Greedy chains for all rows in tensor ops (no per-row Python per depth), on the
        engine's kernels: each depth's K/V are written into the requests' blocks after their
        committed past (``ChainLayout``), each depth replayed from a graph where the engine
        keeps them (a GPU's), else launched. A chain ends before its first node whose path
        probability is below ``min_path_prob``; all end where one more step could not pay
        (``_chains_end``). On a GPU (``depth_ahead``) depth t + 1 is launched before depth t's
        end is read, so the device computes it while the host waits for that read; where the
        chains end at t, depth t + 1 is dropped unread (its K/V sit past the chain, where any
        rejected draft's do): the same chains, one depth more computed at their end. With
        ``whole_chains`` every depth comes from one graph and the chains are cut on the host
        (``_cut``): the same chains again, every depth computed."""
        pool = self.past.pool
        if self.whole_chains and self.graphs is not None:
            got = self.graphs.chain(drafter, kernels, tables, pool, layout, feats, toks)
            if got is not None:
                steps[0] += got[0].shape[1]
                return self._cut(*got)
        tokens, probs = [], []
        path_prob = torch.ones(len(toks), device=toks.device)
        ahead = self.depth_ahead if self.depth_ahead is not None else toks.device.type == "cuda"
        last: torch.Tensor | None = None      # with ``ahead``: the depth before's path probabilities, unread
        for t in range(max_tokens):
            got = self.graphs.depth(drafter, kernels, tables, pool, layout, t, feats, toks) \
                if self.graphs is not None else None
            if got is None:
                feats, logits = paged_step(drafter, kernels, feats, toks, kernels.rope(tables, layout.positions[t]),
                                           pool, layout.meta(t))
                q, toks = torch.softmax(logits.float(), -1).max(-1)
                toks = drafter.token_ids(toks)
            else:             # views of the graph's outputs, which the next depth's replay overwrites
                feats, q, toks = got[0], got[1].clone(), got[2].clone()
            steps[0] += 1
            if last is not None and self._chains_end(last):
                break                         # this depth was launched ahead of the end: not kept
            tokens.append(toks)
            probs.append(q)
            path_prob = path_prob * q
            if t + 1 == max_tokens:
                break
            if ahead:
                last = path_prob
            elif self._chains_end(path_prob):
                break
        return self._drafts(torch.stack(probs, 1).cpu(), torch.stack(tokens, 1).tolist())   # one wait

    def _cut(self, q_dev: torch.Tensor, t_dev: torch.Tensor) -> list[Draft | None]:
        """The chains of a call computed whole (``DrafterGraphs.chain``), cut where the depth
        after depth walk would have stopped (``_chains_end`` after each depth, read on the host):
        the same drafts."""
        q_all = q_dev.cpu()                                     # one wait
        path_prob, depths = torch.ones(q_all.shape[0], dtype=q_all.dtype), q_all.shape[1]
        for t in range(depths - 1):
            path_prob = path_prob * q_all[:, t]
            if self._chains_end(path_prob):
                depths = t + 1
                break
        return self._drafts(q_all[:, :depths], t_dev[:, :depths].tolist())

    def _drafts(self, q_all: torch.Tensor, t_rows: list[list[int]]) -> list[Draft | None]:
        """Each row's chain (``q_all`` [B, depths] on the host) up to its first node whose path
        probability is below ``min_path_prob``."""
        keep = (q_all.cumprod(1) >= self.min_path_prob).cumprod(1).sum(1).tolist()      # [B]
        q_rows = q_all.tolist()
        return [Draft.unchecked(t[:k], list(range(-1, k - 1)), q[:k], self.name, chain=True) if k else None
                for t, q, k in zip(t_rows, q_rows, keep)]

    def _choose(self, frontier, probs, tokens, nodes, max_tokens: int, width: int) -> list[tuple]:
        """Per request, the ``width`` best children (by path probability) of its frontier
        nodes that fit the node budget and clear ``min_path_prob``. Returns entries
        (request index, frontier row, parent node, token, conditional prob, path prob)."""
        cands: dict[int, list[tuple]] = {}
        for row, (b, node, pp) in enumerate(frontier):
            for q, t in zip(probs[row], tokens[row]):
                if pp * q >= self.min_path_prob:
                    cands.setdefault(b, []).append((b, row, node, t, q, pp * q))
        chosen = []
        for b, cs in cands.items():
            room = max_tokens - len(nodes[b][0])
            cs.sort(key=lambda c: -c[5])
            chosen += cs[:min(width, room)]
        return chosen

    @staticmethod
    def _append(chosen: list[tuple], nodes) -> tuple[list[tuple], list[int], list[int]]:
        """Add the chosen children as draft nodes; they are the next frontier. Returns (frontier,
        the drafter-output row each continues from, their tokens)."""
        frontier, rows, toks = [], [], []
        for b, row, parent, t, q, pp in chosen:
            tokens, parents, probs = nodes[b]
            tokens.append(t)
            parents.append(parent)
            probs.append(q)
            frontier.append((b, len(tokens) - 1, pp))
            rows.append(row)
            toks.append(t)
        return frontier, rows, toks


class LowPrecision:
    """The drafter in a faster dtype (bfloat16 when the target runs in it), its weights copied
    again, in place, when the drafter's change (a published spot-trainer version, the target's
    embedding and head after an RL update: every in-place write bumps a tensor's version). In
    place: the copy keeps its tensors, so graphs captured over it stay valid, and a version
    costs no new allocation of the (vocabulary-sized) head."""

    def __init__(self, drafter: Drafter, dtype: torch.dtype) -> None:
        self.drafter, self.dtype = drafter, dtype
        self._copy: Drafter | None = None
        self._key: tuple = ()

    def get(self) -> Drafter:
        key = tuple(t._version for t in (*self.drafter.parameters(), *self.drafter.buffers()))
        if self._copy is not None and key == self._key:
            return self._copy
        with torch.inference_mode(False), torch.no_grad():     # normal tensors: updatable outside it too
            if self._copy is None:
                self._copy = copy.deepcopy(self.drafter).to(self.dtype).eval()
            else:
                for mine, theirs in zip((*self._copy.parameters(), *self._copy.buffers()),
                                        (*self.drafter.parameters(), *self.drafter.buffers()), strict=True):
                    mine.copy_(theirs)
        self._key = key
        return self._copy
