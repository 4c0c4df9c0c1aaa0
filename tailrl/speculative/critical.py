"""Which running requests are on the rollout's critical path: who drafts when the batch is too
large for everyone to.

A request's expected tokens still to generate, given that it has generated ``g`` so far and
has not finished, from what is known about its length:

- ``Request.length_prior``: lengths its own length is expected to be drawn from (set by the
  pool from its scheduler: the prompt's previous-epoch lengths for ``history``, the group's
  finished lengths for ``context``, the true length for ``oracle``); else
- ``Request.priority`` > 0: the scheduler's one expected length; else nothing: never critical.
  One engine under ``LLM.generate`` admits the longest expected first from its history store
  but sets neither (engine/admission.py): critical rows from history were 2-12% slower under
  arrival-order admission on the workload of `benchmarks/critical_path.py` (four rounds of
  four: the long responses often waited for a slot, and drafting for the running ones taxed
  the full batch), and 5-9% slower under longest-first admission on the benchmark rollout
  (this CPU, three rounds), which computes every drafted token of a full batch.

The estimate is conditioned on survival: E[L - g | L > g] over the known lengths, so siblings
that share a prompt-level estimate part as they generate. A group whose previous lengths were
[900, 40, 40, 40] marks every sibling at 255 expected tokens at first; one that is still
running at 41 tokens has outlived three of the four and is now expected to run 859 more,
while a sibling of a group of [300] x 4 stays at 300 - g. A request that has outrun every
known length is expected to run about as long again as it has (``g``; the lengths are
long-tailed), capped by its ``max_tokens``.
"""
from __future__ import annotations

import bisect
import heapq
from typing import Any, Callable


def expected_remaining(lengths: list[int], generated: int, max_tokens: int) -> float:
    """E[L - g | L > g] over ``lengths`` (sorted ascending), else ``g``; at most ``max_tokens - g``."""
    left = max(0, max_tokens - generated)
    i = bisect.bisect_right(lengths, generated)
    if i < len(lengths):
        tail = lengths[i:]
        return min(left, sum(tail) / len(tail) - generated)
    return float(min(left, generated))


def known_lengths(req: Any) -> list[int]:
    """The sorted lengths ``req``'s length is expected to be drawn from (see the module doc)."""
    if req.length_prior:
        return sorted(req.length_prior)
    return [int(req.priority)] if req.priority > 0 else []


def critical_requests(requests: list[Any], rows: int, eligible: Callable[[Any], bool] | None = None) -> list[Any]:
    """The ``rows`` requests with the most expected tokens still to generate (of those
    ``eligible`` says may take a draft, asked only of requests with known lengths)."""
    if rows <= 0:
        return []
    scored = []
    for r in requests:
        lengths = known_lengths(r)
        if lengths and (eligible is None or eligible(r)):
            scored.append((expected_remaining(lengths, len(r.output_token_ids), r.params.max_tokens), r))
    return [r for _, r in heapq.nlargest(rows, scored, key=lambda s: s[0])]


def probe_requests(requests: list[Any], rows: int, start: int,
                   eligible: Callable[[Any], bool] | None = None) -> list[Any]:
    """``rows`` of ``requests`` (of those ``eligible`` says may take a draft) from the ``start``-th
    on, wrapping: successive probes (policies/priced.py, rule 5) walk the batch, so the rate
    they measure is the batch's, not that of the requests with the longest or best drafts."""
    if rows <= 0:                          # most steps: no probe, no row asked
        return []
    pool = requests if eligible is None else [r for r in requests if eligible(r)]
    return [pool[(start + j) % len(pool)] for j in range(min(rows, len(pool)))]
