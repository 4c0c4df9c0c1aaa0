"""The learned drafter's K/V of each request's committed positions (what its attention reads).

The engine hands out the target's normed hidden state of every position it computes
(prompt positions in the prefill, emitted tokens after verification), once per step for all
requests: ``add_spans(hidden, spans)``, span (req, start, row, k) for positions start ..
start + k - 1, whose next tokens the request already holds. Queuing them costs a reference
per request and step. A committed position's drafter K/V depend on (h_t, x_{t+1}) only, so
they are computed once, batched over all requests (``flush``: one drafter input/K/V pass
over the queued positions of the requests about to be drafted for), and appended; a
rejected draft never reaches here, so nothing is rolled back.

A request's past is the contiguous positions ``[base, base + len)``:
- the n samples of a prompt share its prefill (the engine computes it once and copies the
  target K/V): a sample whose first positions come after the prompt copies the prompt
  positions' drafter K/V from a sibling that holds them;
- positions already held are skipped (a preempted request's recomputed prefill hands them
  out again: the past survives preemption as it was);
- a gap (positions were computed elsewhere, e.g. a request imported with its target K/V
  from another instance, whose prefill is not rerun) starts the past afresh at the new
  position: the drafter attends only over what this instance computed. A request imported
  without K/V is re-prefilled, so its whole past is rebuilt from that prefill.

Weights: K/V are computed with the drafter weights current at the flush; an online update
(a new spot-trainer version, a few small steps) does not recompute them. Drafts are verified,
so stale K/V cost acceptance, never correctness.

Memory: ``heads * head_dim * 2`` values per position (256 on ``small``, a third of one target
layer's K/V) in the dtype of the drafter that computes them (``compute``: the low-precision
copy with a bfloat16 target, see ``DrafterSource``), freed by ``free(req)`` when the request
leaves the engine. A request not drafted for queues at most ``MAX_WAIT`` positions
(references to the step tensors), then restarts its past at the newest of them.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from tailrl.model.drafter import Drafter

# Positions a request may queue (not drafted for since). Past it, the request's past restarts
# at its newest MAX_WAIT // 2 positions: the drafter needs only its recent past (measured on
# ``small``, 16 x 8: 4.61 accepted per verify attending over every position, 4.55 over the
# last 64, 3.69 over 16), the queue keeps at most this many positions' step tensors alive,
# and a call never catches up on more than this per request.
MAX_WAIT = 256


class _Past:
    __slots__ = ("base", "length", "k", "v", "queued", "queued_n", "group", "prompt")

    def __init__(self, base: int, heads: int, head_dim: int, req: Any) -> None:
        self.group, self.prompt = req.group_id, req.prompt_token_ids
        self.base = base                       # position of row 0
        self.length = 0                        # rows holding K/V
        self.k = torch.empty(heads, head_dim, 0)   # [heads, D, capacity]: keys transposed
        self.v = torch.empty(heads, 0, head_dim)   # [heads, capacity, D]
        # (start, states, first row, end row, request): rows of a step's float32 states
        self.queued: list[tuple[int, torch.Tensor, int, int, Any]] = []
        self.queued_n = 0

    @property
    def end(self) -> int:
        """The next position expected (held or queued)."""
        return self.base + self.length + self.queued_n

    def restart(self, keep: int) -> None:
        """Keep only the newest ``keep`` queued positions: the held K/V and the older queued
        positions are dropped, and the past starts at the first position kept."""
        drop = self.queued_n - keep
        while drop > 0:
            first, h, lo, hi, req = self.queued[0]
            if hi - lo > drop:                              # the oldest entry is cut
                self.queued[0] = (first + drop, h, lo + drop, hi, req)
                break
            drop -= hi - lo
            del self.queued[0]
        self.base, self.length, self.queued_n = self.queued[0][0], 0, keep
        self.k, self.v = self.k[:, :, :0], self.v[:, :0]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [n, heads, D]: the next n positions."""
        n, cap, end = k.shape[0], self.v.shape[1], self.length
        if end + n > cap:
            grow = max(64, 2 * cap, end + n) - end
            self.k = torch.cat([self.k[:, :, :end].to(k.dtype), k.new_empty(k.shape[1], k.shape[2], grow)], 2)
            self.v = torch.cat([self.v[:, :end].to(v.dtype), v.new_empty(v.shape[1], grow, v.shape[2])], 1)
        self.k[:, :, end:end + n] = k.permute(1, 2, 0)
        self.v[:, end:end + n] = v.transpose(0, 1)
        self.length += n


class DrafterPast:
    """Per-request committed K/V for ``drafter``. K/V are computed when a draft is asked for
    (``flush(requests)`` for the requests drafted for): a request that the per-request choice
    never gives to the drafter, or that finishes first, costs nothing but its queue
    (``MAX_WAIT`` positions at most)."""

    def __init__(self, drafter: Drafter, compute: Callable[[], Drafter] | None = None) -> None:
        self.drafter = drafter
        self.compute = compute or (lambda: drafter)   # the drafter (or its low-precision copy) that computes K/V
        self._past: dict[str, _Past] = {}
        self._donors: dict[str, list[_Past]] = {}     # group -> its pasts that start at the prompt

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._past

    def pending(self, request_id: str) -> int:
        """Positions queued for the request (their K/V are computed at its next flush)."""
        p = self._past.get(request_id)
        return p.queued_n if p is not None else 0

    def span(self, request_id: str) -> tuple[int, int]:
        """(first, end) positions held or queued for the request ((0, 0) if none)."""
        p = self._past.get(request_id)
        return (p.base, p.end) if p is not None else (0, 0)

    def add(self, req: Any, start: int, hidden: torch.Tensor) -> None:
        """hidden [k, H]: the target's states at positions start .. start + k - 1 of ``req``."""
        k = hidden.shape[0]
        if start < 0 or start + k > req.num_tokens - 1:
            raise ValueError(f"drafter past: positions {start} .. {start + k - 1} of request "
                             f"{req.request_id!r} need their next tokens; the request has {req.num_tokens} tokens")
        self.add_spans(hidden.float(), [(req, start, 0, k)])

    def add_spans(self, hidden: torch.Tensor, spans: list[tuple[Any, int, int, int]]) -> None:
        """A step's states: ``hidden`` [P, H] float32, kept as given (the engine hands out a
        fresh tensor per step, never modified after); span (req, start, row, k): rows row ..
        row + k - 1 are positions start .. start + k - 1 of ``req``, each one's next token
        held (the engine's spans are; ``add`` checks one). Only a reference is queued (no
        tensor op per request: this runs for every request at every step); the next tokens
        are read from the request at the flush (committed tokens never change)."""
        pasts = self._past
        for req, start, row, k in spans:
            p = pasts.get(req.request_id)
            if p is None or start > p.end:                    # new, or a gap: the past starts here
                if p is not None:
                    self._drop_donor(p)
                c = self.drafter.cfg
                p = pasts[req.request_id] = _Past(start, c.num_heads, c.head_dim, req)
                if start == 0:
                    self._donors.setdefault(p.group, []).append(p)
                elif start < req.num_prompt_tokens:
                    self._borrow(p, start)
            skip = p.end - start                              # already held (a recomputed prefill)
            if skip >= k:
                continue
            p.queued.append((start + skip, hidden, row + skip, row + k, req))
            p.queued_n += k - skip
            if p.queued_n > MAX_WAIT:
                p.restart(MAX_WAIT // 2)

    def _borrow(self, p: _Past, start: int) -> None:
        """A sibling that copied the prompt's target K/V from another request of its group
        (the engine computes a group's prompt once) has no prefill states: copy the drafter
        K/V of those prompt positions (< start) from a sibling that has them (computed now,
        once for the group)."""
        donor = next((d for d in self._donors.get(p.group, ()) if d.base == 0 and d.end >= start
                      and d.prompt == p.prompt), None)
        if donor is None:
            return
        if donor.length < start:
            self._compute([donor])
        p.base = 0
        p.append(donor.k[:, :, :start].permute(2, 0, 1), donor.v[:, :start].transpose(0, 1))

    def free(self, req: Any) -> None:
        p = self._past.pop(req.request_id, None)
        if p is not None:
            self._drop_donor(p)

    def _drop_donor(self, p: _Past) -> None:
        donors = self._donors.get(p.group)
        if donors is not None and p in donors:
            donors.remove(p)
            if not donors:
                del self._donors[p.group]

    def flush(self, requests: list[Any] | None = None) -> None:
        """K/V for every queued position of ``requests`` (default: all), in one batched pass."""
        self._compute(self._past.values() if requests is None else [
            p for p in (self._past.get(r.request_id) for r in requests) if p is not None])

    @torch.inference_mode()
    def _compute(self, pasts: Any) -> None:
        pending = [(p, q) for p in pasts if p.queued for q in p.queued]
        if not pending:
            return
        hidden = torch.cat([h[lo:hi] for _, (_, h, lo, hi, _) in pending])
        tokens = torch.tensor([t for _, (s, _, lo, hi, req) in pending for t in req.tokens(s + 1, s + hi - lo + 1)])
        positions = torch.cat([torch.arange(s, s + hi - lo) for _, (s, _, lo, hi, _) in pending])
        d = self.compute()
        k, v = d.committed_kv(hidden.to(d.fc.weight.dtype), tokens, positions)   # [P, heads, D]
        row = 0
        for p, (_, _, lo, hi, _) in pending:
            p.append(k[row:row + hi - lo], v[row:row + hi - lo])
            row += hi - lo
        for p, _ in pending:
            p.queued, p.queued_n = [], 0

    def gather(self, requests: list[Any], roots: list[int], dtype: torch.dtype | None = None
               ) -> tuple[torch.Tensor, ...] | None:
        """The committed K/V each request's draft rooted at ``roots[b]`` sees (its positions
        < root), padded, as ``Drafter.step`` reads it: k_t [B, heads, D, L], v [B, heads, L, D],
        bias [B, L] (0 seen, -inf padding), in ``dtype`` (default: the drafter's); None when no
        request has any. Call ``flush`` first (queued positions are not visible)."""
        seen = []
        for req, root in zip(requests, roots):
            p = self._past.get(req.request_id)
            seen.append((p, 0) if p is None else (p, max(0, min(p.length, root - p.base))))
        width = max((n for _, n in seen), default=0)
        if width == 0:
            return None
        c = self.drafter.cfg
        dtype = dtype or self.drafter.fc.weight.dtype
        k = torch.zeros(len(requests), c.num_heads, c.head_dim, width, dtype=dtype)
        v = torch.zeros(len(requests), c.num_heads, width, c.head_dim, dtype=dtype)
        bias = torch.full((len(requests), width), float("-inf"), dtype=dtype)
        for b, (p, n) in enumerate(seen):
            if n:
                k[b, :, :, :n] = p.k[:, :, :n]
                v[b, :, :n] = p.v[:, :n]
                bias[b, :n] = 0.0
        return k, v, bias
