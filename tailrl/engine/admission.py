"""Admission order for one engine from the history store: longest expected first.

A rollout's makespan is its longest responses'. When more requests wait than the batch runs
(``max_num_seqs``), an engine admitting in arrival order may start a long one only after a
short one ends: on the benchmark rollout (``small``, 64 prompts x 8, 256 rows, max 512) the
longest response then started ~76 steps late, and plain decoding took 589 steps for a
512-token response. The previous epoch's lengths say up front which prompts run long
(RhymeRL: their ranks are stable across epochs), so the requests are queued longest expected
first (Seer's and RhymeRL's order; the pool's ``history`` policy does the same across
instances): 513 steps (benchmarks/admission.py).

Outputs do not change: a request's tokens depend on its seed and positions only (sampler.py),
never on when it ran or beside whom.

A request is estimated as its prompt's longest previous length (at most its ``max_tokens``);
a prompt without history, in a call where others have some, at its ``max_tokens`` (treated as
long, as the pool's ``history`` policy does: it may be); a request whose ``priority`` is set,
at it. A call where no prompt has history keeps arrival order. The requests are queued in that
order, their priorities left as they are (equal priorities keep the queue's order). The
estimates are not set as ``priority`` or ``length_prior``: those also make a request critical
(speculative/critical.py: it drafts where the batch is too large for all rows to), and with
them the default speculation took this CPU 283-298 steps in 7.28-7.37 s against 318-345 steps
in 6.67-6.97 s without (``critical_rows=0``, three rounds): a full batch's drafted tokens cost
a CPU more than the steps they save. (A GPU's default steps its bulk plain, launched ahead,
where no row drafts.)
"""
from __future__ import annotations

from tailrl.engine.request import Request
from tailrl.speculative.history import HistoryStore


def by_history(reqs: list[Request], history: HistoryStore) -> list[Request]:
    """``reqs`` in admission order: longest expected first, stable (as they are without history)."""
    lengths = {pid: history.lengths(pid) for pid in {r.prompt_id for r in reqs if r.prompt_id}}
    if not any(lengths.values()):
        return reqs

    def expected(r: Request) -> float:
        if r.priority > 0:
            return r.priority
        past, cap = lengths.get(r.prompt_id), r.params.max_tokens
        return float(min(max(past), cap) if past else cap)
    return sorted(reqs, key=lambda r: -expected(r))
