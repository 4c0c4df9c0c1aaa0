"""Admission order for one engine from the history store: longest expected first.

A rollout's makespan is its longest responses'. When more requests wait than the batch runs
(``max_num_seqs``), an engine admitting in arrival order may start a long one only after a
short one ends: on the benchmark rollout (``small``, 64 prompts x 8, 256 rows, max 512) the
longest response then started ~76 steps late, and plain decoding took 589 steps for a
512-token response. The previous epoch's lengths say up front which prompts run long
(RhymeRL: their ranks are stable across epochs), so each request is estimated as its prompt's
longest previous response and the scheduler admits the longest estimates first (Seer's and
RhymeRL's order; the pool's ``history`` policy does the same across instances): 513 steps.

Outputs do not change: a request's tokens depend on its seed and positions only (sampler.py),
never on when it ran or beside whom.

Each request with history gets ``priority`` = its prompt's longest previous length (at most
its ``max_tokens``) and ``length_prior`` = those lengths (what speculative/critical.py and the
drafting rows of engine/ahead_drafts.py condition on). A prompt without history, in a call
where others have some, is estimated at its ``max_tokens`` (treated as long, as the pool's
``history`` policy does: it may be); a call where no prompt has history keeps arrival order
and sets nothing. Requests whose ``priority`` or ``length_prior`` is already set keep them.
"""
from __future__ import annotations

from tailrl.engine.request import Request
from tailrl.speculative.history import HistoryStore


def by_history(reqs: list[Request], history: HistoryStore) -> list[Request]:
    """``reqs`` in admission order (longest expected first, stable), their estimates set."""
    lengths = {r.prompt_id: history.lengths(r.prompt_id) for r in reqs if r.prompt_id}
    if not any(lengths.values()):
        return reqs
    for r in reqs:
        if r.priority > 0 or r.length_prior:
            continue
        past = lengths.get(r.prompt_id)
        cap = r.params.max_tokens
        if past:
            r.priority, r.length_prior = float(min(max(past), cap)), tuple(past)
        else:
            r.priority = float(cap)
    return sorted(reqs, key=lambda r: -r.priority)  # stable: equal estimates keep arrival order
