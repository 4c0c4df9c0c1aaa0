"""The learned drafter's K/V of each request's committed positions (what its attention reads).

The engine hands out the target's normed hidden state of every position it computes
(prompt positions in the prefill, emitted tokens after verification), once per step for all
requests: ``add_spans(hidden, spans)``, span (req, start, row, k) for positions start ..
start + k - 1, whose next tokens the request already holds. A hand-out is appended to a log
as one entry, whatever the number of requests (this runs at every step, for every request:
no per-request work). A request's positions are read from the log only when a draft is
asked for it; a committed position's drafter K/V depend on (h_t, x_{t+1}) only, so they are
computed then, once, batched over the requests drafted for (``flush``), and appended; a
rejected draft never reaches here, so nothing is rolled back.

A request's past is the contiguous positions ``[base, base + len)``:
- the n samples of a prompt share its prefill (the engine computes it once and copies the
  target K/V): the prompt positions' drafter K/V are computed once per group, from the
  sample whose prefill it was, and every sample's past starts with them;
- positions already held are skipped (a preempted request's recomputed prefill hands them
  out again: the past survives preemption as it was);
- a gap (positions were computed elsewhere, e.g. a request imported with its target K/V
  from another instance, whose prefill is not rerun; or positions older than the log) starts
  the past afresh at the new position: the drafter attends only over what it can read. A
  request imported without K/V is re-prefilled, so its whole past is rebuilt from that prefill.

Migration: ``export(req)`` packs a request's past (held K/V, and the target states of the
positions logged but not computed yet) into a ``PastState`` that travels with the request
(``RequestState.speculation``); ``adopt(req, state)`` on the importing instance continues it,
so the request drafts there exactly as it would have here. Carrying it is the cheaper of
the two ways: the drafter's K/V are ``heads * head_dim * 2`` values per position (a sixth of
the target K/V that travels anyway, on ``small``), while recomputing them needs the target's
hidden states of every position, i.e. a target forward over the whole sequence, which is
what importing with K/V avoids (the target K/V do not give the hidden states back).

Weights: K/V are computed with the drafter weights current at the flush; an online update
(a new spot-trainer version, a few small steps) does not recompute them. Drafts are verified,
so stale K/V cost acceptance, never correctness.

Storage: blocks of ``BLOCK`` positions in one pool laid out as the engine's K/V
(``tailrl.drafter.blocks``), so a chain's depth reads a request's past in place through a block
table with the engine's attention kernel (``tailrl.drafter.paged``), as does a tree's node.
``heads * head_dim * 2`` values per position (256 on ``small``, a third of one
target layer's K/V) in the dtype of the drafter that computes them (``compute``: the
low-precision copy with a bfloat16 target, see ``DrafterSource``), a request's blocks back in
the pool by ``free(req)`` when it leaves the engine; and the last ``LOG_HAND_OUTS``
hand-outs' states.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch

from tailrl.drafter.blocks import KVBlocks
from tailrl.drafter.network import Drafter

# Positions a request may have to catch up on (read from the log, K/V not computed yet).
# Past it, the request's past restarts at its newest MAX_WAIT // 2 positions: the drafter
# needs only its recent past (measured on ``small``, 16 x 8: 4.61 accepted per verify
# attending over every position, 4.55 over the last 64, 3.69 over 16), and a call never
# catches up on more than this per request.
MAX_WAIT = 128
# Hand-outs kept in the log (about one per engine step): a request read after a longer pause
# restarts its past at the oldest position still logged. Bounds the states kept alive.
LOG_HAND_OUTS = 128


@dataclass
class PastState:
    """A request's drafter past, portable (pickled with the request between processes):
    positions ``base .. base + n - 1`` held as K/V, then ``m`` positions whose K/V are not
    computed yet, as the target's states (computed where the request next drafts, batched
    with the others, exactly as they would have been here)."""
    base: int
    k: torch.Tensor                # [heads, D, n]: keys, transposed as ``_Past`` holds them
    v: torch.Tensor                # [heads, n, D]
    queued: torch.Tensor | None    # [m, H]: target states of positions base + n .. (target's dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.queued) if t is not None)


class _Past:
    __slots__ = ("base", "length", "blocks", "queued", "queued_n", "req", "group", "prompt", "synced")

    def __init__(self, base: int, req: Any) -> None:
        self.req, self.group, self.prompt = req, req.group_id, req.prompt_token_ids
        self.base = base                       # position of index 0
        self.length = 0                        # indices holding K/V
        self.blocks: list[int] = []            # block ids in the pool (``KVBlocks``): index i in blocks[i // BLOCK]
        # (start, states, first row, end row): rows of a hand-out's states, in order
        self.queued: list[tuple[int, torch.Tensor, int, int]] = []
        self.queued_n = 0
        self.synced = -1                       # the last hand-out read into ``queued``

    @property
    def end(self) -> int:
        """The next position expected (held or queued)."""
        return self.base + self.length + self.queued_n

    def take(self, start: int, hidden: torch.Tensor, row: int, k: int) -> None:
        """Queue positions start .. start + k - 1 (rows row ..): those already held are
        skipped (a preempted request's recomputed prefill)."""
        skip = self.end - start
        if skip < k:
            self.queued.append((start + skip, hidden, row + skip, row + k))
            self.queued_n += k - skip


class _HandOut:
    """One ``add_spans`` call: the states and the spans as handed out (the engine's list,
    never modified after; no per-request work until a request is looked up)."""
    __slots__ = ("number", "hidden", "spans", "_index")

    def __init__(self, number: int, hidden: torch.Tensor, spans: list[tuple[Any, int, int, int]]) -> None:
        self.number, self.hidden, self.spans = number, hidden, spans
        self._index: dict[str, int] | None = None

    def find(self, req: Any) -> tuple[int, int, int] | None:
        """(start, row, count) of ``req`` in this hand-out, or None (a request of the same id
        that left the engine before, e.g. exported and imported back, is another request)."""
        if self._index is None:
            self._index = {sp[0].request_id: i for i, sp in enumerate(self.spans)}
        i = self._index.get(req.request_id)
        return None if i is None or self.spans[i][0] is not req else self.spans[i][1:]


class DrafterPast:
    """Per-request committed K/V for ``drafter``. A hand-out is logged as it comes (one entry
    per call, whatever the number of requests); a request's positions are read from the log
    and their K/V computed only when a draft is asked for it (``flush(requests)``): a request
    that the per-request choice never gives to the drafter, or that finishes first, costs
    nothing. The log keeps the last ``LOG_HAND_OUTS`` hand-outs; a request read after a longer
    pause restarts its past at the oldest position still logged."""

    def __init__(self, drafter: Drafter, compute: Callable[[], Drafter] | None = None) -> None:
        self.drafter = drafter
        self.compute = compute or (lambda: drafter)   # the drafter (or its low-precision copy) that computes K/V
        self.device = drafter.fc.weight.device       # where the K/V are kept (the drafter's device)
        self._pool: KVBlocks | None = None            # made at the first write, in ``compute``'s dtype
        self._past: dict[str, _Past] = {}
        self._log: deque[_HandOut] = deque()
        self._count = 0                                # hand-outs so far
        # group -> (prompt, hand-out number of its first piece, pieces (start, states, row, count))
        self._prompts: dict[str, tuple[list[int], int, list[tuple[int, torch.Tensor, int, int]]]] = {}
        self._prompt_kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}   # group -> prompt K/V computed

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._past

    def pending(self, req: Any) -> int:
        """Positions of ``req`` whose K/V its next flush computes first, at most: its
        committed positions after those held, up to ``MAX_WAIT`` (exact for a past read up to
        now; the log is not read here, so pricing a call costs no per-request work)."""
        p = self._past.get(req.request_id)
        held = p.base + p.length if p is not None and p.req is req else 0
        return max(0, min(req.num_tokens - 1 - held, MAX_WAIT))

    def span(self, req: Any) -> tuple[int, int]:
        """(first, end) positions held or logged for ``req`` ((0, 0) if none)."""
        p = self._sync(req)
        return (p.base, p.end) if p is not None else (0, 0)

    def add(self, req: Any, start: int, hidden: torch.Tensor) -> None:
        """hidden [k, H]: the target's states at positions start .. start + k - 1 of ``req``."""
        k = hidden.shape[0]
        if start < 0 or start + k > req.num_tokens - 1:
            raise ValueError(f"drafter past: positions {start} .. {start + k - 1} of request "
                             f"{req.request_id!r} need their next tokens; the request has {req.num_tokens} tokens")
        self.add_spans(hidden.clone(), [(req, start, 0, k)])

    def add_spans(self, hidden: torch.Tensor, spans: list[tuple[Any, int, int, int]]) -> None:
        """A hand-out: ``hidden`` [P, H] in the target's dtype, kept as given (the engine hands
        out a fresh tensor per step, never modified after); span (req, start, row, k): rows
        row .. row + k - 1 are positions start .. start + k - 1 of ``req``, each one's next
        token held (the engine's spans are; ``add`` checks one). Logged in one entry; only
        prompt positions (a group's first sample, for its siblings) are looked at now."""
        entry = _HandOut(self._count, hidden, spans)
        self._count += 1
        self._log.append(entry)
        for req, start, row, k in spans:
            if start < len(req.prompt_token_ids):
                self._note_prompt(req, start, hidden, row, k, entry.number)
        while len(self._log) > LOG_HAND_OUTS:
            gone = self._log.popleft().number
            while self._prompts and next(iter(self._prompts.values()))[1] <= gone:   # oldest first
                g = next(iter(self._prompts))
                del self._prompts[g]
                self._prompt_kv.pop(g, None)

    def _note_prompt(self, req: Any, start: int, hidden: torch.Tensor, row: int, k: int, number: int) -> None:
        """Keep where a group's prompt positions are (from the sample that computed them),
        so its other samples, which copied the prompt's target K/V, can read them."""
        known = self._prompts.get(req.group_id)
        if known is None or known[0] != req.prompt_token_ids:
            k = min(k, len(req.prompt_token_ids) - 1)
            if start == 0 and k > 0:                      # re-inserted last: the dict stays in hand-out order
                self._prompts.pop(req.group_id, None)
                self._prompts[req.group_id] = (req.prompt_token_ids, number, [(0, hidden, row, k)])
                self._prompt_kv.pop(req.group_id, None)
            return
        pieces = known[2]
        end = pieces[-1][0] + pieces[-1][3]
        k = min(k, len(req.prompt_token_ids) - 1 - start)  # positions whose next token is a prompt token
        if start == end and k > 0:                        # the next prefill chunk
            pieces.append((start, hidden, row, k))

    def _sync(self, req: Any, restart: bool = True) -> _Past | None:
        """Read the request's logged positions into its queue (creating its past); past
        ``MAX_WAIT`` queued positions (and ``restart``) keep only the newest."""
        rid = req.request_id
        p = self._past.get(rid)
        if self._log and p is not None and p.synced < self._log[0].number - 1:
            p.synced = -1                                 # hand-outs were dropped: read what is left
            if p.queued or p.length:
                self.free(req)
                p = None                                  # and start afresh there
        first = 0 if p is None or not self._log else max(0, p.synced + 1 - self._log[0].number)
        for entry in itertools.islice(self._log, first, None):     # hand-outs not read yet
            found = entry.find(req)
            if found is None:
                continue
            start, row, k = found
            if p is None or start > p.end:                # new, or a gap: the past starts here
                if p is not None:
                    self.pool.release(p.blocks)
                p = self._past[rid] = _Past(start, req)
                if start < req.num_prompt_tokens:
                    self._borrow(p, start)
            p.take(start, entry.hidden, row, k)
        if p is not None and self._log:
            p.synced = self._log[-1].number
            if restart and p.queued_n > MAX_WAIT:
                self._restart(p)
        return p

    def _restart(self, p: _Past) -> None:
        """Keep only the newest MAX_WAIT // 2 queued positions (the held K/V and the older
        ones are dropped; the past starts at the first position kept)."""
        drop = p.queued_n - MAX_WAIT // 2
        while drop > 0:
            first, h, lo, hi = p.queued[0]
            if hi - lo > drop:                                # the oldest entry is cut
                p.queued[0] = (first + drop, h, lo + drop, hi)
                break
            drop -= hi - lo
            del p.queued[0]
        p.base, p.length, p.queued_n = p.queued[0][0], 0, MAX_WAIT // 2

    def _borrow(self, p: _Past, start: int) -> None:
        """A group's prompt positions are handed out once (the engine computes a group's
        prompt once and copies its target K/V to the other samples): their drafter K/V are
        computed once per group, from the logged states, and every sample's past starts with
        them (positions < ``start``, or all of them for the sample whose prefill it was)."""
        known = self._prompts.get(p.group)
        if known is None or known[0] != p.prompt:
            return
        pieces = known[2]
        n = pieces[-1][0] + pieces[-1][3]                 # prompt positions handed out
        upto = start if start > 0 else n
        if upto == 0 or n < upto:
            return
        kv = self._prompt_kv.get(p.group)
        if kv is None or kv[0].shape[0] < n:
            hidden = torch.cat([h[r:r + m] for _, h, r, m in pieces])
            d = self.compute()
            with torch.inference_mode():
                kv = self._prompt_kv[p.group] = d.committed_kv(
                    hidden.to(d.fc.weight.dtype), torch.tensor(list(p.prompt[1:n + 1]), device=self.device),
                    torch.arange(n, device=self.device), n)
        p.base = 0
        self._append(p, kv[0][:upto], kv[1][:upto])

    @property
    def pool(self) -> KVBlocks:
        """The blocks every request's K/V live in (``tailrl.drafter.blocks``)."""
        if self._pool is None:
            c = self.drafter.cfg
            self._pool = KVBlocks(c.num_heads, c.head_dim, self.compute().fc.weight.dtype, self.device)
        return self._pool

    def _append(self, p: _Past, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [n, heads, D]: the past's next n positions."""
        self.pool.write(p.blocks, p.length, k, v)
        p.length += k.shape[0]

    def free(self, req: Any) -> None:
        p = self._past.pop(req.request_id, None)
        if p is not None:
            self.pool.release(p.blocks)

    def export(self, req: Any) -> PastState | None:
        """``req``'s past with every position logged for it, for another instance's ``adopt``
        (None: nothing held or logged). Queued positions travel as target states, not as K/V:
        no work here, and no ``MAX_WAIT`` cut, which the next draft makes wherever it happens,
        so the importer's past is the one this instance would have had. Host copies: a view would
        pickle the whole step tensor it belongs to, and the importer may sit on another device."""
        p = self._sync(req, restart=False)
        if p is None:
            return None
        queued = torch.cat([h[lo:hi] for _, h, lo, hi in p.queued]).to("cpu") if p.queued else None
        k, v = self.kv(req)
        return PastState(p.base, k.to("cpu"), v.to("cpu"), queued)

    def kv(self, req: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V ``req``'s past holds, in order (a copy): keys [heads, D, n], values [heads,
        n, D] (n = 0 without a past). Queued positions are not in it (``flush`` first)."""
        p = self._past.get(req.request_id)
        return self.pool.read(p.blocks if p is not None else [], p.length if p is not None else 0)

    def adopt(self, req: Any, state: PastState) -> None:
        """Continue ``req``'s past from ``state`` (``export`` on another instance): its K/V are
        held, its queued positions computed at its next draft; hand-outs logged here before
        are not its own (``_HandOut.find`` matches the request object)."""
        c = self.drafter.cfg
        n = state.k.shape[-1]
        if (tuple(state.k.shape), tuple(state.v.shape)) != ((c.num_heads, c.head_dim, n), (c.num_heads, n, c.head_dim)):
            raise ValueError(f"drafter past of request {req.request_id!r}: K/V of shapes {tuple(state.k.shape)}, "
                             f"{tuple(state.v.shape)} do not fit this drafter ({c.num_heads} heads of {c.head_dim})")
        if state.queued is not None and state.queued.shape[-1] != c.hidden_size:
            raise ValueError(f"drafter past of request {req.request_id!r}: queued states of width "
                             f"{state.queued.shape[-1]}, this drafter reads {c.hidden_size}")
        old = self._past.get(req.request_id)
        if old is not None:
            self.pool.release(old.blocks)
        p = self._past[req.request_id] = _Past(state.base, req)
        self._append(p, state.k.to(self.device).permute(2, 0, 1), state.v.to(self.device).transpose(0, 1))
        if state.queued is not None and state.queued.shape[0]:
            queued = state.queued.to(self.device)
            p.queued, p.queued_n = [(state.base + n, queued, 0, queued.shape[0])], queued.shape[0]
        p.synced = self._count - 1                       # read up to here: none of the log is its own

    def flush(self, requests: list[Any] | None = None) -> None:
        """K/V for every logged position of ``requests`` (default: every request logged or
        with a past), in one batched pass."""
        if requests is None:
            requests = list({id(r): r for r in [p.req for p in self._past.values()]
                             + [sp[0] for e in self._log for sp in e.spans]}.values())
        self._compute([p for p in map(self._sync, requests) if p is not None])

    @torch.inference_mode()
    def _compute(self, pasts: list[_Past]) -> None:
        pending = [p for p in pasts if p.queued]
        if not pending:
            return
        hidden = torch.cat([h[lo:hi] for p in pending for _, h, lo, hi in p.queued])
        tokens: list[int] = []
        positions: list[int] = []
        for p in pending:
            for s, _, lo, hi in p.queued:
                tokens += p.req.tokens(s + 1, s + hi - lo + 1)
                positions += range(s, s + hi - lo)
        d = self.compute()
        k, v = d.committed_kv(hidden.to(d.fc.weight.dtype), torch.tensor(tokens, device=self.device),
                              torch.tensor(positions, device=self.device), max(positions) + 1)   # [P, heads, D]
        for p in pending:                        # room first (the pool may grow): nothing changed if it fails
            self.pool.reserve(p.blocks, p.length + p.queued_n)
        slots = [s for p in pending for s in self.pool.slots(p.blocks, p.length, p.queued_n)]
        self.pool.write_slots(slots, k, v)       # one write for every request (a past's rows are consecutive)
        for p in pending:
            p.length += p.queued_n
            p.queued, p.queued_n = [], 0

    def seen(self, req: Any, root: int) -> tuple[_Past | None, int]:
        """``req``'s past and how many of its held positions a draft rooted at ``root`` sees
        (those < root; call ``flush`` first: queued positions are not visible)."""
        p = self._past.get(req.request_id)
        return (p, 0) if p is None else (p, max(0, min(p.length, root - p.base)))

    def draft_blocks(self, requests: list[Any], roots: list[int], indices: int
                     ) -> tuple[list[list[int]], list[int], list[list[int]]]:
        """For drafts rooted at ``roots``: each request's blocks, with room for ``indices``
        draft indices after the committed ones it sees, and how many it sees; the third list
        holds the blocks lent to requests without a past (give them back with
        ``pool.release`` after the call). A past holding positions past its root (none should)
        is not written into: its request drafts in lent blocks."""
        lists, seen, lent = [], [], []
        for r, root in zip(requests, roots):
            p, n = self.seen(r, root)
            if p is not None and p.length > n + 1:
                p, n = None, 0
            ids = p.blocks if p is not None else []
            if p is None:
                lent.append(ids)
            self.pool.reserve(ids, n + indices)
            lists.append(ids)
            seen.append(n)
        return lists, seen, lent
