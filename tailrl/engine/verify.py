"""Verification of speculative drafts (chains and trees): the rule and its bookkeeping.

``accept_draft`` is the rule, a pure function over token lists; ``commit`` applies it to one
row of a step: which tokens the request keeps, where the accepted nodes' K/V go, and when the
request stops.

Math. Let y_t = S(p(. | x_<t), u_t) be the token plain decoding emits at position t, where S
is the sampler (sampler.py) and u_t the counter-based uniform of (request, t). The verification
forward gives p(. | prefix, path to node) for the root and every draft node, so we can compute
the target token after each node with the same S and u. Walking from the root, a child is
accepted iff its token equals the target token at its parent; the first mismatch emits the
target token (the "bonus"). Every emitted token is therefore exactly the token plain decoding
emits at that position: the output is identical path by path, hence the distribution is the
target's at any temperature / top-k / top-p. For a deterministic draft token x this accepts
with probability p(x), the same as standard rejection sampling with a point-mass proposal.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from tailrl.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from tailrl.engine.batch import RowPlan
    from tailrl.engine.kv import KVCache


def accept_draft(parents: list[int], draft_tokens: list[int], targets: list[int]) -> tuple[list[int], list[int]]:
    """parents[j]: parent node of draft node j (-1 = the root, i.e. the last committed token).
    targets[0]: target token after the root; targets[1 + j]: target token after node j.
    Returns (emitted tokens, accepted node indices); len(emitted) == len(accepted) + 1."""
    children: dict[int, dict[int, int]] = {}
    for j, (par, tok) in enumerate(zip(parents, draft_tokens)):
        children.setdefault(par, {}).setdefault(tok, j)   # duplicate siblings: the first one wins
    emitted: list[int] = []
    accepted: list[int] = []
    node = -1
    while True:
        tok = targets[node + 1]
        emitted.append(tok)
        nxt = children.get(node, {}).get(tok)
        if nxt is None:
            return emitted, accepted
        accepted.append(nxt)
        node = nxt


def commit(plan: "RowPlan", tokens: list[int], logprobs: list[float], kv: "KVCache",
           eos_token_ids: tuple[int, ...]) -> tuple[list[int], int, RequestStatus | None]:
    """``_commit``, then, for a request with stop strings, the end at the first token whose
    text completes one (``stop_string``)."""
    if plan.req.stop_check is None:
        return _commit(plan, tokens, logprobs, kv, eos_token_ids)
    n0, r0 = len(plan.req.output_token_ids), len(plan.rows)
    emitted, accepted, status = _commit(plan, tokens, logprobs, kv, eos_token_ids)
    emitted, status = stop_string(plan, n0, r0, emitted, status)
    return emitted, accepted, status


def stop_string(plan: "RowPlan", n0: int, r0: int, emitted: list[int],
                status: RequestStatus | None) -> tuple[list[int], RequestStatus | None]:
    """Where a token the row just appended (its output from ``n0`` on, its sampled rows from
    ``r0`` on) completes one of its request's stop strings: the request ends with that token
    (FINISHED_STOPPED), the tokens after it dropped. Returns (tokens kept, status)."""
    req = plan.req
    # (min_tokens: no token before that index ends the output)
    j = req.stop_check.first_end(req.output_token_ids, max(n0, req.params.min_tokens), req.params.stop) \
        if emitted else None
    if j is None:
        return emitted, status
    keep = j + 1 - n0
    del req.output_token_ids[j + 1:]
    del req.output_logprobs[j + 1:]
    del plan.rows[r0 + keep:]
    plan.last = plan.rows[-1]
    return emitted[:keep], RequestStatus.FINISHED_STOPPED


def _commit(plan: "RowPlan", tokens: list[int], logprobs: list[float], kv: "KVCache",
            eos_token_ids: tuple[int, ...]) -> tuple[list[int], int, RequestStatus | None]:
    """Apply one row's sampled targets to its request. ``tokens``/``logprobs``: the step's
    sampled positions; the row's root is at ``plan.entry``, its draft nodes follow. Returns
    (tokens appended, draft nodes accepted, finish status or None); ``plan.last`` becomes the
    sampled index of the last token appended (whose hidden state a drafter continues from),
    ``plan.rows`` the sampled indices of all tokens appended.

    The row's committed tokens are already counted in ``req.num_computed_tokens``. Accepted
    node j was written at cache position base + j (base = the first position after the
    committed tokens); it belongs at base + depth - 1, so a tree's accepted path is moved
    down (a chain's is already in place) and counted as computed. Tokens are appended in
    order until a stop token or the length limit: the request ends there even inside an
    accepted run, and the rest of the run is dropped (its K/V lies past the end, unused)."""
    req, e = plan.req, plan.entry
    if not plan.draft_tokens:                  # plain decoding: the root's token, as below
        plan.last = e
        plan.rows.append(e)
        return [tokens[e]], 0, append_token(req, tokens[e], logprobs[e], eos_token_ids)
    if plan.draft is not None and plan.draft.is_chain:   # a chain, as below: the run of nodes equal to
        drafted, k = plan.draft_tokens, 0                # the targets is accepted, already in place
        while k < len(drafted) and drafted[k] == tokens[e + k]:
            k += 1
        req.num_computed_tokens += k
        emitted, status = _append_run(plan, tokens, logprobs, e, e + k + 1, eos_token_ids)
        return emitted, k, status
    emitted, accepted = accept_draft(plan.parents, plan.draft_tokens, tokens[e:e + 1 + len(plan.draft_tokens)])
    if accepted:
        base = req.num_computed_tokens
        src = [base + j for j in accepted]
        dst = list(range(base, base + len(accepted)))
        if src != dst:
            kv.move_positions(req.row, src, dst)
        req.num_computed_tokens += len(accepted)
    entries = [e] + [e + 1 + j for j in accepted]
    for k, (tok, i) in enumerate(zip(emitted, entries)):
        plan.last = i
        plan.rows.append(i)
        status = append_token(req, tok, logprobs[i], eos_token_ids)
        if status is not None:
            return emitted[:k + 1], len(accepted), status
    return emitted, len(accepted), None


def _append_run(plan: "RowPlan", tokens: list[int], logprobs: list[float], start: int, end: int,
                eos_token_ids: tuple[int, ...]) -> tuple[list[int], RequestStatus | None]:
    """``append_token`` for the sampled positions ``start .. end - 1`` in order, up to the first
    that ends the request (inclusive), in a few list operations: a verified chain appends
    several tokens per row at hundreds of rows a step. Returns (tokens appended, status)."""
    req = plan.req
    out, p = req.output_token_ids, req.params
    run = tokens[start:end]
    stops = [] if p.ignore_eos else list(eos_token_ids)
    if p.stop_token_ids:
        stops += p.stop_token_ids
    n, status = len(run), None
    if stops and not set(run).isdisjoint(stops):
        n = next(i for i, t in enumerate(run) if t in stops) + 1
        status = RequestStatus.FINISHED_STOPPED
    room = max(req.remaining_tokens, 1)       # tokens until the length limit (at least the one appended)
    if room < n:                              # the length limit comes first
        n, status = room, RequestStatus.FINISHED_LENGTH
    elif room == n and status is None:        # with the run's last token (a stop token there wins)
        status = RequestStatus.FINISHED_LENGTH
    out += run[:n]
    req.output_logprobs += logprobs[start:start + n]
    plan.rows += range(start, start + n)
    plan.last = start + n - 1
    return run[:n], status


def append_token(req: Request, tok: int, logprob: float, eos_token_ids: tuple[int, ...]) -> RequestStatus | None:
    """Append one sampled token; the finish status if it ends the request."""
    req.output_token_ids.append(tok)
    req.output_logprobs.append(logprob)
    return ends(req, tok, eos_token_ids)


def ends(req: Request, tok: int, eos_token_ids: tuple[int, ...]) -> RequestStatus | None:
    """The finish status if ``tok``, the request's last token, ends it: a stop token, or the
    length limit reached (``remaining_tokens <= 0``)."""
    p = req.params
    if (not p.ignore_eos and tok in eos_token_ids) or (p.stop_token_ids and tok in p.stop_token_ids):
        return RequestStatus.FINISHED_STOPPED
    if at_limit(req):
        return RequestStatus.FINISHED_LENGTH
    return None


def at_limit(req: Request) -> bool:
    """``remaining_tokens <= 0`` in one pass (asked for every row of every step)."""
    n = len(req.output_token_ids)
    return n >= req.params.max_tokens or len(req.prompt_token_ids) + n >= req.max_model_len
