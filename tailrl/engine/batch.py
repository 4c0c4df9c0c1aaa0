"""Build one step's flat batch from scheduled rows and drafts, and run the model on it.

Row r's new tokens are its committed tokens [computed, computed + n) followed by its draft
nodes. They are written at consecutive cache positions; draft node j gets RoPE position
computed + n - 1 + depth(j). Sampled positions: the last committed token of every row that is
caught up (the root) and every draft node. A draft tree gets an ancestor mask over its nodes;
chains and committed tokens are plain causal.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tailrl.engine.request import Request
from tailrl.engine.sampler import uniform
from tailrl.model.attention import AttentionMeta
from tailrl.model.transformer import Transformer

ALONE_MIN_TOKENS = 33      # rows with more new tokens (prefill chunks) attend alone


def node_depths(parents: list[int]) -> list[int]:
    """Depth of each draft node; children of the root (-1) have depth 1."""
    depth: list[int] = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return depth


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[d, d] bool: node i may see node j iff j is i or an ancestor of i."""
    d = len(parents)
    m = torch.eye(d, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            m[i] |= m[p]
    return m


@dataclass
class RowPlan:
    """A row that samples this step."""
    req: Request
    n: int                          # committed tokens computed this step
    parents: list[int]              # draft tree ([] = plain decode)
    draft_tokens: list[int]
    entry: int                      # index of its root among the sampled positions; nodes follow
    draft: object = None            # the Draft it verifies (None = plain decode)


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
    u: list[float]                  # [M] counter-based uniforms
    num_draft_tokens: int


def build_batch(rows: list[tuple[Request, int]], drafts: dict, kv_groups: int, device,
                dtype: torch.dtype = torch.float32) -> Batch:
    ids: list[int] = []
    pos: list[int] = []
    wpos: list[int] = []
    wrow: list[int] = []
    sample_idx: list[int] = []
    plans: list[RowPlan] = []
    temps: list[float] = []
    topk: list[int] = []
    topp: list[float] = []
    us: list[float] = []
    starts: list[int] = []
    counts: list[int] = []
    trees: list[tuple[int, int, list[int]]] = []
    alone: list[tuple[int, int, int, int]] = []
    num_draft = 0
    for r, (req, n) in enumerate(rows):
        start = req.num_computed_tokens
        samples = n > 0 and start + n == req.num_tokens
        draft = drafts.get(req.request_id) if samples else None
        parents = list(draft.parents) if draft is not None else []
        dtoks = list(draft.tokens) if draft is not None else []
        cnt = n + len(dtoks)
        flat0 = len(ids)
        ids += req.tokens(start, start + n)
        pos += range(start, start + n)
        depths = node_depths(parents)
        if dtoks:
            ids += dtoks
            pos += [start + n - 1 + d for d in depths]
            num_draft += len(dtoks)
            if any(p != j - 1 for j, p in enumerate(parents)):
                trees.append((r, n, parents))
        wrow += [r] * cnt
        wpos += range(start, start + cnt)
        if samples:
            plans.append(RowPlan(req, n, parents, dtoks, len(sample_idx), draft))
            sample_idx.append(flat0 + n - 1)
            sample_idx += range(flat0 + n, flat0 + cnt)
            p = req.params
            t0 = req.num_output_tokens
            for d in [0] + depths:
                temps.append(p.temperature)
                topk.append(p.top_k)
                topp.append(p.top_p)
                us.append(uniform(req.seed_key, t0 + d))
        if cnt >= ALONE_MIN_TOKENS and not dtoks:
            alone.append((r, flat0, cnt, start))
            cnt = 0                                     # not in the batched call
        starts.append(start)
        counts.append(cnt)
    meta = _attention_meta(wrow, wpos, starts, counts, trees, alone, kv_groups, device, dtype)
    as_long = dict(dtype=torch.long, device=device)
    return Batch(torch.tensor(ids, **as_long), torch.tensor(pos, **as_long), meta,
                 torch.tensor(sample_idx, **as_long), plans, temps, topk, topp, us, num_draft)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool (True = attend) -> 0 / -inf float mask: SDPA's CPU kernels run it about 2x faster."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _attention_meta(wrow, wpos, starts, counts, trees, alone, groups, device, dtype) -> AttentionMeta:
    as_long = dict(dtype=torch.long, device=device)
    meta = AttentionMeta(torch.tensor(wrow, **as_long), torch.tensor(wpos, **as_long), alone=alone)
    for row, flat0, cnt, start in alone:
        i = torch.arange(cnt, device=device)[:, None]
        j = torch.arange(start + cnt, device=device)[None, :]
        meta.alone_masks.append(_additive((j <= start + i).repeat(groups, 1)[None, None], dtype))
    tq = max(counts, default=0)
    if tq == 0:
        return meta
    r = len(counts)
    start = torch.tensor(starts, **as_long)
    cnt = torch.tensor(counts, **as_long)
    s = int((start + cnt).max())
    i = torch.arange(tq, device=device)
    j = torch.arange(s, device=device)
    mask = j[None, None, :] <= (start[:, None, None] + i[None, :, None])       # [R, Tq, S] causal
    pad = i[None, :] >= cnt[:, None]                                            # [R, Tq]
    if bool(pad.any()):
        mask = torch.where(pad[:, :, None], (j == 0)[None, None, :], mask)     # padding sees key 0
    for row, n, parents in trees:
        d = len(parents)
        st = starts[row] + n
        mask[row, n:n + d, st:st + d] = ancestor_mask(parents).to(device)
    meta.num_rows, meta.tq, meta.kv_len = r, tq, s
    meta.mask = _additive(mask.unsqueeze(1).repeat(1, 1, groups, 1) if groups > 1 else mask.unsqueeze(1), dtype)
    meta.uniform = not bool(pad.any()) and not alone
    if not meta.uniform:
        slots = [row * tq + k for row, c in enumerate(counts) for k in range(c)]
        flat = [f for f0, c in _row_spans(counts, alone) for f in range(f0, f0 + c)]
        meta.slot_index = torch.tensor(slots, **as_long)
        meta.flat_index = torch.tensor(flat, **as_long)
    return meta


def _row_spans(counts: list[int], alone: list[tuple[int, int, int, int]]):
    """(flat start, batched count) per row, in flat order; an alone row's tokens are skipped."""
    alone_len = {row: c for row, _, c, _ in alone}
    flat0 = 0
    for row, c in enumerate(counts):
        yield flat0, c
        flat0 += c + alone_len.get(row, 0)


@dataclass
class _Chain:
    tokens: list[int]

    @property
    def parents(self) -> list[int]:
        return list(range(-1, len(self.tokens) - 1))


class ModelRunner:
    def __init__(self, model: Transformer, kv_data_fn):
        self.model = model
        self.kv_data_fn = kv_data_fn                 # () -> current [L, 2, rows, KV, cap, D] tensor
        a = model.args
        self.groups = a.num_heads // a.num_kv_heads
        self._scratch: dict = {}                     # synthetic_step's last shape: (rows, drafts, K/V)

    def build(self, rows: list[tuple[Request, int]], drafts: dict) -> Batch:
        w = self.model.embed.weight
        return build_batch(rows, drafts, self.groups, w.device, w.dtype)

    def synthetic_step(self, batch_size: int, num_tokens: int, context: int = 128) -> None:
        """One step of `batch_size` rows, `num_tokens` new tokens in all (1 + chain drafts per
        row), each over `context` cached positions, on scratch K/V: batch building, forward and
        sampling, as an engine step costs, for calibrating the cost model. The scratch K/V and
        requests of a shape are made on its first call (calibration's warm-up) and kept."""
        from tailrl.engine.sampler import sample
        per_row = max(num_tokens // batch_size, 1)
        key = (batch_size, per_row, context)
        if key not in self._scratch:
            from tailrl.config import SamplingParams
            a = self.model.args
            w = self.model.embed.weight
            kv = torch.zeros(a.num_layers, 2, batch_size, a.num_kv_heads, context + per_row, a.head_dim,
                             dtype=w.dtype, device=w.device)
            rows, drafts = [], {}
            for i in range(batch_size):
                req = Request(f"synthetic-{i}", [1] * (context + 1), SamplingParams(), i, num_computed_tokens=context)
                rows.append((req, 1))
                if per_row > 1:
                    drafts[req.request_id] = _Chain([1] * (per_row - 1))
            self._scratch = {key: (rows, drafts, kv)}
        rows, drafts, kv = self._scratch[key]
        w = self.model.embed.weight
        batch = build_batch(rows, drafts, self.groups, w.device, w.dtype)
        hidden = self.model(batch.input_ids, batch.positions, kv, batch.meta)
        sample(self.model.logits(hidden[batch.sample_index]), batch.temperature, batch.top_k, batch.top_p, batch.u)

    def run(self, batch: Batch, return_hidden: bool = False):
        """Returns logits [M, V] of the sampled positions (and their hidden states if asked)."""
        hidden = self.model(batch.input_ids, batch.positions, self.kv_data_fn(), batch.meta)
        h = hidden[batch.sample_index]
        logits = self.model.logits(h)
        if logits.dtype == torch.bfloat16:             # sample in float32: bf16 CDFs are too coarse
            logits = logits.float()
        return (logits, h) if return_hidden else logits
