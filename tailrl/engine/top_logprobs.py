"""vLLM's ``SamplingParams.logprobs = N``: for each output token, the N most probable tokens
of the distribution it was reported under, with the sampled token, each with its rank.

The distribution is the one ``CompletionOutput.logprobs`` reports: log_softmax(logits / T)
(T = 1 for greedy rows), unfiltered by top-k, top-p or logit processing (sampler.py). The
values come from the step's own logits with the sampler's own normaliser, so the sampled
token's entry equals its ``logprobs`` float bit for bit, and because every row of a step is
computed on its own, a request's alternatives are the same with and without speculation, alone
or in a batch (bfloat16 and float64; tests/engine/test_top_logprobs.py).

vLLM's ``prompt_logprobs = N`` the same way for the prompt: position p's logits, computed by the
request's own prefill (so it takes no cached prefix), give prompt token p + 1's entry.

Ties go to the lower token id, whatever the batch, and ranks count from 1 in that order; a
sampled token outside the top N gets 1 + the number of tokens strictly more probable.
A step computes them only for the rows of requests that ask (``RowPlan.rows``: the rows that
sampled the tokens it kept).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tailrl.engine.sampler import _normaliser, _scale

if TYPE_CHECKING:
    from tailrl.engine.batch import Batch


def wants(params) -> bool:
    """Whether a request with these SamplingParams asks for alternatives (``logprobs`` >= 1 or
    ``prompt_logprobs`` set): it is stepped one step at a time, its logits read after sampling."""
    return bool(params.logprobs) or params.prompt_logprobs is not None


def top_entries(logits: torch.Tensor, temperature: list[float], tokens: list[int], n: int
                ) -> list[dict[int, tuple[float, int]]]:
    """logits [M, V] of the rows that sampled ``tokens`` -> per row {token id: (log-probability,
    rank)} of its ``n`` most probable tokens and its sampled token, in rank order (the sampled
    token last where it is not among them). All rows in a few passes;
    a row whose n-th and (n+1)-th values tie (rare) picks its n by id on its own."""
    scaled = _scale(logits, temperature)
    logp = scaled - _normaliser(scaled, temperature)[0][:, None]
    m, v = logp.shape
    tok = torch.tensor(tokens, device=logp.device)[:, None]
    tok_lp = logp.gather(1, tok)                                # [M, 1]
    tok_rank = (logp > tok_lp).sum(dim=1) + 1
    if n == 0:                                                  # the token alone, with its rank
        return [{t: (lp, r)} for t, lp, r in zip(tokens, tok_lp[:, 0].tolist(), tok_rank.tolist())]
    n = min(n, v)
    k = min(n + 1, v)
    vals, ids = logp.topk(k, dim=-1)                            # [M, k], by value (ties: any order)
    by_id = ids.sort(dim=-1, stable=True)                       # ties to the lower id: sort by id, then
    vals = vals.gather(1, by_id.indices)                        # stably by value
    order = vals.sort(dim=-1, descending=True, stable=True).indices
    vals, ids = vals.gather(1, order), by_id.values.gather(1, order)
    edge = (vals[:, n - 1] == vals[:, n]) if k > n else torch.zeros(m, dtype=torch.bool, device=logp.device)
    vals_l, ids_l = vals[:, :n].tolist(), ids[:, :n].tolist()
    tok_l, rank_l, edge_l = tok_lp[:, 0].tolist(), tok_rank.tolist(), edge.tolist()
    out = []
    for i, t in enumerate(tokens):
        if edge_l[i]:                                           # the n-th place tied: the lower ids win it
            row = logp[i]
            cand = (row >= vals[i, n - 1]).nonzero().squeeze(1)  # ascending ids
            best = cand[row[cand].sort(descending=True, stable=True).indices[:n]]
            ids_l[i], vals_l[i] = best.tolist(), row[best].tolist()
        entry = {a: (b, r) for r, (a, b) in enumerate(zip(ids_l[i], vals_l[i]), start=1)}
        if t not in entry:
            entry[t] = (tok_l[i], rank_l[i])
        out.append(entry)
    return out


def attach(batch: "Batch", logits: torch.Tensor) -> None:
    """After a step's commit: the alternatives of each token it appended to a request that asks,
    from ``logits`` [M, V] (the step's sampled positions), appended to that request's
    ``output_top_logprobs``. One pass per distinct N over the asking rows."""
    by_n: dict[int, list] = {}
    for plan in batch.plans:
        req = plan.req
        if req.params.logprobs and plan.rows:
            by_n.setdefault(req.params.logprobs, []).append(plan)
    for n, plans in by_n.items():
        rows = [i for p in plans for i in p.rows]
        temps = [batch.temperature[i] for i in rows]
        toks = [t for p in plans for t in p.req.output_token_ids[len(p.req.output_token_ids) - len(p.rows):]]
        entries = top_entries(logits[torch.tensor(rows, device=logits.device)], temps, toks, n)
        k = 0
        for p in plans:
            if p.req.output_top_logprobs is None:
                p.req.output_top_logprobs = []
            p.req.output_top_logprobs += entries[k:k + len(p.rows)]
            k += len(p.rows)


def attach_prompt(batch: "Batch", computed: torch.Tensor, logits_of) -> None:
    """After a step's forward: for each prefill span of a request that asks for prompt logprobs,
    the entries of the prompt tokens its positions predict (position p predicts token p + 1),
    from ``computed`` [N, H] (every computed position's normed state) through ``logits_of`` (the
    LM head, float32 as sampled); positions recorded before (a preempted request's recompute)
    are skipped. Entries go to ``prompt_top_logprobs``, in order."""
    for req, start, flat0, n in batch.spans:
        if not req.prompt_logprobs_pending:
            continue
        done = len(req.prompt_top_logprobs or ())
        first, end = max(start, done), min(start + n, req.num_prompt_tokens - 1)
        if first != done or end <= first:              # nothing new here (or a gap: positions before missing)
            continue
        rows = torch.arange(flat0 + first - start, flat0 + end - start, device=computed.device)
        targets = req.prompt_token_ids[first + 1:end + 1]
        entries = top_entries(logits_of(computed[rows]), [req.params.temperature] * len(targets), targets,
                              req.params.prompt_logprobs)
        req.prompt_top_logprobs = (req.prompt_top_logprobs or []) + entries
