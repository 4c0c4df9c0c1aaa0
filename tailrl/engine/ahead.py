"""Steps launched ahead (``EngineConfig.async_scheduling``): the host builds and launches step
n+1 before step n's tokens come back, so that a GPU never waits on the host's Python between
two plain decoding steps.

    call k:  placeholders for step n's tokens -> schedule, build, launch step n+1
             (its decode rows read step n's tokens on the device) -> wait for step n's tokens,
             settle them in place of the placeholders, finish what stopped

A decode row's next step depends on its last token only through the token's id, and the id
is on the device already: the host knows everything else (position, K/V slot, sampling
noise, which is keyed by position). So step n+1 is built with a placeholder (``PENDING``) as
each such row's last token, and its input ids are filled in on the device from step n's
sampled tokens (``feed``). Between two calls no placeholder is left: every token a caller
sees is settled, and at most one step is in flight.

What a step can not know ahead is a stop token: a request that stops at step n had a row in
step n+1 whose results are dropped (its K/V write lands in its own blocks, released after;
the device runs the steps in order). A request that reaches its length limit at step n
leaves its row before step n+1 is scheduled. Every token is the one plain decoding samples:
the same inputs, the same row-invariant kernels, the same noise (tests/engine/test_ahead.py).
Drafts need the tokens on the host, so an engine with a speculator steps ahead where its
rows do not draft (its bulk, above ``SpeculativeConfig.ahead_above`` requests: the engine
settles the step in flight before its first speculative step, and hands each settled token
to the speculator's sources), or where only a few chosen rows do, each verifying every other
step (``SpeculativeConfig.ahead_drafts``: engine/ahead_drafts.py). Where the speculator reads
the target's hidden states (a learned drafter's pasts, an online drafter's buffer), a step
launched ahead keeps a copy of those it computed (``HandOut``) and hands them out as it
settles, as a step the host waits for would: prompt positions first, then each row's with the
token it sampled.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tailrl.engine.batch import Batch
from tailrl.engine.kv import KVCache
from tailrl.engine.request import Request, RequestStatus
from tailrl.engine.sampler import Fetched
from tailrl.engine.scheduler import Scheduler
from tailrl.engine.verify import at_limit, commit, ends, stop_string

PENDING = -1                        # a placeholder: the token a step in flight samples


@dataclass
class HandOut:
    """The target's hidden states a step launched ahead computed for the speculator (a learned
    drafter's pasts, the spot trainer's buffer), handed out when the step settles, as a step the
    host waits for hands them out: ``sampled`` [M, H] (the sampled positions': each row's with
    the token it sampled), ``computed`` [N, H] (every position's) and ``prefill``, the spans of
    ``computed`` whose next token was known at launch (prompt positions: the same at settle)."""
    sampled: torch.Tensor
    computed: torch.Tensor
    prefill: list[tuple[Request, int, int, int]]


@dataclass
class Launched:
    """A step whose tokens are still on the device."""
    batch: Batch
    rows: int                       # scheduled rows
    preempted: int
    sampled: Fetched
    stages: list[float]             # seconds of its schedule, draft, build, forward and sampling launches
    start: float                    # perf_counter() when its call began
    tail: bool = False              # a speculative engine's tail step (engine.tail: its time is measured)
    drafting: bool = False          # its chosen rows could draft (engine/drafts_gate.py's way)
    hand_out: HandOut | None = None  # its hidden states, where the speculator wants them

    def live(self) -> bool:
        return any(not p.req.status.finished for p in self.batch.plans)


def placeholders(step: Launched, scheduler: Scheduler, kv: KVCache) -> int:
    """A placeholder token for each unfinished request ``step`` samples plainly, so that the
    scheduler and the batch see it one token on; a request the token takes to its length limit
    leaves its row now (nothing to compute for it next). A row verifying a draft gets none: how
    many tokens it emits is known when it settles, so it has nothing to compute in the next step
    (engine/ahead_drafts.py) but its follow-ups (``batch.FollowUps``). A row whose follow-ups
    in ``step`` include the accept length its draft got (settled by now) takes that one's token
    as its placeholder, and that one's K/V is moved into place (on a GPU, queued after ``step``);
    one whose follow-ups missed it takes none and computes its last token next. Returns how
    many rows' follow-ups had their accept length."""
    moves: list[tuple[Request, int, int]] = []      # (request, from, to): one copy, after the loop
    for plan in step.batch.plans:
        req = plan.req
        if req.status is not RequestStatus.RUNNING or plan.draft_tokens:
            continue
        f = plan.follow
        if f is not None:
            got = len(req.output_token_ids) - f.outputs - 1          # the accept length its draft got
            if got not in f.lengths or req.num_computed_tokens + 1 != req.num_tokens:
                continue
            i = f.lengths.index(got)
            moves.append((req, f.scratch + i, req.num_computed_tokens))
            req.num_computed_tokens += 1
            plan.entry += i
        req.output_token_ids.append(PENDING)
        req.output_logprobs.append(0.0)
        if at_limit(req):
            scheduler.remove(req)
    hits = len(moves)
    moves = [m for m in moves if m[0].row >= 0]     # rows as they are now (a removal moves the last row)
    if moves:
        kv.move_positions([r.row for r, _, _ in moves], [a for _, a, _ in moves], [b for _, _, b in moves])
    return hits


def feed(batch: Batch, step: Launched) -> None:
    """Write ``step``'s sampled tokens, on the device, into ``batch``'s input ids where it has
    placeholders (``Batch.ahead``)."""
    if not batch.ahead:
        return
    entry = {id(p.req): p.entry for p in step.batch.plans}
    dst = [i for i, _, _ in batch.ahead]
    src = [entry[id(req)] + k for _, req, k in batch.ahead]
    tokens = step.sampled.tensors[0]
    if dst == src == list(range(len(dst))):             # the same rows in the same order (most steps)
        batch.input_ids[:len(dst)].copy_(tokens[:len(dst)])
        return
    index = torch.tensor([dst, src], dtype=torch.long, device="cpu")
    if tokens.device.type != "cpu":                     # one pinned copy, not waited for
        index = index.pin_memory().to(tokens.device, non_blocking=True)
    batch.input_ids.index_copy_(0, index[0], tokens.index_select(0, index[1]))


def settle(step: Launched, kv: KVCache, eos_token_ids: tuple[int, ...]) -> tuple[list[Request], list[tuple]]:
    """Wait for ``step``'s tokens and commit each unfinished request's own (``verify.commit``)
    in place of its placeholder (or after its tokens, if it has none: a step settled without
    one launched after it, or a row that verified a draft). Returns the requests that stopped
    and (plan, accepted nodes) for each draft verified; requests that had already stopped are
    skipped. A row preempted while its draft was in flight keeps its tokens and is recomputed
    from them (its admission sets its computed tokens anew)."""
    tokens, logprobs = step.sampled.lists()
    finished, verified = [], []
    for plan in step.batch.plans:
        req = plan.req
        if req.status.finished:
            continue
        out = req.output_token_ids
        if plan.follow is not None and not (out and out[-1] == PENDING):
            continue                        # its follow-ups missed its draft's accept length: dropped
        if out and out[-1] == PENDING and not plan.draft_tokens:
            e = plan.entry                  # commit's plain row, its token written over the placeholder
            out[-1] = tokens[e]
            req.output_logprobs[-1] = logprobs[e]
            plan.last = e
            plan.rows.append(e)
            status = ends(req, out[-1], eos_token_ids)
            if req.stop_check is not None:
                status = stop_string(plan, len(out) - 1, len(plan.rows) - 1, [out[-1]], status)[1]
        else:
            if out and out[-1] == PENDING:
                out.pop()
                req.output_logprobs.pop()
            _, accepted, status = commit(plan, tokens, logprobs, kv, eos_token_ids)
            if plan.draft_tokens:
                verified.append((plan, accepted))
        if status is not None:
            req.status = status
            finished.append(req)
    return finished, verified
