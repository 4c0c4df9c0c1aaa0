"""What a step hands the speculator of the target's hidden states (a learned drafter's pasts,
the spot trainer's buffer): computed anyway by the step's forward, no extra one.

- ``prefill_spans``: the spans of a step's computed positions whose next token is known before
  it samples (prompt positions; a preempted request's recomputed ones), handed out before
  commit (a prefill span ends where sampling starts);
- ``hand_out_states``: the states that sampled each request's emitted tokens, after
  verification, in one call.
"""
from __future__ import annotations

from typing import Any

import torch

from tailrl.engine.batch import Batch
from tailrl.engine.request import Request, RequestStatus


def prefill_spans(batch: Batch) -> list[tuple[Request, int, int, int]]:
    """``batch``'s spans (request, start, row of its computed states, positions) whose next
    tokens are known before it samples."""
    spans = []
    for req, start, flat0, n in batch.spans:
        known = min(n, req.num_tokens - 1 - start)
        if known > 0:
            spans.append((req, start, flat0, known))
    return spans


def hand_out_states(speculator: Any, hidden: torch.Tensor, emitted_rows: list[tuple[Request, int, list[int]]]) -> None:
    """Hand the states that sampled the emitted tokens (``emitted_rows``: request, first
    position, its sampled rows of ``hidden``) to ``speculator`` in one call (a drafter's past
    and the spot trainer's buffer keep views of it; ``hidden`` is fresh each step and never
    modified after). A chain's accepted rows are consecutive, so with chains only ``hidden``
    itself goes out; a tree's accepted path is gathered. Each running request keeps the row
    that sampled its last token (a drafter continues from it)."""
    running = RequestStatus.RUNNING
    states, spans = hidden, []
    for req, start, rows in emitted_rows:          # chains: rows consecutive, ``hidden`` goes out
        n = len(rows)
        if rows[-1] - rows[0] != n - 1:
            break
        spans.append((req, start, rows[0], n))
        if req.status is running:
            req.keep_hidden(hidden, rows[-1])
    else:
        speculator.observe_hidden(states, spans)
        return
    idx, spans = [], []                            # a tree's accepted path: gathered
    for req, start, rows in emitted_rows:
        spans.append((req, start, len(idx), len(rows)))
        idx += rows
    states = hidden[torch.tensor(idx, device=hidden.device)]
    for req, _, row, n in spans:
        if req.status is running:
            req.keep_hidden(states, row + n - 1)
    speculator.observe_hidden(states, spans)
